"""Why the control law decided what it did: one code per decision.

The code is the Autoscaling condition's reason and a label of the decisions metric; the
one-line summary (the condition's message and the Event's) is made from it and the
figures behind it. Tests assert on codes, not on text.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Cause(StrEnum):
    disabled = "Disabled"
    suspended = "Suspended"
    metrics_unavailable = "MetricsUnavailable"
    no_traffic = "NoTraffic"
    scale_up_timed_out = "ScaleUpTimedOut"
    ttft_over_target = "TTFTOverTarget"  # observed TTFT above the target: more prefill
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


@dataclass(frozen=True)
class Figures:
    """What a summary quotes: the observed quantiles and the targets."""

    quantile: str
    ttft_ms: float | None
    ttft_target_ms: int
    itl_ms: float | None
    itl_target_ms: int
    kv_usage: float | None
    budget: int | None
    kv_handoff_ms: float | None = None
    decode_wait_ms: float | None = None


def _ms(value: float | None) -> str:
    return "unseen" if value is None else f"{value:.0f} ms"


def summary(
    cause: Cause, f: Figures, current: dict[str, int], target: dict[str, int], role: str | None
) -> str:
    """One short line: what changes (or holds) and why."""
    moves = [f"{r} {current[r]} -> {target[r]}" for r in target if target[r] != current[r]]
    held = ":".join(str(current[r]) for r in target) + (" colocated" if "colocated" in target else "")
    change = ", ".join(moves) if moves else f"hold {held}"
    q = f.quantile
    why = {
        Cause.disabled: "autoscaling disabled",
        Cause.suspended: "cluster suspended",
        Cause.metrics_unavailable: "no metrics",
        Cause.no_traffic: "no traffic",
        Cause.scale_up_timed_out: f"{role} pods not ready in time",
        Cause.ttft_over_target: f"TTFT {q} {_ms(f.ttft_ms)} over {f.ttft_target_ms} ms",
        Cause.prefill_short: f"prefill load rising (TTFT {q} {_ms(f.ttft_ms)})",
        Cause.itl_over_target: f"ITL {q} {_ms(f.itl_ms)} over {f.itl_target_ms} ms",
        Cause.kv_cache_full: f"{role if role == 'colocated' else 'decode'} KV cache {0 if f.kv_usage is None else f.kv_usage:.0%} full",
        Cause.decode_short: f"decode load rising (ITL {q} {_ms(f.itl_ms)})",
        Cause.prefill_headroom: f"TTFT {q} {_ms(f.ttft_ms)} well under {f.ttft_target_ms} ms",
        Cause.decode_headroom: f"ITL {q} {_ms(f.itl_ms)} well under {f.itl_target_ms} ms",
        Cause.decode_wait: f"TTFT {q} {_ms(f.ttft_ms)} over {f.ttft_target_ms} ms, "
        f"{_ms(f.decode_wait_ms)} of it waiting for a decode step",
        Cause.kv_handoff_slow: f"TTFT {q} {_ms(f.ttft_ms)} over {f.ttft_target_ms} ms, {_ms(f.kv_handoff_ms)} "
        "of it in the KV hand-off: check the KV transfer network, more engines would not help",
        Cause.rebalanced: f"both roles miss their targets: GPUs moved to {role}",
        Cause.budget_full: f"{role} is short and the GPU budget {f.budget} is full",
        Cause.stabilizing: f"{role} change waits out its stabilization window",
        Cause.cooling_down: "cooling down after the last change",
        Cause.scale_up_blocked: f"{role} scale-up blocked after a timeout",
        Cause.within_targets: f"TTFT {q} {_ms(f.ttft_ms)}, ITL {q} {_ms(f.itl_ms)}: within targets",
        Cause.pool_headroom: f"TTFT {q} {_ms(f.ttft_ms)} and ITL {q} {_ms(f.itl_ms)} well under "
        f"{f.ttft_target_ms} and {f.itl_target_ms} ms",
    }[cause]
    return f"{change}: {why}"
