"""Capacity models of the two pools: latency at the SLO quantile as a function of engines.

Both are fed the measured rate and lengths and the engine's latency profile
(pdcluster.perf), then calibrated against what Prometheus showed at the current
number of engines, so the model's job is only to say how latency *changes* with one
engine more or less.

Prefill: TTFT = a part that does not depend on the number of engines c (the prompt's
own prefill, KV transfer, the first decode step) plus the wait in an engine's queue,
which does. The measured wait is scaled with c as one engine's M/M/1 mean wait scales
(the router queues each request at one engine); without a measured wait, M/M/c's
(Erlang C) tail stands in. A busy prefill engine batches whole prompts up to vLLM's
token budget, so its service time per request falls with load.

Decode is continuous batching: every running sequence advances one token per step and
a step takes d0 + d1*B + d2*K (perf.Profile). By Little's law the sequences an engine
holds grow with its step time, which grows with the sequences it holds; the fixed point
is closed-form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdcluster.perf import Profile
from pdcluster.vllm import defaults

# vLLM's default per-step token budget (pdcluster.vllm.defaults).
MAX_BATCHED_TOKENS = defaults.MAX_NUM_BATCHED_TOKENS
KV_LIMIT = 0.9  # plan decode KV below this share of capacity (vLLM preempts when full)
# Plan prefill engines at most this busy: with batches of whole prompts and heavy-tailed
# prompt lengths the wait grows much faster near saturation than a queueing formula says.
PREFILL_MAX_BUSY = 0.75
# A window's served rate stands for the engines' service time only on engines measured
# busy at least this share of it: mostly idle engines that served fewer than arrived did
# so because a few prompts came together, not because they were full.
PREFILL_SATURATED_BUSY = 0.5


def erlang_c(servers: int, load: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with `load` Erlangs offered."""
    if load <= 0.0:
        return 0.0
    if load >= servers:
        return 1.0
    blocking = 1.0  # Erlang B, by its stable recursion
    for k in range(1, servers + 1):
        blocking = load * blocking / (k + load * blocking)
    return servers * blocking / (servers - load * (1.0 - blocking))


def wait_quantile(servers: int, rate: float, service_s: float, q: float) -> float:
    """The q-quantile of the wait in an M/M/c queue: P(W > t) = C * exp(-(c - a) t / S)."""
    load = rate * service_s
    if load >= servers:
        return math.inf
    waiting = erlang_c(servers, load)
    if waiting <= 1.0 - q:
        return 0.0
    return service_s / (servers - load) * math.log(waiting / (1.0 - q))


def per_engine_wait(engines: int, rate: float, service_s: float) -> float:
    """Mean wait of one of `engines` queues sharing the load (M/M/1 each): the router
    gives every request to one engine on arrival, and a busy engine finishes its batch
    before it takes the next."""
    busy = rate * service_s / engines
    return math.inf if busy >= 1.0 else service_s * busy / (1.0 - busy)


def prefill_service_s(
    profile: Profile, input_tokens: float, hit_ratio: float, per_step: float | None = None
) -> float:
    """Seconds of engine time per request when an engine is busy (prompts batched), or
    at `per_step` prompts a step."""
    a, b, c = profile.prefill_coef
    new = max(input_tokens * (1.0 - hit_ratio), 1.0)
    # Attention of the new tokens over the whole prompt: c * (L^2 - cached^2).
    per_request = b * new + c * input_tokens**2 * (1.0 - hit_ratio**2)
    # Whole prompts fill vLLM's token budget, about half a prompt short on average.
    per_batch = per_step or max(1.0, (MAX_BATCHED_TOKENS - new / 2.0) / new)
    return (a / per_batch + per_request) / 1000.0


