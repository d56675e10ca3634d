"""The prefill:decode control law (a colocated pool's is pool.py; `decide` runs either).

`decide` runs every `autoscaling.intervalSeconds`. It is pure: everything it remembers
lives in AutoscalingState (status), the time is passed in, and the latency profile is
loaded once and cached. The same code runs in the operator and in the fleet simulator.

Per role it computes two engine counts from a calibrated capacity model (models.py):
`need_up`, the fewest engines that keep the SLO quantile under target x (1 + tol), and
`need_down`, the fewest that keep it under target x (1 - tol). Below `need_up` it scales
up (fast); above `need_down` it scales down (slowly, and only with headroom observed);
in between it holds. The band between the two is the hysteresis that keeps a steady load
from flapping; both counts are computed for the load plus the tolerance, room for it to
grow while new engines start. While neither role's demand is bursty the models size with
half the tolerance (decode the whole of it while its load rises, the measured latencies
always), and then a scale-up the models ask for on a flat load whose latency keeps its
target is held as possible noise until the next run wants it too. A reactive rule adds
one engine when the SLO is violated and the model did not see why. At the GPU budget a
role that misses its target takes engines from the other role only while that one meets
its own, never below its model floor, and only once that role's scale-down has been
wanted for the whole metrics window (a voluntary scale-down waits out the longer
stabilization window); when both miss, engines move only if that clearly lowers the
worse of the two shortfalls.

Guards against the known failure modes of P/D autoscalers: metrics missing or no
traffic -> hold; a scale-up whose pods never become ready -> time out, fall back to
what is ready and stop asking for that role a while; state older than a few intervals
-> its timers are discarded; the autoscaler never reads back its own pending targets as
capacity (it calibrates on ready engines only).

A run is a chain of functions over frozen values, each in its own module: the context
and timers read from status (context.py), the demand's trend (trend.py), the needs
(needs.py, sized by sizing.py), the budget (budget.py), the stabilization
(stabilise.py), and the explanation (explain.py); what a run notices are typed notes
(notes.py), worded only in the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from pdcluster import perf
from pdcluster.api.v1alpha1 import AutoscalingState, Decision, LearnedCapacity, PDClusterSpec, ServingMode
from pdcluster.control import learn
from pdcluster.control.budget import Counts, fit_budget, gpu_total, split_budget
from pdcluster.control.cause import Cause, summary
from pdcluster.control.context import ROLES, Context, Role, Timer, Timers, context
from pdcluster.control.explain import Analysis, cause_of, figures, notes_of, reason, stages_status
from pdcluster.control.flexsplit import DONOR_SETTLE_S, lone_allowed, lone_wants, prefill_share
from pdcluster.control.needs import (
    Need,
    View,
    backlog_rate,
    calm_noise,
    decode_need,
    feedback_need,
    prefill_need,
    queue_growing,
    ttft_missed,
)
from pdcluster.control.notes import Note, NoteKind, note, with_notes, worded
from pdcluster.control.outcome import Outcome, action, next_state, observed_metrics, pending_from_now
from pdcluster.control.pool import pool_outcome
from pdcluster.control.seasonal import Forecasts, ahead, forecast_status, load_forecasts, observed
from pdcluster.control.stabilise import stabilise, time_out
from pdcluster.control.trend import (
    History,
    demand,
    growths,
    history_status,
    load_history,
    peak_spans,
    peaks,
    recent_runs,
    record,
    sizing_margin,
)
from pdcluster.control.types import MetricsSnapshot, Observed, breakdown
from pdcluster.timestamps import time_ms


def decide(
    spec: PDClusterSpec,
    metrics: MetricsSnapshot | None,
    state: AutoscalingState | None,
    observed: Observed,
    now: datetime,
    *,
    profile: perf.Profile | None = None,
) -> tuple[AutoscalingState, Decision]:
    """One run of the control law: the next state (to status) and the decision taken."""
    outcome = decide_outcome(spec, metrics, state, observed, now, profile=profile)
    return outcome.state, outcome.decision


def decide_outcome(
    spec: PDClusterSpec,
    metrics: MetricsSnapshot | None,
    state: AutoscalingState | None,
    observed: Observed,
    now: datetime,
    *,
    profile: perf.Profile | None = None,
) -> Outcome:
    """`decide`, with the figures and notes behind the decision's text."""
    if spec.mode == ServingMode.colocated:
        return pool_outcome(spec, metrics, state, observed, now)
    ctx = context(spec, state, observed, now)
    # The prior: the caller's (a ConfigMap's), else the named shipped one, else none.
    prior = profile or (perf.load(ctx.auto.profile) if ctx.auto.profile else None)
    start = _start(ctx)
    return _finish(ctx, start, metrics, _run(ctx, start, metrics, prior))


