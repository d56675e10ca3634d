"""One engine's capacity, learned from the engines' own metrics (pure).

The control law's capacity models (models.py) ask a latency profile how long a prefill
and a decode step take. A profile measured beforehand (pdcluster/data, or a ConfigMap
that `pdctl profile` wrote) is only a prior: every run of the law adds what the last
window showed, and the profile the models get is made from both. Without a prior the
law acts on TTFT/ITL feedback alone until a role has enough observations: one window for
prefill (its cost is measured directly), three for decode, and those at loads that tell
its fixed cost from its growth with the batch (see `decode_unseen`).

Prefill: engine-milliseconds per computed prompt token. vLLM's prefill time
(vllm:request_prefill_time_seconds, scheduled to first token) counts a whole batch for
every request in it, so the busy time is the requests' prefill time divided by the
requests per engine step (vllm:iteration_tokens_total counts steps). Engines cannot be
busier than always, which bounds the estimate when they queue.

Decode: each running sequence gets one token per step, so the window's mean step is
running sequences / tokens generated per second (vllm:num_requests_running,
vllm:generation_tokens). Step = d0 + d1 x sequences per engine + d2 x KV usage is fitted
by least squares over the last windows, older ones weighted down, pulled towards the
prior; the KV capacity in tokens is the sequences' context over the KV usage. Status
keeps it all in integers (the API has no floating-point fields).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdcluster.api.v1alpha1 import DecodeSample, LearnedCapacity, PrefillSample
from pdcluster.control import models
from pdcluster.control.types import MetricsSnapshot
from pdcluster.perf import Profile

FORGET = 0.9  # weight of everything before, per run: about ten runs of memory
DECODE_SAMPLES = 20  # decode windows kept (the oldest weighs 0.9^19 = 0.13)
# Runs with observations before a role's learned model is used without a prior.
MIN_WINDOWS = {"prefill": 1, "decode": 3}
# A decode step grows with the batch only once batches form, and a slope needs loads
# apart: below either the fit is noise, and extrapolating noise through the step's
# feedback (a longer step holds more sequences) can call one engine unstable.
DECODE_MIN_BATCH = 2.0  # sequences per engine, at the largest load seen
DECODE_MIN_SPREAD = 1.5  # largest over smallest load seen
PRIOR_WEIGHT = 2.0  # a prior counts as this many windows of observations
NO_PRIOR_WEIGHT = (
    0.01  # without one, "half the step is fixed" only picks among fits the data cannot tell apart
)
MAX_HIT = 0.95
PREFILL_SAMPLES = 20  # prefill windows kept, as for decode
MIN_PREFILL_SAMPLES = 3
# Batches this far apart (tokens per step) tell a step's fixed cost from its cost per token.
PREFILL_SPREAD = 2.0


@dataclass(frozen=True)
class DecodePoint:
    sequences: float  # running sequences per engine
    kv_usage: float  # 0..1
    step_ms: float


def _prefill_busy(m: MetricsSnapshot) -> tuple[float, float] | None:
    """This window's engine-seconds of prefill per second and prompt tokens computed per
    second; None when they cannot be told."""
    p = m.prefill
    if not p.tokens_per_s or not p.ready or not m.mean_input_tokens or p.prefill_time_ms is None:
        return None
    computed = p.tokens_per_s * (1.0 - min(max(m.prefix_hit_ratio or 0.0, 0.0), MAX_HIT))
    requests = p.tokens_per_s / m.mean_input_tokens
    per_step = requests / p.steps_per_s if p.steps_per_s else 1.0
    busy_s = requests * p.prefill_time_ms / 1000.0 / max(per_step, 1.0)
    return min(busy_s, p.ready), computed


def prefill_ms_per_token(m: MetricsSnapshot) -> float | None:
    """This window's engine-ms per computed prompt token; None when it cannot be told."""
    busy = _prefill_busy(m)
    return None if busy is None else busy[0] * 1000.0 / busy[1]