def mean_prefill_service_s(
    profile: Profile,
    input_tokens: float,
    hit_ratio: float,
    lengths: tuple[tuple[float, float], ...] = (),
    per_step: float | None = None,
) -> float:
    """Mean engine time per request over the observed prompt lengths.

    Prefill time is convex in the prompt (attention is quadratic), so a few long prompts
    cost far more than the mean prompt suggests. Each bucket of vLLM's prompt-length
    histogram stands for the geometric middle of its bounds; the middles are scaled so
    that their mean is the measured mean prompt.
    """
    middles, counts, lower = [], [], 0.0
    for upper, count in lengths:
        if count > 0:
            if math.isinf(upper):
                middles.append(2.0 * lower)
            else:
                middles.append(math.sqrt(lower * upper) if lower > 0 else upper / 2.0)
            counts.append(count)
        lower = upper
    total = sum(counts)
    if not total or not sum(middles):
        return prefill_service_s(profile, input_tokens, hit_ratio, per_step)
    scale = input_tokens / (sum(m * n for m, n in zip(middles, counts, strict=True)) / total)
    return (
        sum(
            n * prefill_service_s(profile, m * scale, hit_ratio, per_step)
            for m, n in zip(middles, counts, strict=True)
        )
        / total
    )


@dataclass(frozen=True)
class PrefillModel:
    rate: float  # requests/s
    service_s: float  # engine-seconds per request
    fixed_ms: float  # the part of the TTFT quantile no number of engines changes
    quantile: float
    # Observed wait quantile / modelled mean wait at the observed engines: the measured
    # wait, scaled as the per-engine mean wait scales. None: M/M/c's own tail.
    wait_scale: float | None = None

    def wait_ms(self, engines: int) -> float:
        if engines <= 0:
            return math.inf
        if self.wait_scale is not None:
            return 1000.0 * self.wait_scale * per_engine_wait(engines, self.rate, self.service_s)
        return 1000.0 * wait_quantile(engines, self.rate, self.service_s, self.quantile)

    def ttft_ms(self, engines: int) -> float:
        return self.fixed_ms + self.wait_ms(engines)

    def load(self) -> float:
        """Offered load in engines (Erlangs)."""
        return self.rate * self.service_s

    def for_scale_down(self) -> PrefillModel:
        """The model a scale-down is judged by: the measured wait scaled as M/M/1's, but
        never below it. Engines that are mostly idle wait far less than that (the router
        gives a prompt to an idle one), which says little about fewer of them: on the
        synthetic hour the law let two of seven go on such a wait, and two minutes later
        five queued as M/M/1's do (87.8% of requests in the SLO; 90.9% with this floor,
        docs/benchmarks.md)."""
        if self.wait_scale is None or self.wait_scale >= 1.0:
            return self
        return replace(self, wait_scale=1.0)


def calibrate_prefill(
    profile: Profile,
    *,
    rate: float,
    input_tokens: float,
    hit_ratio: float,
    quantile: float,
    engines: float,
    observed_ttft_ms: float | None,
    observed_wait_ms: float | None,
    observed_wait_q_ms: float | None = None,
    served_rate: float | None = None,
    lengths: tuple[tuple[float, float], ...] = (),
    own_prefill: bool = True,
    measured_busy: float | None = None,
) -> PrefillModel:
    """A prefill model that reproduces the observed TTFT quantile at `engines`.

    The service time comes from the profile over the observed prompt lengths, bounded
    by what the engines served: engines that were never idle took engines / served_rate
    per request. While requests arrive faster than they are served and wait, the engines
    were never idle and the bound is the service time, the one estimate a backlog does
    not hide; unless the engines' `measured_busy` share shows them idle, when a few
    prompts that arrived together queued (on the Azure code weekday's nights a window's
    served rate 2-26% under its arrivals read 0.29-0.84 s a request on engines 7-18% busy).

    The observed TTFT quantile splits into the observed wait quantile, which engines
    change, and the rest, which they do not. The measured wait is kept (heavy-tailed
    prompts and batching make it nothing like an exponential tail) and only scaled with
    engines as the per-engine mean wait scales. With `own_prefill` false the latency is
    TTFT less the prompt's own prefill, whose prior without observations is then zero.
    """
    servers = max(round(engines), 1)  # engines seen is a window mean; queues are whole engines
    service = mean_prefill_service_s(profile, input_tokens, hit_ratio, lengths)
    seen = engines > 0 and rate > 0
    if seen and served_rate is not None and served_rate > 0:
        busy = engines / served_rate
        backlog = (
            served_rate < 0.98 * rate
            and (observed_wait_ms or 0.0) > 1000.0 * min(service, busy)
            and (measured_busy is None or measured_busy >= PREFILL_SATURATED_BUSY)
        )
        service = busy if backlog else min(service, busy)
    if not seen or observed_ttft_ms is None:
        fixed = profile.prefill_one_ms(int(input_tokens)) if own_prefill else 0.0
        return PrefillModel(rate, service, fixed, quantile)
    expected = per_engine_wait(servers, rate, service)
    if observed_wait_q_ms is not None and observed_wait_q_ms > 0 and 0 < expected < math.inf:
        model = PrefillModel(rate, service, 0.0, quantile, observed_wait_q_ms / 1000.0 / expected)
        waited = observed_wait_q_ms
    else:
        model = PrefillModel(rate, service, 0.0, quantile)
        waited = model.wait_ms(servers)
    fixed = observed_ttft_ms - waited if math.isfinite(waited) else 0.0
    return replace(model, fixed_ms=max(fixed, 0.0))


