"""What Prometheus would show of a simulated fleet.

The simulator's engines and router fill cumulative histograms and counters with the
buckets real ones use (pdcluster.observability); a scraper copies them every scrape
interval; policies only ever see window queries over those copies, evaluated the way
PromQL does (increase between the first and last sample in the window,
histogram_quantile's linear interpolation inside a bucket). Exact per-request
latencies are kept apart, for scoring only.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from pdcluster import observability as obs
from pdcluster.control.types import MetricsSnapshot, assemble


class Histogram:
    """A Prometheus histogram: per-bucket counts (the last is +Inf), sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def observe_steps(self, first: float, growth: float, steps: int, weight: int, skipped: int) -> None:
        """`steps` values first, first + growth, ... each seen `weight` times, less
        `skipped` observations of the first value (decode steps: every running sequence
        gets a token per step, and a sequence's first token is a TTFT, not an ITL)."""
        if steps <= 0:
            return
        total = weight * steps - skipped
        below = 0
        for j, bound in enumerate(self.bounds):
            if growth > 0:
                fit = min(max(math.floor((bound - first) / growth) + 1, 0), steps)
            else:
                fit = steps if first <= bound else 0
            cumulative = weight * fit - (skipped if fit else 0)
            self.counts[j] += cumulative - below
            below = cumulative
            if fit == steps:
                break
        self.counts[-1] += total - below
        self.sum += weight * (steps * first + growth * steps * (steps - 1) / 2) - skipped * first
        self.count += total

    def snapshot(self) -> tuple[tuple[int, ...], float, int]:
        return tuple(self.counts), self.sum, self.count


