"""Why the prefill:decode law decided what it did: the one cause that explains it best,
the figures its summary quotes, and the reason written out."""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.api.v1alpha1 import AutoscalingSpec, TTFTStages
from pdcluster.control import models
from pdcluster.control.budget import Counts, Fit
from pdcluster.control.cause import Cause, Figures
from pdcluster.control.context import ROLES, Context, Role
from pdcluster.control.needs import Need, View
from pdcluster.control.notes import Note, worded
from pdcluster.control.observed import Stage, largest_stage, prefill_latency, seen_itl_ms, ttft_name
from pdcluster.control.seasonal import horizon_s
from pdcluster.control.stabilise import Settled
from pdcluster.control.types import MetricsSnapshot, TTFTBreakdown


@dataclass(frozen=True)
class Analysis:
    """What a run that had metrics to go on found."""

    m: MetricsSnapshot
    view: View  # what the needs were computed from, besides the metrics
    needs: dict[Role, Need]
    wants: Counts
    fit: Fit
    settled: Settled
    ttft_missed: bool  # the TTFT quantile above its target x (1 + tol)
    asked: Counts  # what each role wants before the GPU budget (a flexible pool's shares)


@dataclass(frozen=True)
class Verdict:
    cause: Cause
    role: Role | None = None  # the role the cause concerns


def cause_of(current: Counts, a: Analysis) -> Verdict:
    """The one reason that explains the decision best, and the role it concerns."""
    target, needs = a.settled.target, a.needs
    up = [r for r in ROLES if target[r] > current[r]]
    down = [r for r in ROLES if target[r] < current[r]]
    if a.fit.rebalanced is not None and up:
        return Verdict(Cause.rebalanced, a.fit.rebalanced)
    if a.settled.surged in up:
        return Verdict(Cause.queue_growing, a.settled.surged)
    if up:
        role = max(up, key=lambda r: needs[r].pressure)
        return Verdict(needs[role].cause_up, role)
    if down:
        return Verdict(needs[down[0]].cause_down, down[0])
    if a.settled.cooling:
        return Verdict(Cause.cooling_down)
    if a.settled.blocked is not None:
        return Verdict(Cause.scale_up_blocked, a.settled.blocked)
    if largest_stage(a.view.stages) == Stage.kv_handoff and a.ttft_missed:
        return Verdict(Cause.kv_handoff_slow)
    if a.ttft_missed and needs[Role.prefill].burst is not None:
        return Verdict(Cause.burst_drains, Role.prefill)
    wanted = [r for r in ROLES if a.wants[r] != current[r]]
    if wanted:
        return Verdict(Cause.stabilizing, wanted[0])
    if a.fit.budget_full is not None:
        return Verdict(Cause.budget_full, a.fit.budget_full)
    # Held with a target missed (the model sees no count that would help): say so.
    if a.ttft_missed:
        return Verdict(Cause.ttft_over_target, Role.prefill)
    if needs[Role.decode].violated:
        return Verdict(needs[Role.decode].cause_up, Role.decode)
    held = [r for r in ROLES if needs[r].floor is not None and needs[r].headroom and current[r] > needs[r].up]
    if held:
        return Verdict(Cause.peak_floor, held[0])
    return Verdict(Cause.within_targets)


def notes_of(start_notes: tuple[Note, ...], a: Analysis) -> tuple[Note, ...]:
    """Every note of the run, in the order the reason gives them: the needs' first."""
    needs = tuple(n for r in ROLES for n in a.needs[r].notes)
    return needs + start_notes + a.fit.notes + a.settled.notes


def _quantile(name: str, value: float | None, goal: int, auto: AutoscalingSpec, tol: float) -> str:
    q = auto.slo.quantile.value
    if value is None:
        return f"{name} unseen"
    if value > goal * (1.0 + tol):
        return f"{name} {q} {value:.0f} ms > {goal} ms"
    return f"{name} {q} {value:.0f} ms ({100 * (1 - value / goal):+.0f}% headroom)"