def prefill_point(m: MetricsSnapshot) -> PrefillSample | None:
    """This window's mean prefill step: tokens computed in it and engine time it took."""
    busy = _prefill_busy(m)
    steps = m.prefill.steps_per_s
    if busy is None or not steps:
        return None
    return PrefillSample(tokens_per_step=round(busy[1] / steps), step_us=round(busy[0] * 1e6 / steps))


def _kept(samples: list[PrefillSample]) -> list[PrefillSample]:
    """The newest PREFILL_SAMPLES, and the largest batch of the older ones when it is larger
    than any kept: a calm pool runs one prompt a step for hours, and without one large
    batch the fit could not tell a step's fixed cost from its tokens any more."""
    kept, older = samples[-(PREFILL_SAMPLES - 1) :], samples[: -(PREFILL_SAMPLES - 1)]
    if not older:
        return kept
    largest = max(older, key=lambda s: s.tokens_per_step)
    return (
        [largest, *kept]
        if largest.tokens_per_step > max(s.tokens_per_step for s in kept)
        else kept[-PREFILL_SAMPLES:]
    )


def fit_prefill(samples: list[PrefillSample]) -> tuple[float, float] | None:
    """A step's fixed cost (ms) and cost per token (ms) by least squares over the samples,
    the newest weighing most; None until their batches are PREFILL_SPREAD apart (one batch
    size cannot tell the two apart) or when the fit is not positive in both."""
    tokens = np.array([s.tokens_per_step for s in samples], dtype=float)
    if (
        len(samples) < MIN_PREFILL_SAMPLES
        or tokens.min() <= 0
        or tokens.max() < PREFILL_SPREAD * tokens.min()
    ):
        return None
    rows = np.stack([np.ones_like(tokens), tokens], axis=1)
    y = np.array([s.step_us / 1000.0 for s in samples])
    w = FORGET ** np.arange(len(samples) - 1, -1, -1, dtype=float)
    a, b = np.linalg.solve(rows.T @ (rows * w[:, None]), rows.T @ (w * y))
    return (float(a), float(b)) if a > 0 and b > 0 else None


def whole_window(m: MetricsSnapshot, ready_now: int, traffic_s: float) -> bool:
    """Whether the window's decode step can be told: the decode step is a gauge's window
    mean (sequences running) over a counter's rate (tokens generated), and Prometheus's
    rate() divides a series younger than the window by the whole window. Traffic seen for
    less than a window, or an engine that joined or left within it, makes the rate too low
    and the step too long (three times in the first 30 s of a 120 s window): a fit through
    such steps put a step's whole time in its fixed part and called decode unable to meet
    its target with any number of engines (docs/benchmarks.md, "Rebalancer")."""
    ready = m.decode.ready
    return traffic_s >= m.window_s and ready is not None and abs(ready - ready_now) < 0.05


def decode_point(m: MetricsSnapshot) -> DecodePoint | None:
    d = m.decode
    if not d.running or d.running < 0.5 or not d.tokens_per_s or not d.ready or m.decode_kv_usage is None:
        return None
    return DecodePoint(d.running / d.ready, m.decode_kv_usage, 1000.0 * d.running / d.tokens_per_s)


def _mean(old: float | None, new: float, windows: int) -> float:
    """A running mean over the first windows, an exponential one after."""
    if old is None or windows == 0:
        return new
    return old + (new - old) * max(1.0 - FORGET, 1.0 / (windows + 1))