def histogram_quantile(
    q: float, bounds: tuple[float, ...], counts: list[int] | tuple[int, ...]
) -> float | None:
    """PromQL histogram_quantile over per-bucket counts (last bucket +Inf)."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    cumulative = 0
    for j, n in enumerate(counts):
        if cumulative + n >= rank and n > 0:
            if j == len(bounds):
                return bounds[-1]
            lower = bounds[j - 1] if j > 0 else 0.0
            return lower + (bounds[j] - lower) * (rank - cumulative) / n
        cumulative += n
    return bounds[-1]


@dataclass
class Sample:
    t: float
    histograms: dict[str, tuple[tuple[int, ...], float, int]]
    counters: dict[str, float]
    gauges: dict[str, float]


@dataclass
class Scrapes:
    """Every scrape of the fleet, in time order."""

    bounds: dict[str, tuple[float, ...]]
    samples: list[Sample] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def record(self, sample: Sample) -> None:
        self.samples.append(sample)
        self.times.append(sample.t)

    def window(self, t: float, window_s: float) -> tuple[Sample, Sample, list[Sample]] | None:
        """First and last sample in [t - window, t] and all of them; None with fewer than two."""
        lo = bisect_left(self.times, t - window_s)
        hi = bisect_right(self.times, t)
        if hi - lo < 2:
            return None
        inside = self.samples[lo:hi]
        return inside[0], inside[-1], inside


def _delta_counts(first: Sample, last: Sample, name: str) -> list[int]:
    return [b - a for a, b in zip(first.histograms[name][0], last.histograms[name][0], strict=True)]


def _delta_mean(first: Sample, last: Sample, name: str) -> float | None:
    """increase(x_sum[w]) / increase(x_count[w])."""
    _, s0, c0 = first.histograms[name]
    _, s1, c1 = last.histograms[name]
    return (s1 - s0) / (c1 - c0) if c1 > c0 else None


def _quantile_ms(scrapes: Scrapes, first: Sample, last: Sample, name: str, q: float) -> float | None:
    value = histogram_quantile(q, scrapes.bounds[name], _delta_counts(first, last, name))
    return None if value is None else value * 1000.0


def _gauge_mean(samples: list[Sample], name: str) -> float | None:
    values = [s.gauges[name] for s in samples if name in s.gauges]
    return sum(values) / len(values) if values else None


# Names of the simulated series (the real ones carry these names plus labels).
PREFILL_TTFT = f"{obs.VLLM_TTFT}:prefill"
DECODE_ITL = f"{obs.VLLM_ITL}:decode"
PREFILL_QUEUE_TIME = f"{obs.VLLM_QUEUE_TIME}:prefill"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
PREFILL_PROMPT_TOKENS = f"{obs.VLLM_PROMPT_TOKENS}:prefill"
PREFILL_SUCCESS = f"{obs.VLLM_REQUEST_SUCCESS}:prefill"
DECODE_GENERATION_TOKENS = f"{obs.VLLM_GENERATION_TOKENS}:decode"
PREFILL_REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens:prefill"
REQUESTS_ARRIVED = "requests_arrived"  # what a frontend counts on receipt (Dynamo's requests_total)
PREFILL_READY = "ready:prefill"
DECODE_READY = "ready:decode"
REQUEST_DURATION = obs.ROUTER_E2E
INPUT_TOKENS = "input_sequence_tokens"  # per finished request (Dynamo frontend's ISL histogram)
OUTPUT_TOKENS = "output_sequence_tokens"


def histogram_bounds() -> dict[str, tuple[float, ...]]:
    tokens = obs.vllm_request_token_buckets(1 << 20)
    return {
        obs.ROUTER_TTFT: obs.ROUTER_TTFT_BUCKETS,
        obs.ROUTER_ITL: obs.ROUTER_ITL_BUCKETS,
        PREFILL_TTFT: obs.VLLM_TTFT_BUCKETS,
        DECODE_ITL: obs.VLLM_ITL_BUCKETS,
        PREFILL_QUEUE_TIME: obs.VLLM_REQUEST_LATENCY_BUCKETS,
        REQUEST_DURATION: obs.ROUTER_E2E_BUCKETS,
        INPUT_TOKENS: tokens,
        OUTPUT_TOKENS: tokens,
        PREFILL_REQUEST_PROMPT_TOKENS: tokens,
    }


def snapshot(scrapes: Scrapes, t: float, window_s: int, quantile: float) -> MetricsSnapshot | None:
    """The control law's view at time t, as the Prometheus adapter would build it."""
    found = scrapes.window(t, window_s)
    if found is None:
        return None
    first, last, inside = found
    dt = last.t - first.t

    def rate(name: str) -> float:
        return (last.counters[name] - first.counters[name]) / dt

    queue_time = _delta_mean(first, last, PREFILL_QUEUE_TIME)
    earlier = scrapes.window(t - window_s, window_s)
    before = None
    if earlier is not None:
        e0, e1, _ = earlier
        before = (e1.counters[obs.ROUTER_PROMPT_TOKENS] - e0.counters[obs.ROUTER_PROMPT_TOKENS]) / (
            e1.t - e0.t
        )
    return assemble(
        window_s=window_s,
        prompt_tokens_rate=rate(obs.ROUTER_PROMPT_TOKENS),
        prefilled_tokens_rate=rate(PREFILL_PROMPT_TOKENS),
        prefilled_rate=rate(PREFILL_SUCCESS),
        finished_rate=rate(obs.ROUTER_REQUESTS),
        generated_tokens_rate=rate(obs.ROUTER_GENERATION_TOKENS),
        ttft_ms=_quantile_ms(scrapes, first, last, obs.ROUTER_TTFT, quantile),
        itl_ms=_quantile_ms(scrapes, first, last, obs.ROUTER_ITL, quantile),
        prefill_ttft_ms=_quantile_ms(scrapes, first, last, PREFILL_TTFT, quantile),
        decode_itl_ms=_quantile_ms(scrapes, first, last, DECODE_ITL, quantile),
        queue_time_ms=None if queue_time is None else queue_time * 1000.0,
        queue_time_q_ms=_quantile_ms(scrapes, first, last, PREFILL_QUEUE_TIME, quantile),
        prefill_queue=_gauge_mean(inside, obs.VLLM_WAITING),
        decode_kv_usage=_gauge_mean(inside, obs.VLLM_KV_USAGE),
        prefix_queries_rate=rate(PREFIX_QUERIES),
        prefix_hits_rate=rate(PREFIX_HITS),
        decode_tokens_rate=rate(DECODE_GENERATION_TOKENS),
        prefill_ready=_gauge_mean(inside, PREFILL_READY),
        decode_ready=_gauge_mean(inside, DECODE_READY),
        prompt_tokens_rate_before=before,
        prompt_tokens=tuple(
            zip(
                (*scrapes.bounds[PREFILL_REQUEST_PROMPT_TOKENS], math.inf),
                _delta_counts(first, last, PREFILL_REQUEST_PROMPT_TOKENS),
                strict=True,
            )
        ),
    )


@dataclass(frozen=True)
class FrontendAverages:
    """Dynamo's planner inputs: window means from the frontend's histograms."""

    num_req: float
    ttft_ms: float | None
    itl_ms: float | None
    request_duration_s: float | None
    isl: float | None
    osl: float | None


def frontend_averages(scrapes: Scrapes, t: float, window_s: float) -> FrontendAverages | None:
    found = scrapes.window(t, window_s)
    if found is None:
        return None
    first, last, _ = found
    ttft = _delta_mean(first, last, obs.ROUTER_TTFT)
    itl = _delta_mean(first, last, obs.ROUTER_ITL)
    return FrontendAverages(
        num_req=last.counters[REQUESTS_ARRIVED] - first.counters[REQUESTS_ARRIVED],
        ttft_ms=None if ttft is None else ttft * 1000.0,
        itl_ms=None if itl is None else itl * 1000.0,
        request_duration_s=_delta_mean(first, last, REQUEST_DURATION),
        isl=_delta_mean(first, last, INPUT_TOKENS),
        osl=_delta_mean(first, last, OUTPUT_TOKENS),
    )
