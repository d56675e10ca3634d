"""The metrics read the one way both laws read them: the router's quantiles before the
engines', the one name of the TTFT the target applies to and its value (with the
prefill wait at the SLO quantile), and the part of the time to first token that took
longest."""

from __future__ import annotations

import math
from enum import Enum

from pdcluster import observability as obs
from pdcluster.api.v1alpha1 import AutoscalingSpec
from pdcluster.control.types import MetricsSnapshot, RoleMetrics, TTFTBreakdown

# A request's TTFT less its prompt's own prefill compute (docs/metrics.md): what
# `slo.ttftMs` bounds when `ttftIncludesPrefill` is false.
TTFT_BEYOND_PREFILL = "TTFT beyond prefill"


def ttft_name(auto: AutoscalingSpec) -> str:
    """The name of the TTFT the target applies to, everywhere it is shown."""
    return "TTFT" if auto.ttft_includes_prefill else TTFT_BEYOND_PREFILL


def seen_ttft_ms(m: MetricsSnapshot, engines: RoleMetrics) -> float | None:
    """The router's TTFT quantile, else the engines' (a window without streamed requests)."""
    return m.ttft_ms if m.ttft_ms is not None else engines.ttft_ms


def seen_itl_ms(m: MetricsSnapshot, engines: RoleMetrics) -> float | None:
    """The router's ITL quantile, else the engines'."""
    return m.itl_ms if m.itl_ms is not None else engines.itl_ms


def pool_itl_ms(m: MetricsSnapshot) -> float | None:
    """A colocated pool's ITL: the quantile of each stream's mean time per output token,
    else the token gaps'. A step that computes a prompt chunk delays every stream on its
    engine once, so the gaps' tail jumps between a bare decode step and a chunk's time
    as long prompts come and go, while each stream's mean moves with the load
    (docs/benchmarks.md, "What the operator sees of a colocated pool")."""
    return m.tpot_ms if m.tpot_ms is not None else seen_itl_ms(m, m.colocated)


class Stage(Enum):
    """A part of the time to first token; its value is how the breakdown names it."""

    router = "router"
    prefill_queue = "prefill queue"
    prefill_compute = "prefill compute"
    kv_handoff = "KV hand-off"
    decode_wait = "decode wait"


def largest_stage(b: TTFTBreakdown | None) -> Stage | None:
    """Where most of the mean TTFT went; None without the router's stage histograms."""
    return None if b is None else Stage(b.largest)


def wait_quantile(auto: AutoscalingSpec, m: MetricsSnapshot) -> float | None:
    """The prefill wait at the SLO quantile (ms).

    vLLM's queue-time histogram starts with a 0-300 ms bucket; a quantile inside it
    is histogram_quantile's interpolation, not a measurement. There the exact mean
    says more: the quantile of an exponential tail with that mean.
    """
    hist, mean = m.prefill.queue_time_q_ms, m.prefill.queue_time_ms
    if hist is None:
        return mean
    if mean is not None and hist <= 1000.0 * obs.VLLM_REQUEST_LATENCY_BUCKETS[0]:
        q = auto.slo.quantile.fraction
        return min(hist, mean * math.log(1.0 / (1.0 - q)))
    return hist


def prefill_latency(auto: AutoscalingSpec, m: MetricsSnapshot) -> float | None:
    """The TTFT quantile the target applies to, or None when unseen."""
    ttft = seen_ttft_ms(m, m.prefill)
    if auto.ttft_includes_prefill or ttft is None:
        return ttft
    if m.ttft_beyond_prefill_ms is not None:
        return m.ttft_beyond_prefill_ms  # measured per request by the router
    # Engines that do not report their per-request timing: estimated as the prefill wait
    # plus what follows prefill (KV transfer, the first decode step), the router's TTFT
    # less the engine's.
    wait, engine = wait_quantile(auto, m), m.prefill.ttft_ms
    if wait is None or engine is None:
        return ttft  # errs towards more engines
    return wait + max(ttft - engine, 0.0)
