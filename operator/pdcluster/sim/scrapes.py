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
from pdcluster.series import BY_FIELD, SERIES, Kind


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

    def window(self, t: float, window_s: float) -> Window | None:
        """The samples in [t - window, t]; None with fewer than two."""
        lo = bisect_left(self.times, t - window_s)
        hi = bisect_right(self.times, t)
        if hi - lo < 2:
            return None
        return Window(self.samples[lo:hi], t - window_s, t)


@dataclass(frozen=True)
class Window:
    """A range selector's samples, evaluated as PromQL evaluates them."""

    inside: list[Sample]
    start: float
    end: float

    @property
    def first(self) -> Sample:
        return self.inside[0]

    @property
    def last(self) -> Sample:
        return self.inside[-1]

    def increase(self, a: float, b: float) -> float:
        """increase() of a counter that went from a (first sample) to b (last sample):
        the change extrapolated towards the range's ends as Prometheus does (by at most
        half a scrape interval beyond the samples, and never below zero;
        extrapolatedRate in promql/functions.go)."""
        delta = b - a
        sampled = self.last.t - self.first.t
        average = sampled / (len(self.inside) - 1)
        to_start, to_end = self.first.t - self.start, self.end - self.last.t
        if delta > 0 and a >= 0:
            to_start = min(to_start, sampled * a / delta)
        threshold = 1.1 * average
        span = sampled + (to_start if to_start < threshold else average / 2)
        span += to_end if to_end < threshold else average / 2
        return delta * span / sampled

    def rate(self, a: float, b: float) -> float:
        return self.increase(a, b) / (self.end - self.start)

    def bucket_rates(self, name: str) -> list[float]:
        """rate() of each bucket alone (the last +Inf), from its cumulative `le` series."""
        rates, below, lo, hi = [], 0.0, 0, 0
        for a, b in zip(self.first.histograms[name][0], self.last.histograms[name][0], strict=True):
            lo, hi = lo + a, hi + b
            cumulative = max(self.rate(lo, hi), below)  # histogram_quantile's ensureMonotonic
            rates.append(cumulative - below)
            below = cumulative
        return rates

    def mean(self, name: str) -> float | None:
        """rate(x_sum[w]) / rate(x_count[w])."""
        _, s0, c0 = self.first.histograms[name]
        _, s1, c1 = self.last.histograms[name]
        return self.increase(s0, s1) / self.increase(c0, c1) if c1 > c0 else None

    def quantile_ms(self, name: str, bounds: tuple[float, ...], q: float) -> float | None:
        value = histogram_quantile(q, bounds, self.bucket_rates(name))
        return None if value is None else value * 1000.0


def _gauge_mean(samples: list[Sample], name: str) -> float | None:
    values = [s.gauges[name] for s in samples if name in s.gauges]
    return sum(values) / len(values) if values else None


# Names of the simulated series: the contract's keys (pdcluster.series), and the
# frontend series only Dynamo's planner reads.
ROUTER_TTFT = BY_FIELD["ttft_ms"].key
ROUTER_ITL = BY_FIELD["itl_ms"].key
ROUTER_TPOT = BY_FIELD["tpot_ms"].key
ROUTER_TTFT_BEYOND_PREFILL = BY_FIELD["ttft_beyond_prefill_ms"].key
ROUTER_PROMPT_TOKENS = BY_FIELD["prompt_tokens_rate"].key
ROUTER_PREFILL = BY_FIELD["router_prefill_ms"].key
ROUTER_AFTER_PREFILL = BY_FIELD["router_after_prefill_ms"].key
PREFILL_KV_HANDOFF = BY_FIELD["kv_handoff_ms"].key
ROUTER_FINISHED = BY_FIELD["finished_rate"].key
ROUTER_GENERATION_TOKENS = BY_FIELD["generated_tokens_rate"].key
PREFILL_TTFT = BY_FIELD["prefill_ttft_ms"].key
PREFILL_QUEUE_TIME = BY_FIELD["queue_time_ms"].key
PREFILL_TIME = BY_FIELD["prefill_time_ms"].key
PREFILL_STEPS = BY_FIELD["prefill_steps_rate"].key
PREFILL_PROMPT_TOKENS = BY_FIELD["prefilled_tokens_rate"].key
PREFILL_SUCCESS = BY_FIELD["prefilled_rate"].key
PREFIX_QUERIES = BY_FIELD["prefix_queries_rate"].key
PREFIX_HITS = BY_FIELD["prefix_hits_rate"].key
PREFILL_REQUEST_PROMPT_TOKENS = BY_FIELD["prompt_tokens"].key
PREFILL_WAITING = BY_FIELD["prefill_queue"].key
PREFILL_READY = BY_FIELD["prefill_ready"].key
DECODE_ITL = BY_FIELD["decode_itl_ms"].key
DECODE_GENERATION_TOKENS = BY_FIELD["decode_tokens_rate"].key
DECODE_RUNNING = BY_FIELD["decode_running"].key
DECODE_KV_USAGE = BY_FIELD["decode_kv_usage"].key
DECODE_READY = BY_FIELD["decode_ready"].key
REQUESTS_ARRIVED = "requests_arrived"  # what a frontend counts on receipt (Dynamo's requests_total)
REQUEST_DURATION = obs.ROUTER_E2E
INPUT_TOKENS = "input_sequence_tokens"  # per finished request (Dynamo frontend's ISL histogram)
OUTPUT_TOKENS = "output_sequence_tokens"

