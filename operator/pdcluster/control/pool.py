"""The colocated pool's control law: one pool of engines against both targets.

Each colocated engine serves requests whole (chunked prefill), so one count answers
for TTFT, ITL and the KV cache at once. The law is feedback, as a Horizontal Pod
Autoscaler's is, on the same signals and guards as the prefill:decode law:

- pressure: the largest of TTFT / its target, ITL / its target and KV usage / the KV
  limit (the observed quantiles; without the prompt's own prefill, TTFT is the engines'
  queue time at the quantile when `ttftIncludesPrefill` is off);
- each signal's share is predicted at another count n as share x (engines / n) ^ GROWTH:
  TTFT and the KV cache in proportion to each engine's load, ITL faster (a decode step
  waits for the prefill chunks batched with it, and those grow with the load per engine);
- above target x (1 + tol), or KV above its limit: the fewest engines that bring every
  signal under its target, at least one more; ITL's tail, which a burst of long prompts
  lifts on any count, asks for at most one more, or a tolerance band more of a larger
  pool, unless a queue that grows confirms it, or the pool is saturated (then its
  throughput sizes every signal);
- while a scale-up's engines are still starting, or the window has not yet seen the
  engines now serving, it judged fewer: sized from the engines it saw, and nothing
  more if that is already asked for (ITL's tail waits for a window at the new count);
- below target x (1 - tol) on every signal, on a window that saw the engines now
  serving: the fewest engines whose predicted signals stay under 1 - tol, sized from
  the engines the window saw (never the last one);
- otherwise hold: the band between the two is the hysteresis.

Scale-ups wait out `scaleUpStabilizationSeconds`, scale-downs
`scaleDownStabilizationSeconds` and go to the most engines wanted in it; no change within `cooldownSeconds` of the last one;
at most `maxStep` engines per change; within the GPU budget and the role's bounds; a
scale-up whose pods are not ready within `scaleUpTimeoutSeconds` (while all are
scheduled, at least twice the measured start-up) falls back to the ready count and blocks
scale-ups as long. Everything remembered is in AutoscalingState.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from pdcluster.api.v1alpha1 import AutoscalingSpec, AutoscalingState, Decision, PDClusterSpec
from pdcluster.control import models
from pdcluster.control.cause import Cause, Figures, summary
from pdcluster.control.context import Context, Role, Timer, Timers, context
from pdcluster.control.needs import backlog_rate
from pdcluster.control.notes import Note, NoteKind, note, worded
from pdcluster.control.observed import pool_itl_ms, seen_ttft_ms
from pdcluster.control.outcome import Outcome, action, next_state, pending_from_now
from pdcluster.control.seasonal import Forecasts, ahead, forecast_status, horizon_s, load_forecasts, observed
from pdcluster.control.stabilise import step, time_out
from pdcluster.control.trend import demand
from pdcluster.control.types import MetricsSnapshot, Observed
from pdcluster.timestamps import time_ms

POOL_WAIT = "prefill wait"  # the colocated engines' queue time: what precedes a prompt's own prefill

ROLE = Role.colocated
Signals = dict[str, float | None]  # ttft, itl, kv: each as a share of its target (None when unseen)
# How each signal grows with the load per engine: share ~ (load / engines) ^ GROWTH. KV
# usage is the sequences' context, in proportion; TTFT holds the prompt's own prefill,
# which no engine count shortens (a queue that grows is sized by the throughput). ITL's
# tail grows faster: on the Azure code weekday at peak 4 the law went from 3 engines to
# 2 at an ITL p90 of 12 ms and saw 44 ms at the same load per engine; sized in
# proportion it went back and forth between 2 and 5 engines all afternoon
# (docs/benchmarks.md, "Colocated pool": 1.25, 1.5 and 2 measured).
GROWTH = {"ttft": 1.0, "itl": 1.5, "kv": 1.0}


def pool_outcome(
    spec: PDClusterSpec,
    metrics: MetricsSnapshot | None,
    state: AutoscalingState | None,
    observed: Observed,
    now: datetime,
) -> Outcome:
    """One run of the colocated pool's law: the next state (to status), the decision, and
    the figures and notes behind it."""
    ctx = context(spec, state, observed, now)
    current, clamp = ctx.clamped(ROLE, _bounds(ctx))
    end = _run(ctx, current, (clamp,) if clamp else (), metrics)
    return _finish(ctx, current, metrics, end)


def _bounds(ctx: Context) -> tuple[int, int]:
    r = ctx.spec.colocated
    high = max(r.max_replicas, r.min_replicas)
    if ctx.auto.gpu_budget is not None:
        high = min(high, max(ctx.auto.gpu_budget // ctx.gpus(ROLE), r.min_replicas))
    return r.min_replicas, high


@dataclass(frozen=True)
class _End:
    target: int
    cause: Cause
    reason: str
    notes: tuple[Note, ...]
    timers: Timers
    want: int | None = None  # what the signals ask for (the summary quotes it)
    forecasts: Forecasts | None = None
    burst: Burst | None = None


def _run(ctx: Context, current: int, notes: tuple[Note, ...], m: MetricsSnapshot | None) -> _End:
    """The guards, in order, then the law itself."""
    timers, hold = Timers.load(ctx), f"hold {current}"
    if not ctx.auto.enabled or ctx.spec.suspend:
        cause = Cause.disabled if not ctx.auto.enabled else Cause.suspended
        return _End(current, cause, f"{cause.value}: {hold}", notes, timers)
    timers, gave_up = time_out(ctx, timers, ROLE, current)
    if gave_up is not None:
        notes = (*notes, gave_up.note)
        return _End(gave_up.fallback, Cause.scale_up_timed_out, worded(notes), notes, timers)
    if m is None or m.request_rate <= 0:
        timers = timers.cleared(Timer.up_since, Timer.down_since)  # no timer runs across a gap
        why = "metrics unavailable (Prometheus unreachable or no series)" if m is None else "no traffic"
        cause = Cause.metrics_unavailable if m is None else Cause.no_traffic
        return _End(current, cause, f"{why}: {hold}", notes, timers)
    signals = _signals(ctx, m)
    want, wanting, starting = _want(ctx, current, m, signals)
    demand_now = {ROLE: demand(m)[0]}  # prompt tokens per second
    forecasts = observed(ctx, load_forecasts(ctx, (ROLE,)), demand_now)
    burst = _burst(ctx, current, m, signals, want, ahead(ctx, forecasts, demand_now)[ROLE])
    want = burst.want
    # A scale-down goes to the most engines wanted while it waited: on the bursty Azure
    # code weekday a 120 s window between two bursts asked for 2 engines where the
    # bursts needed 3 (docs/benchmarks.md, "Colocated pool"). The prefill:decode law
    # keeps its floor from the recent peak instead (trend.py).
    moved = step(
        ctx, timers, ROLE, current, want, ctx.auto.scale_down_stabilization_seconds, burst.surge, to_most=True
    )
    target, notes = moved.target, (*notes, *wanting, *((moved.note,) if moved.note else ()))
    # The cooldown keeps the law from flapping; a queue that grows is no flap.
    cooling = target != current and ctx.cooling and not (burst.surge and target > current)
    if cooling:
        notes, target = (*notes, note(NoteKind.cooling_down, since=ctx.prev.last_change_time)), current
    blocked = ROLE in timers.blocked and want > current
    held = Cause.cooling_down if cooling else Cause.scale_up_blocked if blocked else None
    cause = _burst_cause(ctx, burst, current, target) or _cause(
        signals, current, target, want, held, starting
    )
    return _End(
        target,
        cause,
        _reason(ctx, m, signals, current, want, target, notes),
        notes,
        moved.timers,
        want,
        forecasts,
        burst,
    )


@dataclass(frozen=True)
class Burst:
    """The signals' wish with the forecast, the queue and the recent peak, and why."""

    want: int
    driver: Cause | None = None  # forecast_ramp or queue_backlog, where one moved it
    surge: bool = False  # the queue grows: a scale-up goes all the way
    ahead: float = 1.0  # the forecast's load one start-up ahead / today's
    queue: float | None = None  # requests waiting