@dataclass(frozen=True)
class DecodeModel:
    rate: float  # requests/s
    output_tokens: float
    context: float  # mean tokens a running sequence holds in KV
    correction: float  # observed ITL quantile / modelled mean step time
    profile: Profile
    kv_scale: float = 1.0  # observed KV / modelled KV

    def step_ms(self, engines: float) -> float:
        """Mean step time on each of `engines` engines sharing the load (inf: unstable)."""
        if engines <= 0:
            return math.inf
        d0, d1, d2 = self.profile.decode_coef
        per_step_growth = (d1 / self.context + d2) * self.kv_per_ms(engines)
        if per_step_growth >= 1.0:
            return math.inf
        return d0 / (1.0 - per_step_growth)

    def kv_per_ms(self, engines: float) -> float:
        """KV tokens one engine holds per millisecond of step time (Little's law)."""
        return self.rate / engines * self.output_tokens * self.context * self.kv_scale / 1000.0

    def kv_usage(self, engines: float) -> float:
        return self.kv_per_ms(engines) * self.step_ms(engines) / self.profile.max_kv_tokens

    def itl_ms(self, engines: float) -> float:
        return self.correction * self.step_ms(engines)


def calibrate_decode(
    profile: Profile,
    *,
    rate: float,
    input_tokens: float,
    output_tokens: float,
    engines: float,
    observed_itl_ms: float | None,
    observed_kv_usage: float | None = None,
) -> DecodeModel:
    """A decode model whose KV usage and ITL at `engines` are the observed ones.

    KV first (how much the sequences really hold, e.g. longer prompts stay longer), then
    the ITL quantile against the modelled mean step.
    """
    context = max(input_tokens + output_tokens / 2.0, 1.0)
    model = DecodeModel(rate, max(output_tokens, 1.0), context, 1.0, profile)
    if engines <= 0:
        return model
    if observed_kv_usage is not None and observed_kv_usage > 0.02:
        modelled = model.kv_usage(engines)
        if 0 < modelled < math.inf:
            model = replace(model, kv_scale=min(max(observed_kv_usage / modelled, 0.5), 3.0))
    if observed_itl_ms is not None:
        step = model.step_ms(engines)
        if math.isfinite(step) and step > 0:
            # Tokens of the busiest engines set the quantile; never assume better than the mean.
            model = replace(model, correction=min(max(observed_itl_ms / step, 1.0), 4.0))
    return model


def fewest_engines(latency_ms, target_ms: float, limit: int, ok=lambda n: True) -> int | None:
    """The smallest n in 1..limit with latency_ms(n) <= target_ms and ok(n); None if none."""
    for n in range(1, limit + 1):
        if latency_ms(n) <= target_ms and ok(n):
            return n
    return None
