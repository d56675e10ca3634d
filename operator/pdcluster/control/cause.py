"""Why the control law decided what it did: one code per decision.

The code is the Autoscaling condition's reason and a label of the decisions metric; the
one-line summary (the condition's message and the Event's) is made from it and the
figures behind it. Tests assert on codes, not on text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Cause(StrEnum):
    disabled = "Disabled"
    suspended = "Suspended"
    metrics_unavailable = "MetricsUnavailable"
    no_traffic = "NoTraffic"
    scale_up_timed_out = "ScaleUpTimedOut"
    ttft_over_target = "TTFTOverTarget"  # observed TTFT above the target: more prefill
    burst_drains = "BurstDrains"  # TTFT missed in a burst the ready engines drain before a start-up: held
    prefill_short = "PrefillShort"  # TTFT still met, the load (and its trend) needs more prefill
    itl_over_target = "ITLOverTarget"
    kv_cache_full = "KVCacheFull"
    decode_short = "DecodeShort"
    prefill_headroom = "PrefillHeadroom"  # fewer prefill engines keep the target
    decode_headroom = "DecodeHeadroom"
    decode_wait = "DecodeWaitInTTFT"  # TTFT missed waiting for a decode step: more decode
    kv_handoff_slow = "KVHandoffSlow"  # TTFT missed in the KV hand-off: no engine count helps
    rebalanced = "Rebalanced"  # both roles miss their targets: engines moved to the worse one
    budget_full = "BudgetFull"  # a role is short and the GPU budget has nothing to give it
    stabilizing = "Stabilizing"  # a change is wanted; its stabilization window is not over
    cooling_down = "CoolingDown"
    scale_up_blocked = "ScaleUpBlocked"  # an earlier scale-up timed out
    within_targets = "WithinTargets"
    pool_headroom = "PoolHeadroom"  # colocated: fewer engines keep every target
    forecast_ramp = "ForecastRamp"  # the seasonal forecast sees a ramp one start-up ahead: more now
    queue_backlog = "QueueBacklog"  # a queue to drain within a window needs more engines
    queue_growing = "QueueGrowing"  # while a queue grows, a step of several maxSteps
    peak_floor = "RecentPeakFloor"  # a scale-down held at what the recent peak needed
    split_flipped = "SplitFlipped"  # flexible pool: engines flipped to the role short of them


@dataclass(frozen=True)
class Figures:
    """What a summary quotes: the figure that drove the decision and its threshold (the
    observed quantiles and their targets, the engines the model needs against the ready
    ones, the KV usage against its limit, the GPU budget)."""

    quantile: str
    ttft_ms: float | None
    ttft_target_ms: int
    itl_ms: float | None
    itl_target_ms: int
    kv_usage: float | None
    budget: int | None
    kv_handoff_ms: float | None = None
    decode_wait_ms: float | None = None
    kv_limit: float | None = None  # the KV usage the law scales decode up at
    needed: dict[str, int] = field(default_factory=dict)  # engines the model needs per role
    ready: dict[str, int] = field(default_factory=dict)  # engines ready per role
    prefill_load: float | None = None  # the prefill work, in busy engines
    stabilization_s: dict[str, int] = field(default_factory=dict)  # per role: the window waited out
    scale_up_timeout_s: dict[str, int] = field(default_factory=dict)  # per role: how long pods may take
    cooldown_s: int | None = None
    ttft_name: str = "TTFT"  # what ttft_ms is (control.observed.ttft_name): the TTFT the target applies to
    raw_ttft_ms: float | None = None  # the router's whole TTFT at the quantile, quoted beside it
    ahead: dict[str, float] = field(default_factory=dict)  # per role: the forecast's load / today's
    horizon_s: dict[str, int] = field(default_factory=dict)  # per role: how far ahead it looks
    queue: dict[str, float] = field(default_factory=dict)  # per role: requests waiting
    drain_s: int | None = None  # the window a queue is drained within
    max_step: int | None = None
    peak: dict[str, float] = field(default_factory=dict)  # per role: the recent peak's load / today's
    peak_span_s: dict[str, int] = field(default_factory=dict)
    floor: dict[str, int] = field(default_factory=dict)  # per role: engines the recent peak needs
    asked: dict[str, int] = field(default_factory=dict)  # per role: wanted before the GPU budget
    burst_wait_x: float | None = None  # a burst's wait quantile over what the arrival rate explains
    burst_drain_s: float | None = None  # the time the ready prefill engines drain its queue in
    startup_s: dict[str, int] = field(default_factory=dict)  # per role: a new engine's start-up


def _ms(value: float | None) -> str:
    return "unseen" if value is None else f"{value:.0f} ms"


def _engines(f: Figures, role: str | None) -> str:
    """'needs 6 engines, 4 ready' (with the load where the model has one)."""
    if role is None or role not in f.needed:
        return "engine need unknown"
    load = (
        f" (load of {f.prefill_load:.1f} engines)" if role == "prefill" and f.prefill_load is not None else ""
    )
    return f"{role} needs {f.needed[role]} engines{load}, {f.ready.get(role, 0)} ready"


def _raw(f: Figures) -> str:
    """' (TTFT 1177 ms)': the whole TTFT beside the one the target applies to, when they differ."""
    if f.ttft_name == "TTFT" or f.raw_ttft_ms is None:
        return ""
    return f" (TTFT {_ms(f.raw_ttft_ms)})"


def _shares(f: Figures) -> str:
    """'prefill wants 6 engines, decode 3'."""
    return f"prefill wants {f.asked.get('prefill', 0)} engines, decode {f.asked.get('decode', 0)}"


def _kv(f: Figures) -> str:
    used = "unseen" if f.kv_usage is None else f"{f.kv_usage:.0%}"
    return f"KV cache {used} full, limit {f.kv_limit or 0:.0%}"


def summary(
    cause: Cause, f: Figures, current: dict[str, int], target: dict[str, int], role: str | None
) -> str:
    """One short line: what changes (or holds) and why."""
    moves = [f"{r} {current[r]} -> {target[r]}" for r in target if target[r] != current[r]]
    held = ":".join(str(current[r]) for r in target) + (" colocated" if "colocated" in target else "")
    change = ", ".join(moves) if moves else f"hold {held}"
    q, tt = f.quantile, f.ttft_name
    why = {
        Cause.disabled: "autoscaling disabled",
        Cause.suspended: "cluster suspended",
        Cause.metrics_unavailable: "no metrics",
        Cause.no_traffic: "no traffic",
        Cause.scale_up_timed_out: f"{role} pods not ready within {f.scale_up_timeout_s.get(role or '', 0)} s",
        Cause.ttft_over_target: f"{tt} {q} {_ms(f.ttft_ms)} over {f.ttft_target_ms} ms{_raw(f)}",
        Cause.prefill_short: f"{_engines(f, 'prefill')}; {tt} {q} {_ms(f.ttft_ms)} of {f.ttft_target_ms} ms",
        Cause.burst_drains: f"{tt} {q} {_ms(f.ttft_ms)} over {f.ttft_target_ms} ms in a burst, its wait "
        f"{f.burst_wait_x or 0:.0f}x what the arrival rate explains; {f.ready.get('prefill', 0)} ready prefill "
        f"engines drain it in {f.burst_drain_s or 0:.0f} s, within a start-up ({f.startup_s.get('prefill', 0)} s)",
        Cause.itl_over_target: f"ITL {q} {_ms(f.itl_ms)} over {f.itl_target_ms} ms",
        Cause.kv_cache_full: f"{role if role == 'colocated' else 'decode'} {_kv(f)}",
        Cause.decode_short: f"{_engines(f, 'decode')}; ITL {q} {_ms(f.itl_ms)} of {f.itl_target_ms} ms",
        Cause.prefill_headroom: f"{tt} {q} {_ms(f.ttft_ms)} well under {f.ttft_target_ms} ms; {_engines(f, 'prefill')}",
        Cause.decode_headroom: f"ITL {q} {_ms(f.itl_ms)} well under {f.itl_target_ms} ms; {_engines(f, 'decode')}",
        Cause.decode_wait: f"{tt} {q} {_ms(f.ttft_ms)} over {f.ttft_target_ms} ms, "
        f"{_ms(f.decode_wait_ms)} of it waiting for a decode step",
        Cause.kv_handoff_slow: f"{tt} {q} {_ms(f.ttft_ms)} over {f.ttft_target_ms} ms, {_ms(f.kv_handoff_ms)} "
        "of it in the KV hand-off: check the KV transfer network, more engines would not help",
        Cause.rebalanced: f"both roles miss their targets ({tt} {q} {_ms(f.ttft_ms)} of {f.ttft_target_ms} ms, "
        f"ITL {q} {_ms(f.itl_ms)} of {f.itl_target_ms} ms): GPUs moved to {role}",
        Cause.budget_full: f"{_engines(f, role)} and the GPU budget of {f.budget} is full",
        Cause.stabilizing: f"{role} change waits out its {f.stabilization_s.get(role or '', 0)} s stabilization window",
        Cause.cooling_down: f"cooling down: {f.cooldown_s} s after the last change",
        Cause.scale_up_blocked: f"{role} scale-up blocked after a timeout",
        Cause.within_targets: f"{tt} {q} {_ms(f.ttft_ms)} of {f.ttft_target_ms} ms{_raw(f)}, ITL {q} {_ms(f.itl_ms)} "
        f"of {f.itl_target_ms} ms: within targets",
        Cause.pool_headroom: f"{tt} {q} {_ms(f.ttft_ms)} and ITL {q} {_ms(f.itl_ms)} well under "
        f"{f.ttft_target_ms} and {f.itl_target_ms} ms",
        Cause.forecast_ramp: f"{_engines(f, role)} for the load forecast {f.horizon_s.get(role or '', 0)} s "
        f"ahead, {f.ahead.get(role or '', 1.0):.2f}x today's (this time yesterday, with today's trend)",
        Cause.queue_backlog: f"{role} queue of {f.queue.get(role or '', 0.0):.0f} requests to drain within "
        f"{f.drain_s} s; {_engines(f, role)}",
        Cause.queue_growing: f"{role} queue of {f.queue.get(role or '', 0.0):.0f} requests growing: a step "
        f"past maxStep {f.max_step}; {_engines(f, role)}",
        Cause.peak_floor: f"{role} scale-down held at {f.floor.get(role or '', 0)} engines, what the peak of "
        f"the last {f.peak_span_s.get(role or '', 0)} s needs ({f.peak.get(role or '', 1.0):.2f}x today's load)",
        Cause.split_flipped: f"engines flipped to the role short of them, {_shares(f)} (no pod restarts)",
    }[cause]
    return f"{change}: {why}"