def reason(ctx: Context, current: Counts, a: Analysis, notes: tuple[Note, ...]) -> str:
    """E.g. 'TTFT p90 820 ms > 500 ms, ITL p90 15 ms (+40% headroom) at 40.00 req/s;
    model needs 10:6: +2 prefill, -2 decode (notes)'."""
    auto, m, target = ctx.auto, a.m, a.settled.target
    ttft = _quantile(ttft_name(auto), prefill_latency(auto, m), auto.slo.ttft_ms, auto, ctx.tol)
    itl = _quantile("ITL", seen_itl_ms(m, m.decode), auto.slo.itl_ms, auto, ctx.tol)
    moves = [f"{target[r] - current[r]:+d} {r}" for r in ROLES if target[r] != current[r]]
    action = ", ".join(moves) if moves else f"hold {current[Role.prefill]}:{current[Role.decode]}"
    model = f"model needs {a.needs[Role.prefill].up}:{a.needs[Role.decode].up}"
    said = f"{ttft}, {itl} at {m.request_rate:.2f} req/s; {model}: {action}"
    return said + (f" ({worded(notes)})" if notes else "")


def figures(ctx: Context, m: MetricsSnapshot | None, current: Counts, a: Analysis | None) -> Figures:
    auto = ctx.auto
    needs, wants = (a.needs, a.wants) if a else ({}, {})
    view = a.view if a else None
    stages = view.stages if view else None
    burst = needs[Role.prefill].burst if needs else None
    return Figures(
        quantile=auto.slo.quantile.value,
        ttft_ms=None if m is None or m.request_rate <= 0 else prefill_latency(auto, m),
        ttft_target_ms=auto.slo.ttft_ms,
        ttft_name=ttft_name(auto),
        raw_ttft_ms=None if m is None else m.ttft_ms,
        itl_ms=None if m is None else seen_itl_ms(m, m.decode),
        itl_target_ms=auto.slo.itl_ms,
        kv_usage=None if m is None else m.decode_kv_usage,
        budget=auto.gpu_budget,
        kv_handoff_ms=None if stages is None else stages.kv_handoff_ms,
        decode_wait_ms=None if stages is None else stages.decode_wait_ms,
        kv_limit=models.KV_LIMIT,
        needed={r.value: n.up for r, n in needs.items()},
        ready={r.value: ctx.seen(r).ready for r in ROLES},
        prefill_load=needs[Role.prefill].load_engines if needs else None,
        stabilization_s={
            r.value: auto.scale_up_stabilization_seconds
            if w > current[r]
            else auto.scale_down_stabilization_seconds
            for r, w in wants.items()
        },
        scale_up_timeout_s={r.value: ctx.scale_up_timeout_s(r) for r in ROLES},
        cooldown_s=auto.cooldown_seconds,
        ahead={r.value: g for r, g in view.ahead.items()} if view else {},
        horizon_s={r.value: round(horizon_s(ctx, r)) for r in ROLES},
        queue=_queues(m),
        drain_s=auto.window_seconds,
        max_step=auto.max_step,
        peak={r.value: p for r, p in view.peak.items()} if view else {},
        peak_span_s={r.value: n for r, n in view.peak_span.items()} if view else {},
        floor={r.value: n.floor for r, n in needs.items() if n.floor is not None},
        burst_wait_x=burst.wait_x if burst else None,
        burst_drain_s=burst.drain_s if burst else None,
        startup_s={r.value: round(ctx.startup_s(r)) for r in ROLES},
    )


def _queues(m: MetricsSnapshot | None) -> dict[str, float]:
    if m is None:
        return {}
    seen = {"prefill": m.prefill_queue, "decode": m.decode.waiting}
    return {role: q for role, q in seen.items() if q is not None}


def stages_status(b: TTFTBreakdown | None) -> TTFTStages | None:
    if b is None:
        return None
    return TTFTStages(
        router_ms=round(b.router_ms),
        prefill_queue_ms=round(b.prefill_queue_ms),
        prefill_compute_ms=round(b.prefill_compute_ms),
        kv_handoff_ms=round(b.kv_handoff_ms),
        decode_wait_ms=round(b.decode_wait_ms),
    )