# Buckets of each histogram the contract reads (metric -> bounds): those the real ones have.
BUCKETS = {
    obs.ROUTER_TTFT: obs.ROUTER_TTFT_BUCKETS,
    obs.ROUTER_ITL: obs.ROUTER_ITL_BUCKETS,
    obs.ROUTER_TPOT: obs.ROUTER_ITL_BUCKETS,
    obs.ROUTER_TTFT_BEYOND_PREFILL: obs.ROUTER_TTFT_BUCKETS,
    obs.VLLM_TTFT: obs.VLLM_TTFT_BUCKETS,
    obs.VLLM_ITL: obs.VLLM_ITL_BUCKETS,
    obs.VLLM_QUEUE_TIME: obs.VLLM_REQUEST_LATENCY_BUCKETS,
    obs.VLLM_PREFILL_TIME: obs.VLLM_REQUEST_LATENCY_BUCKETS,
    obs.ROUTER_PREFILL: obs.ROUTER_TTFT_BUCKETS,
    obs.ROUTER_AFTER_PREFILL: obs.ROUTER_TTFT_BUCKETS,
    obs.VLLM_MOONCAKE_XFER_TIME: obs.VLLM_MOONCAKE_XFER_BUCKETS,
    obs.VLLM_ITERATION_TOKENS: obs.VLLM_ITERATION_TOKEN_BUCKETS,
    obs.VLLM_REQUEST_PROMPT_TOKENS: obs.vllm_request_token_buckets(1 << 20),
}


def histogram_bounds() -> dict[str, tuple[float, ...]]:
    tokens = obs.vllm_request_token_buckets(1 << 20)
    out = {s.key: BUCKETS[s.metric] for s in SERIES if s.histogram}
    return out | {REQUEST_DURATION: obs.ROUTER_E2E_BUCKETS, INPUT_TOKENS: tokens, OUTPUT_TOKENS: tokens}


def snapshot(scrapes: Scrapes, t: float, window_s: int, quantile: float) -> MetricsSnapshot | None:
    """The control law's view at time t: every field of pdcluster.series evaluated over
    the scrapes as its PromQL evaluates over Prometheus' samples (the parity test checks)."""
    found = scrapes.window(t, window_s)
    if found is None:
        return None
    earlier = scrapes.window(t - window_s, window_s)
    values: dict = {}
    for s in SERIES:
        window = earlier if s.kind == Kind.rate_before else found
        if window is None:
            continue
        first, last = window.first, window.last
        exported = first.counters if s.counter else first.histograms if s.histogram else None
        if exported is not None and s.key not in exported:
            continue  # a series this fleet does not export (a pool it has not), as Prometheus has none
        if s.counter:
            values[s.field] = window.rate(first.counters[s.key], last.counters[s.key])
        elif s.kind == Kind.quantile:
            values[s.field] = window.quantile_ms(s.key, scrapes.bounds[s.key], quantile)
        elif s.kind == Kind.mean:
            mean = window.mean(s.key)
            values[s.field] = None if mean is None else mean * 1000.0
        elif s.kind == Kind.count_rate:
            values[s.field] = window.rate(first.histograms[s.key][2], last.histograms[s.key][2])
        elif s.kind == Kind.buckets:
            bounds = (*scrapes.bounds[s.key], math.inf)
            values[s.field] = tuple(zip(bounds, window.bucket_rates(s.key), strict=True))
        else:  # gauges and engines: the simulator keeps the role's aggregate per scrape
            values[s.field] = _gauge_mean(window.inside, s.key)
    return assemble(window_s=window_s, **values)


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
    ttft, itl = found.mean(ROUTER_TTFT), found.mean(ROUTER_ITL)
    return FrontendAverages(
        num_req=found.increase(found.first.counters[REQUESTS_ARRIVED], found.last.counters[REQUESTS_ARRIVED]),
        ttft_ms=None if ttft is None else ttft * 1000.0,
        itl_ms=None if itl is None else itl * 1000.0,
        request_duration_s=found.mean(REQUEST_DURATION),
        isl=found.mean(INPUT_TOKENS),
        osl=found.mean(OUTPUT_TOKENS),
    )