def _burst(
    ctx: Context, current: int, m: MetricsSnapshot, signals: Signals, want: int, ahead_by: float
) -> Burst:
    """As the prefill:decode law does (needs.py): a queue of more than one request per
    engine is drained within a window, and a ramp the forecast sees is met a start-up
    ahead (sized by the pressure, so by at most an unconfirmed step). Not the recent
    peak's floor: on the colocated benchmark it held 11 engines after the burst for no
    attainment, and kept for an hour while the load is bursty (trend.peak_spans), sized
    by the pressure at that peak, it held the whole budget through the Azure code
    weekday (docs/benchmarks.md, "Colocated pool")."""
    low, high = _bounds(ctx)
    measured = m.colocated.ready or ctx.seen(ROLE).ready or 1
    pressure = max((v for v in signals.values() if v is not None), default=0.0)
    served, isl, waiting = m.colocated.tokens_per_s, m.mean_input_tokens or 0.0, m.colocated.waiting
    drain = backlog_rate(ctx, waiting, measured)
    arriving = m.request_rate * isl
    surge = drain > 0 and served is not None and arriving > served
    driver, wanted = None, want
    if drain > 0 and served and isl:
        queued = math.ceil(measured * (m.request_rate + drain) * isl / served)
        if queued > wanted:
            wanted, driver = queued, Cause.queue_backlog
    ramp = min(math.ceil(measured * pressure * ahead_by), max(want, unconfirmed_step(ctx, current)))
    if ahead_by > 1.0 and pressure > 0 and ramp > wanted:
        wanted, driver = ramp, Cause.forecast_ramp
    wanted = min(max(wanted, low), high)
    return Burst(wanted, driver, surge, ahead_by, waiting)


