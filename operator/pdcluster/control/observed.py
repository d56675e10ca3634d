"""The metrics read the one way both laws read them: the router's quantiles before the
engines', the one name of the TTFT the target applies to, and the part of the time to
first token that took longest."""

from __future__ import annotations

from enum import Enum

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
