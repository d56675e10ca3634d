"""What a run of either law hands back: the next state for status, the decision, and
the typed account behind the decision's text."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdcluster.api.v1alpha1 import AutoscalingState, Decision, ObservedMetrics
from pdcluster.control.cause import Figures
from pdcluster.control.context import Context, Role, Timer, Timers
from pdcluster.control.notes import Note
from pdcluster.control.observed import seen_itl_ms, seen_ttft_ms
from pdcluster.control.types import MetricsSnapshot


@dataclass(frozen=True)
class Outcome:
    """One run of a law."""

    state: AutoscalingState
    decision: Decision
    figures: Figures  # what the summary quotes
    notes: tuple[Note, ...]  # what the run noticed on the way, in order


def action(ctx: Context, stored: dict[str, int], target: dict[str, int]) -> tuple[str, bool]:
    """The decision's action, and whether the law applies it (not in recommend mode)."""
    changed = target != stored
    return ("recommend" if ctx.recommend else "scale") if changed else "hold", changed and not ctx.recommend


def pending_from_now(ctx: Context, timers: Timers, target: dict[Role, int], applied: bool) -> Timers:
    """An applied scale-up's wait for ready pods starts now (or earlier)."""
    if applied:
        for role, count in target.items():
            if count > ctx.seen(role).ready:
                timers = timers.start(Timer.pending, role, ctx.stamp)
    return timers


def next_state(
    ctx: Context, timers: Timers, applied: bool, decision: Decision, **fields: Any
) -> AutoscalingState:
    """The state to status: the counts and whatever else the law keeps in `fields`."""
    now = decision.time
    return AutoscalingState(
        last_run_time=now,
        last_change_time=now if applied else ctx.prev.last_change_time,
        **timers.status(),
        last_decision=decision,
        decisions=ctx.prev.decisions + (1 if applied else 0),
        **fields,
    )


def observed_metrics(m: MetricsSnapshot | None) -> ObservedMetrics | None:
    if m is None:
        return None

    def whole(x: float | None) -> int | None:
        return None if x is None or not math.isfinite(x) else round(x)

    return ObservedMetrics(
        ttft_ms=whole(seen_ttft_ms(m, m.prefill)),
        itl_ms=whole(seen_itl_ms(m, m.decode)),
        ttft_beyond_prefill_ms=whole(m.ttft_beyond_prefill_ms),
        request_rate_milli=whole(m.request_rate * 1000.0),
        mean_input_tokens=whole(m.mean_input_tokens),
        mean_output_tokens=whole(m.mean_output_tokens),
        prefill_queue=whole(m.prefill_queue),
        decode_kv_usage_percent=whole(None if m.decode_kv_usage is None else m.decode_kv_usage * 100.0),
    )