def _burst_cause(ctx: Context, burst: Burst, current: int, target: int) -> Cause | None:
    if burst.surge and target - current > ctx.auto.max_step:
        return Cause.queue_growing
    if burst.driver is not None and target > current:
        return burst.driver
    return None


def _signals(ctx: Context, m: MetricsSnapshot) -> Signals:
    """Each signal as a share of its target (None when unseen)."""
    pool, slo = m.colocated, ctx.auto.slo
    _, ttft = judged_ttft(ctx.auto, m)
    itl = pool_itl_ms(m)
    return {
        "ttft": None if ttft is None else ttft / slo.ttft_ms,
        "itl": None if itl is None else itl / slo.itl_ms,
        "kv": None if pool.kv_usage is None else pool.kv_usage / models.KV_LIMIT,
    }


def judged_ttft(auto: AutoscalingSpec, m: MetricsSnapshot) -> tuple[str, float | None]:
    """The TTFT the target applies to, named: the whole, or without the prompt's own
    prefill the engines' queue time at the quantile (what precedes its own chunked prefill)."""
    if not auto.ttft_includes_prefill and m.colocated.queue_time_q_ms is not None:
        return POOL_WAIT, m.colocated.queue_time_q_ms
    return "TTFT", seen_ttft_ms(m, m.colocated)


def _backlog(m: MetricsSnapshot) -> float | None:
    """Prompt tokens arriving over those the engines computed in the window: above 1,
    the pool is saturated and serves at its capacity, so that ratio of today's engines
    serves the load. None without the series."""
    served = m.colocated.tokens_per_s
    if not served or not m.mean_input_tokens:
        return None
    return m.request_rate * m.mean_input_tokens / served


