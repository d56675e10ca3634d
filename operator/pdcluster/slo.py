"""The SLO as every place shows it: the status, `kubectl get pdc`, the demo's live line
and summary.

One reading of one metrics window: the TTFT the target applies to under its one name
(control.observed.ttft_name), the router's whole TTFT beside it, the ITL, and whether
the targets are met, judged as the control law judges them: above the target x
(1 + tolerancePercent) is missed (control.needs.ttft_missed).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.api.v1alpha1 import AutoscalingSpec, SLOStatus
from pdcluster.control.observed import (
    TTFT_BEYOND_PREFILL,
    pool_itl_ms,
    prefill_latency,
    seen_itl_ms,
    ttft_name,
)
from pdcluster.control.pool import POOL_WAIT, judged_ttft
from pdcluster.control.types import MetricsSnapshot

MET, MISSED, UNSEEN = "met", "missed", "unseen"


@dataclass(frozen=True)
class Reading:
    quantile: str  # e.g. "p90"
    ttft_name: str  # what ttft_ms is: "TTFT beyond prefill", "TTFT" or "prefill wait"
    ttft_ms: float | None  # the TTFT the target applies to
    raw_ttft_ms: float | None  # the router's whole TTFT
    itl_ms: float | None
    ttft_target_ms: int
    itl_target_ms: int
    tolerance: float  # tolerancePercent / 100

    def _missed(self, value: float | None, target: int) -> bool:
        return value is not None and value > target * (1.0 + self.tolerance)

    @property
    def verdict(self) -> str:
        if self._missed(self.ttft_ms, self.ttft_target_ms) or self._missed(self.itl_ms, self.itl_target_ms):
            return MISSED
        return UNSEEN if self.ttft_ms is None or self.itl_ms is None else MET

    def line(self) -> str:
        """'TTFT beyond prefill p90 304 ms of 1000 ms (TTFT 1177 ms), ITL p90 17 ms of 25 ms: met'."""
        q = self.quantile
        raw = f" (TTFT {_ms(self.raw_ttft_ms)})" if self.ttft_name != "TTFT" else ""
        return (
            f"{self.ttft_name} {q} {_ms(self.ttft_ms)} of {self.ttft_target_ms} ms{raw}, "
            f"ITL {q} {_ms(self.itl_ms)} of {self.itl_target_ms} ms: {self.verdict}"
        )

    def status(self) -> SLOStatus:
        return SLOStatus(
            verdict=self.verdict,
            quantile=self.quantile,
            ttft_name=self.ttft_name,
            ttft_beyond_prefill_ms=_whole(self.ttft_ms) if self.ttft_name == TTFT_BEYOND_PREFILL else None,
            prefill_wait_ms=_whole(self.ttft_ms) if self.ttft_name == POOL_WAIT else None,
            ttft_ms=_whole(self.raw_ttft_ms),
            itl_ms=_whole(self.itl_ms),
            summary=self.line(),
        )


def _ms(value: float | None) -> str:
    return "unseen" if value is None else f"{value:.0f} ms"


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


def _reading(
    auto: AutoscalingSpec, name: str, ttft: float | None, raw: float | None, itl: float | None
) -> Reading:
    slo = auto.slo
    return Reading(
        slo.quantile.value, name, ttft, raw, itl, slo.ttft_ms, slo.itl_ms, auto.tolerance_percent / 100.0
    )


def of_snapshot(auto: AutoscalingSpec, m: MetricsSnapshot | None, colocated: bool = False) -> Reading:
    """The window as the control law judges it: its own functions, on the snapshot of its
    own series table (pdcluster.series), which the operator and the demo both read."""
    if m is None or m.request_rate <= 0:  # the law sees no traffic: no figure to judge
        return _reading(auto, ttft_name(auto), None, None, None)
    if colocated:
        name, ttft = judged_ttft(auto, m)
        return _reading(auto, name, ttft, m.ttft_ms, pool_itl_ms(m))
    return _reading(auto, ttft_name(auto), prefill_latency(auto, m), m.ttft_ms, seen_itl_ms(m, m.decode))