@dataclass(frozen=True)
class _Start:
    stored: Counts  # what the law set last (in recommend mode, what runs)
    current: Counts  # the same within the bounds and the GPU budget
    notes: tuple[Note, ...]


def _start(ctx: Context) -> _Start:
    stored, current, notes = {}, {}, []
    for role in ROLES:
        stored[role] = ctx.stored(role)
        current[role], clamp = ctx.clamped(role, ctx.bounds(role))
        notes += [clamp] if clamp else []
    budget = ctx.auto.gpu_budget
    if budget is not None and gpu_total(ctx, current) > budget:
        current = split_budget(ctx, current, budget)
        notes.append(
            note(
                NoteKind.over_budget,
                budget=budget,
                prefill=current[Role.prefill],
                decode=current[Role.decode],
            )
        )
    return _Start(stored, current, tuple(notes))


@dataclass(frozen=True)
class _End:
    """How a run ends, before it is written to status."""

    target: Counts
    cause: Cause
    reason: str
    notes: tuple[Note, ...]
    timers: Timers
    history: History
    capacity: LearnedCapacity | None
    forecasts: Forecasts
    role: Role | None = None
    analysis: Analysis | None = None


def _run(ctx: Context, start: _Start, m: MetricsSnapshot | None, prior: perf.Profile | None) -> _End:
    """The guards, in order, then the law itself."""
    timers, history, current = Timers.load(ctx), load_history(ctx), start.current
    forecasts = load_forecasts(ctx, ROLES)
    hold = f"hold {current[Role.prefill]}:{current[Role.decode]}"

    def held(cause: Cause, why: str, timers: Timers) -> _End:
        said = with_notes(f"{why}: {hold}", start.notes)
        return _End(dict(current), cause, said, start.notes, timers, history, ctx.prev.capacity, forecasts)

    if not ctx.auto.enabled:
        return held(Cause.disabled, "autoscaling disabled", timers)
    if ctx.spec.suspend:
        return held(Cause.suspended, "cluster suspended", timers)
    timers, fallback, role, timed_out = _time_out_scale_ups(ctx, timers, current)
    if timed_out:
        notes = start.notes + timed_out
        return _End(
            fallback,
            Cause.scale_up_timed_out,
            worded(notes),
            notes,
            timers,
            history,
            ctx.prev.capacity,
            forecasts,
            role,
        )
    if m is None or m.request_rate <= 0 or m.mean_input_tokens is None or m.mean_output_tokens is None:
        # Nothing to go on: no timer may keep running across the gap.
        timers = timers.cleared(Timer.up_since, Timer.down_since)
        if m is None:
            return held(
                Cause.metrics_unavailable, "metrics unavailable (Prometheus unreachable or no series)", timers
            )
        return held(Cause.no_traffic, f"no traffic in the last {m.window_s} s", timers)
    history = record(ctx, history, m)
    prefill_demand, decode_demand = demand(m)
    demands = {Role.prefill: prefill_demand, Role.decode: decode_demand}
    forecasts = observed(ctx, forecasts, demands)
    # Traffic's age by the runs kept whole: the hour's buckets may be older than a gap.
    whole_runs = recent_runs(ctx, history)
    traffic_s = ctx.since(whole_runs[0].time) if whole_runs else 0.0
    whole = learn.whole_window(m, ctx.seen(Role.decode).ready, traffic_s)
    capacity = learn.update(ctx.prev.capacity, m, whole)
    spans = peak_spans(ctx, history)
    view = View(
        None,
        current,
        growths(ctx, history, m),
        breakdown(m),
        ahead=ahead(ctx, forecasts, demands),
        peak=peaks(ctx, history, spans),
        peak_span=spans,
        backlog={
            Role.prefill: backlog_rate(ctx, m.prefill_queue, m.prefill.ready),
            Role.decode: backlog_rate(ctx, m.decode.waiting, m.decode.ready),
        },
        traffic_s=traffic_s,
        margin=sizing_margin(ctx, history),
    )
    a = _analyse(ctx, current, timers, view, m, learn.knowledge(capacity, prior, m))
    verdict, notes = cause_of(current, a), notes_of(start.notes, a)
    said = reason(ctx, current, a, notes)
    return _End(
        a.settled.target,
        verdict.cause,
        said,
        notes,
        a.settled.timers,
        history,
        capacity,
        forecasts,
        verdict.role,
        a,
    )