def _want(
    ctx: Context, current: int, m: MetricsSnapshot, signals: Signals
) -> tuple[int, tuple[Note, ...], bool]:
    """What the signals ask for, why, and whether a scale-up asked for is still starting."""
    seen = {k: v for k, v in signals.items() if v is not None}
    pressure = max(seen.values(), default=0.0)
    # The KV limit has its margin built in (vLLM preempts only when full), as decode's has.
    violated = pressure > 1.0 + ctx.tol or (seen.get("kv") or 0.0) > 1.0
    headroom = bool(seen) and pressure < 1.0 - ctx.tol
    low, high = _bounds(ctx)
    ready = ctx.seen(ROLE).ready
    # What the window measured: the engines that served in it (its mean), not those
    # still starting. Until a window has seen the engines now serving, it judges fewer.
    measured = max(m.colocated.ready or ready, 1)
    in_flight = not ctx.recommend and current > ready
    unsettled = in_flight or measured < current - 0.5
    notes, starting = [], False
    # A queue inflates TTFT well past what more engines need to fix: when the pool is
    # saturated its throughput says how many, else the pressure does.
    backlog = _backlog(m)
    saturated = backlog is not None and backlog > 1.0 + ctx.tol
    if saturated:
        notes.append(note(NoteKind.saturated, backlog=backlog))
    if saturated and backlog:
        sized = itl_sized = math.ceil(measured * backlog)
    else:
        sized = engines_for({k: v for k, v in seen.items() if k != "itl"}, measured, 1.0)
        itl_sized = engines_for({k: v for k, v in seen.items() if k == "itl"}, measured, 1.0)
    # ITL's tail alone is no measure of how many engines the load needs (see
    # `unconfirmed_step`); a queue that grows confirms it.
    growing = backlog is not None and backlog > 1.0 and backlog_rate(ctx, m.colocated.waiting, measured) > 0
    if not (saturated or growing):
        itl_sized = min(itl_sized, unconfirmed_step(ctx, current))
    if violated and unsettled:
        # More only if the engines measured would not be enough either; unconfirmed,
        # ITL's tail waits for a window at the new count.
        want = max(current, sized, itl_sized if saturated or growing else 0)
        starting = want == current
        if starting:
            waits = (
                note(NoteKind.starting, target=current, ready=ready)
                if in_flight
                else note(NoteKind.unmeasured, measured=measured, engines=current)
            )
            notes.append(waits)
    elif violated:
        want = max(current + 1, sized, itl_sized)
    elif headroom and current > 1 and not unsettled:
        # Sized from the engines the window saw: after a scale-down it still holds
        # the larger count's load per engine.
        want = min(max(engines_for(seen, measured, 1.0 - ctx.tol), 1), current)
    else:
        want = current
    if want > high and violated:
        notes.append(note(NoteKind.beyond_limit, ROLE, limit=high))
    return min(max(want, low), high), tuple(notes), starting


def unconfirmed_step(ctx: Context, current: int) -> int:
    """The most engines a scale-up that neither the throughput nor a queue that grows
    confirms goes to: one more, or a tolerance band more of a larger pool. ITL's tail
    is such a signal: one burst of long prompts lifts it on any count. Sized by its p90,
    the pool law went between 2 and 5 engines within minutes all afternoon on the Azure
    code weekday at peak 4, where the hourly plan in hindsight holds 3 or 4
    (docs/benchmarks.md, "Colocated pool")."""
    return max(current + 1, math.ceil(current * (1.0 + ctx.tol)))


def engines_for(seen: dict[str, float], engines: float, limit: float) -> int:
    """The fewest engines at which every signal seen on `engines`, grown by GROWTH, stays
    under `limit` (a share of its target)."""
    return max(
        (math.ceil(engines * (share / limit) ** (1.0 / GROWTH[k])) for k, share in seen.items()), default=1
    )