def update(
    capacity: LearnedCapacity | None, m: MetricsSnapshot, decode_whole: bool = True
) -> LearnedCapacity:
    """What is known after this window. `decode_whole`: the window held the same decode
    engines throughout, with traffic from its start (see `whole_window`)."""
    c = capacity or LearnedCapacity()
    out = c.model_copy()
    per_token = prefill_ms_per_token(m)
    if per_token is not None and per_token > 0:
        old = None if c.prefill_ns_per_token is None else c.prefill_ns_per_token / 1e6
        out.prefill_ns_per_token = round(_mean(old, per_token, c.prefill_windows) * 1e6)
        out.prefill_windows = c.prefill_windows + 1
    step = prefill_point(m)
    if step is not None:
        out.prefill_samples = _kept([*(c.prefill_samples or []), step])
    point = decode_point(m) if decode_whole else None
    if point is not None:
        sample = DecodeSample(
            sequences_milli=round(point.sequences * 1000),
            kv_usage_ppm=round(point.kv_usage * 1e6),
            step_us=round(point.step_ms * 1000),
        )
        out.decode_samples = [*(c.decode_samples or []), sample][-DECODE_SAMPLES:]
        out.decode_windows = c.decode_windows + 1
        if point.kv_usage > 0.02 and m.mean_input_tokens and m.mean_output_tokens:
            tokens = point.sequences * (m.mean_input_tokens + m.mean_output_tokens / 2.0) / point.kv_usage
            kv = _mean(c.kv_capacity_tokens, tokens, c.decode_windows)
            out.kv_capacity_tokens = max(round(kv), 1)
    return out


def _fit_decode(
    samples: list[DecodeSample], prior: tuple[float, float, float] | None
) -> tuple[float, float, float]:
    """(d0, d1 per sequence, d2 per unit of KV usage) by least squares over the samples,
    the newest weighing most, pulled towards a prior; none of them negative."""
    rows = np.array([[1.0, s.sequences_milli / 1000.0, s.kv_usage_ppm / 1e6] for s in samples])
    y = np.array([s.step_us / 1000.0 for s in samples])
    w = FORGET ** np.arange(len(samples) - 1, -1, -1, dtype=float)
    xtx = rows.T @ (rows * w[:, None])
    xty = rows.T @ (w * y)
    n = w.sum()
    mb, mu, my = xtx[0, 1] / n, xtx[0, 2] / n, xty[0] / n
    if prior is None:  # half of the step fixed, half per sequence
        prior, weight = (my / 2.0, my / 2.0 / max(mb, 1e-9), 0.0), NO_PRIOR_WEIGHT
    else:
        weight = PRIOR_WEIGHT
    # One window's worth of pull on each coefficient, at the scale its column has.
    scales = np.array([1.0, max(mb, 1e-3) ** 2, max(mu, 1e-3) ** 2]) * weight
    free = [0, 1, 2]
    while True:
        a = xtx[np.ix_(free, free)] + np.diag(scales[free])
        rhs = xty[free] + scales[free] * np.asarray(prior)[free]
        theta = np.zeros(3)
        theta[free] = np.linalg.solve(a, rhs)
        negative = [j for j in free if theta[j] < 0]
        if not negative:
            return float(theta[0]), float(theta[1]), float(theta[2])
        free = [j for j in free if j not in negative]
        if not free:
            return 0.0, 0.0, 0.0


def decode_unseen(capacity: LearnedCapacity | None) -> str | None:
    """Why the decode samples cannot be fitted without a prior yet; None once they can."""
    c = capacity or LearnedCapacity()
    if c.decode_windows < MIN_WINDOWS["decode"]:
        return f"decode capacity learned from {c.decode_windows}/{MIN_WINDOWS['decode']} windows"
    loads = [s.sequences_milli / 1000.0 for s in c.decode_samples or []]
    low, high = min(loads, default=0.0), max(loads, default=0.0)
    if high < DECODE_MIN_BATCH or high < DECODE_MIN_SPREAD * low:
        return (
            f"decode seen at {low:.1f}-{high:.1f} sequences per engine, too narrow to fit "
            f"(needs a batch of {DECODE_MIN_BATCH:.0f} and loads {DECODE_MIN_SPREAD}x apart)"
        )
    return None


@dataclass(frozen=True)
class Knowledge:
    """The profile the capacity models get, and which roles it really describes."""

    profile: Profile
    prefill: bool  # False: prefill acts on TTFT feedback alone
    decode: bool
    unseen: dict[str, str]  # role -> why it is not known yet
    # Decode seen for the windows it needs, under a batch of DECODE_MIN_BATCH throughout
    # (short outputs): a step is then its fixed part, it stays unfitted, and its feedback
    # may shed an engine (bounds.decode_spares_one).
    decode_narrow: bool = False
    # A prefill step's fixed cost (ms) as the prior measured it on the GPU, unscaled (the
    # scale is a per-token figure); None without a prior. Not the fit's: between windows
    # the prompt mix moves the tokens per step as much as batching does (docs/benchmarks.md).
    prefill_step_ms: float | None = None