def _time_out_scale_ups(
    ctx: Context, timers: Timers, current: Counts
) -> tuple[Timers, Counts, Role | None, tuple[Note, ...]]:
    """The counts to fall back to where scale-ups timed out, the first such role, and why."""
    if ctx.recommend:
        return timers.cleared(Timer.pending), current, None, ()
    fallback, first, notes = dict(current), None, []
    for role in ROLES:
        timers, gave_up = time_out(ctx, timers, role, current[role])
        if gave_up is not None:
            fallback[role], first = gave_up.fallback, first or role
            notes.append(gave_up.note)
    return timers, fallback, first, tuple(notes)


def _analyse(
    ctx: Context,
    current: Counts,
    timers: Timers,
    view: View,
    m: MetricsSnapshot,
    known: learn.Knowledge,
) -> Analysis:
    view = replace(view, profile=known.profile, prefill_step_ms=known.prefill_step_ms)
    needs, wants = {}, {}
    for role in ROLES:
        if role in known.unseen:
            need = feedback_need(ctx, m, view, role, known.unseen[role], shed=known.decode_narrow)
        else:
            need = prefill_need(ctx, m, view) if role == Role.prefill else decode_need(ctx, m, view)
        needs[role], wants[role] = _want(ctx, current, role, need)
    if ctx.spec.mode == ServingMode.flexible and lone_allowed(ctx):
        wants = lone_wants(current, needs, wants)
    fit = fit_budget(ctx, current, wants, needs)
    # Bigger steps only into free GPUs: at a full budget they would come from the other role.
    free = ctx.auto.gpu_budget is None or gpu_total(ctx, current) < ctx.auto.gpu_budget
    surge = frozenset(r for r in ROLES if free and view.backlog[r] > 0 and queue_growing(m, r))
    # A scale-up that may be noise waits for the next run to want it too.
    twice = {r: ctx.auto.interval_seconds // 2 for r in ROLES if calm_noise(ctx, view, r, needs[r])}
    settled = stabilise(ctx, timers, current, fit.wants, fit.donor, surge, twice)
    return Analysis(m, view, needs, fit.wants, fit, settled, ttft_missed(ctx, m), wants)


def _want(ctx: Context, current: Counts, role: Role, need: Need) -> tuple[Need, int]:
    """What the role's need asks for, within its bounds (a reactive +1 noted on the need)."""
    cur = current[role]
    low, high = ctx.bounds(role)
    # Engines still starting: the window measured fewer, so no reactive step and no
    # scale-down on what they show.
    in_flight = not ctx.recommend and cur > ctx.seen(role).ready
    if need.reactive and not in_flight:
        want = cur + 1
        need = replace(need, notes=(*need.notes, note(NoteKind.reactive, role)))
    elif cur < need.up:
        want = need.up
    elif cur > need.down and need.headroom and not in_flight:
        want = need.down
    else:
        want = cur
    return need, min(max(want, low), high)


def _finish(ctx: Context, start: _Start, m: MetricsSnapshot | None, end: _End) -> Outcome:
    stored = {r.value: start.stored[r] for r in ROLES}
    target = {r.value: end.target[r] for r in ROLES}
    figs = figures(ctx, m, start.current, end.analysis)
    cause, role, why = end.cause, end.role, end.reason
    if ctx.spec.mode == ServingMode.flexible and end.analysis is not None:
        total = target["prefill"] + target["decode"]
        figs = replace(figs, asked={r.value: n for r, n in end.analysis.asked.items()})
        downs = end.timers.down_since
        easy = {
            r.value: need.headroom and r in downs and ctx.since(downs[r]) >= DONOR_SETTLE_S
            for r, need in end.analysis.needs.items()
        }
        prefill = prefill_share(total, target["prefill"], figs.asked, easy)
        if total == 1 and target["decode"] == 0 and stored["decode"] > 0:
            why = f"{why}; one engine serves requests whole (decode.minReplicas 0)"
        if prefill != target["prefill"]:
            target = {"prefill": prefill, "decode": total - prefill}
            cause, role = Cause.split_flipped, None
            why = f"{why}; flexible pool split {prefill}:{total - prefill} by flips"
    act, applied = action(ctx, stored, target)
    timers = pending_from_now(ctx, end.timers, {r: target[r.value] for r in ROLES}, applied)
    decision = Decision(
        time=time_ms(ctx.now),
        prefill=target["prefill"],
        decode=target["decode"],
        action=act,
        cause=cause.value,
        summary=summary(cause, figs, stored, target, role),
        reason=why,
        metrics=observed_metrics(m),
    )
    state = next_state(
        ctx,
        timers,
        applied,
        decision,
        prefill=target["prefill"],
        decode=target["decode"],
        history=history_status(end.history),
        capacity=end.capacity,
        forecast=forecast_status(end.forecasts),
        ttft_stages=stages_status(end.analysis.view.stages if end.analysis else None),
    )
    return Outcome(state, decision, figs, end.notes)