def _cause(
    signals: Signals, current: int, target: int, want: int, held: Cause | None, starting: bool
) -> Cause:
    if target > current:
        worst = max((k for k, v in signals.items() if v is not None), key=lambda k: signals[k] or 0.0)
        return {"ttft": Cause.ttft_over_target, "itl": Cause.itl_over_target, "kv": Cause.kv_cache_full}[
            worst
        ]
    if target < current:
        return Cause.pool_headroom
    if held is not None:  # the cooldown, or a block after a timeout
        return held
    if want != current or starting:
        return Cause.stabilizing
    return Cause.within_targets


def _reason(
    ctx: Context,
    m: MetricsSnapshot,
    signals: Signals,
    current: int,
    want: int,
    target: int,
    notes: tuple[Note, ...],
) -> str:
    slo, q = ctx.auto.slo, ctx.auto.slo.quantile.value
    ttft_name, _ = judged_ttft(ctx.auto, m)
    goals = {
        "ttft": (ttft_name, slo.ttft_ms, " ms"),
        "itl": ("ITL", slo.itl_ms, " ms"),
        "kv": ("KV usage", 100 * models.KV_LIMIT, "%"),
    }
    parts = []
    for key, share in signals.items():
        name, goal, unit = goals[key]
        if share is None:
            parts.append(f"{name} unseen")
        else:
            parts.append(
                f"{name} {q if unit == ' ms' else 'mean'} {share * goal:.0f}{unit} of {goal:.0f}{unit}"
            )
    act = f"{target - current:+d} {ROLE}" if target != current else f"hold {current}"
    said = f" ({worded(notes)})" if notes else ""
    return f"{', '.join(parts)} at {m.request_rate:.2f} req/s; wants {want}: {act}{said}"


def _figures(ctx: Context, m: MetricsSnapshot | None, current: int, end: _End) -> Figures:
    want, burst = end.want, end.burst
    auto, slo = ctx.auto, ctx.auto.slo
    wait = (
        auto.scale_up_stabilization_seconds
        if (want or 0) > current
        else auto.scale_down_stabilization_seconds
    )
    ttft_name, ttft = ("TTFT", None) if m is None else judged_ttft(auto, m)
    return Figures(
        quantile=slo.quantile.value,
        ttft_ms=ttft,
        ttft_target_ms=slo.ttft_ms,
        ttft_name=ttft_name,
        raw_ttft_ms=None if m is None else seen_ttft_ms(m, m.colocated),
        itl_ms=None if m is None else pool_itl_ms(m),
        itl_target_ms=slo.itl_ms,
        kv_usage=None if m is None else m.colocated.kv_usage,
        budget=auto.gpu_budget,
        kv_limit=models.KV_LIMIT,
        needed={} if want is None else {ROLE.value: want},
        ready={ROLE.value: ctx.seen(ROLE).ready},
        stabilization_s={ROLE.value: wait},
        scale_up_timeout_s={ROLE.value: ctx.scale_up_timeout_s(ROLE)},
        cooldown_s=auto.cooldown_seconds,
        ahead={} if burst is None else {ROLE.value: burst.ahead},
        horizon_s={ROLE.value: round(horizon_s(ctx, ROLE))},
        queue={} if burst is None or burst.queue is None else {ROLE.value: burst.queue},
        drain_s=auto.window_seconds,
        max_step=auto.max_step,
    )


def _finish(ctx: Context, current: int, m: MetricsSnapshot | None, end: _End) -> Outcome:
    stored, target = {ROLE.value: ctx.stored(ROLE)}, {ROLE.value: end.target}
    act, applied = action(ctx, stored, target)
    timers = pending_from_now(ctx, end.timers, {ROLE: end.target}, applied)
    figs = _figures(ctx, m, current, end)
    decision = Decision(
        time=time_ms(ctx.now),
        colocated=end.target,
        action=act,
        cause=end.cause.value,
        summary=summary(end.cause, figs, stored, target, ROLE.value),
        reason=end.reason,
    )
    return Outcome(
        next_state(
            ctx,
            timers,
            applied,
            decision,
            colocated=end.target,
            forecast=None if end.forecasts is None else forecast_status(end.forecasts),
        ),
        decision,
        figs,
        end.notes,
    )