def knowledge(capacity: LearnedCapacity | None, prior: Profile | None, m: MetricsSnapshot) -> Knowledge:
    c = capacity or LearnedCapacity()
    input_tokens = m.mean_input_tokens or 1.0
    hit = min(max(m.prefix_hit_ratio or 0.0, 0.0), MAX_HIT)
    # Prefill: the prior's shape (per batch, per token, attention) scaled to what was
    # measured at this window's prompts; without a prior, linear in the tokens (the
    # measured cost per token is then that of this window's mix of lengths).
    prefill = prior.prefill_coef if prior else (0.0, 0.0, 0.0)
    per_token = None if c.prefill_ns_per_token is None else c.prefill_ns_per_token / 1e6
    if per_token is not None and (prior or c.prefill_windows >= MIN_WINDOWS["prefill"]):
        if prior:
            # What the prior says a token cost over this window's prompt lengths (long
            # prompts cost more per token), against what it did cost.
            new = max(input_tokens * (1.0 - hit), 1.0)
            steps = m.prefill.steps_per_s
            per_step = (
                max(m.prefill.tokens_per_s / input_tokens / steps, 1.0)
                if steps and m.prefill.tokens_per_s
                else None
            )
            service_s = models.mean_prefill_service_s(
                prior, input_tokens, hit, m.prefill.prompt_tokens, per_step
            )
            modelled = service_s * 1000.0 / new
            scale = per_token / modelled if modelled > 0 else 1.0
            prefill = tuple(x * scale for x in prior.prefill_coef)
        else:
            # Linear in the tokens would charge a step's fixed cost to every token, at
            # the batch size of the windows learned from: short prompts one to a step
            # cost twice per token what they cost batched (docs/benchmarks.md).
            fitted = fit_prefill(c.prefill_samples or [])
            prefill = (fitted[0], fitted[1], 0.0) if fitted else (0.0, per_token, 0.0)
    kv_tokens = c.kv_capacity_tokens or (prior.max_kv_tokens if prior else None)
    decode = prior.decode_coef if prior else (0.0, 0.0, 0.0)
    unseen = {} if prior else {"decode": decode_unseen(c)}
    if not prior and c.prefill_windows < MIN_WINDOWS["prefill"]:
        unseen["prefill"] = (
            f"prefill capacity learned from {c.prefill_windows}/{MIN_WINDOWS['prefill']} windows"
        )
    unseen = {role: why for role, why in unseen.items() if why}
    if c.decode_samples and "decode" not in unseen:
        prior_fit = None
        if prior:
            d0, d1, d2 = prior.decode_coef
            prior_fit = (d0, d1, d2 * (kv_tokens or prior.max_kv_tokens))
        d0, d1, d2u = _fit_decode(c.decode_samples, prior_fit)
        decode = (d0, d1, d2u / kv_tokens if kv_tokens else 0.0)
    profile = Profile(
        name=f"learned from {prior.name}" if prior else "learned",
        prefill_coef=prefill,
        decode_coef=decode,
        max_kv_tokens=kv_tokens or 1 << 40,
        kv_bytes_per_token=prior.kv_bytes_per_token if prior else 0,
        gpus=prior.gpus if prior else 1,
    )
    narrow = (
        "decode" in unseen
        and c.decode_windows >= MIN_WINDOWS["decode"]
        and max((x.sequences_milli / 1000.0 for x in c.decode_samples or []), default=0.0) < DECODE_MIN_BATCH
    )
    step_ms = prior.prefill_coef[0] if prior else None
    return Knowledge(profile, "prefill" not in unseen, "decode" not in unseen, unseen, narrow, step_ms)
