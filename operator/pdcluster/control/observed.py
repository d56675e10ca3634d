"""The metrics read the one way both laws read them: the router's quantiles before the
engines', and the part of the time to first token that took longest."""

from __future__ import annotations

from enum import Enum

from pdcluster.control.types import MetricsSnapshot, RoleMetrics, TTFTBreakdown


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
