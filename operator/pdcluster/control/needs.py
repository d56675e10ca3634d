"""What the capacity models say each role needs: the `Need` of one run, per role.

`need_up` is the fewest engines that keep the SLO quantile under target x (1 + tol),
`need_down` the fewest under target x (1 - tol); both for the load a window ahead plus
the tolerance, room for it to grow while new engines start. A role whose capacity is
not learned yet follows feedback alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TypeVar

from pdcluster import perf
from pdcluster.control import models
from pdcluster.control.bounds import (
    Burst,
    burst_of,
    decode_holds,
    decode_spares_one,
    prefill_busy,
    prefill_holds,
)
from pdcluster.control.cause import Cause
from pdcluster.control.context import Context, Role
from pdcluster.control.notes import Note, NoteKind, note
from pdcluster.control.observed import Stage, largest_stage, prefill_latency, seen_itl_ms, wait_quantile
from pdcluster.control.sizing import QUEUEING_SHARE, fewest_decode, fewest_prefill, prefill_bound
from pdcluster.control.types import MetricsSnapshot, TTFTBreakdown

Model = TypeVar("Model", models.PrefillModel, models.DecodeModel)


@dataclass(frozen=True)
class Need:
    """What the model says one role needs, and why."""

    up: int  # fewest engines within target x (1 + tol)
    down: int  # fewest engines within target x (1 - tol)
    pressure: float = 0.0  # observed quantile / target (0 when unseen)
    violated: bool = False  # observed quantile above target x (1 + tol)
    headroom: bool = False  # observed quantile below target x (1 - tol)
    reactive: bool = False  # violated although the model was content: add one
    cause_up: Cause = Cause.within_targets  # why more engines, if more
    cause_down: Cause = Cause.within_targets  # why fewer, if fewer
    load_engines: float | None = None  # the work, in busy engines, where the model has it
    floor: int | None = None  # the recent peak's engines, where they hold back a scale-down
    burst: Burst | None = None  # a TTFT miss the ready engines drain before a new one starts
    notes: tuple[Note, ...] = ()


@dataclass(frozen=True)
class View:
    """What the needs are computed from, besides the metrics."""

    profile: perf.Profile | None
    current: dict[Role, int]  # the engine counts the law starts from
    growth: dict[Role, float]  # the load a window ahead over today's (the trend)
    stages: TTFTBreakdown | None  # where the mean TTFT went, when the router shows it
    ahead: dict[Role, float] = field(default_factory=dict)  # the forecast's load a start-up ahead / today's
    peak: dict[Role, float] = field(default_factory=dict)  # the recent peak's load / today's
    peak_span: dict[Role, int] = field(default_factory=dict)  # how far back that peak was looked for (s)
    backlog: dict[Role, float] = field(default_factory=dict)  # requests/s that drain the queue in a window
    prefill_step_ms: float | None = None  # a prefill step's fixed cost, where known (learn.Knowledge)
    traffic_s: float = math.inf  # how long traffic has been seen: under a window, its rates read low
    margin: float | None = None  # the models' share beyond the load and short of the target (else tol)

    def sizing_margin(self, ctx: Context, role: Role) -> float:
        """The calm load's margin, else the tolerance; for decode also the tolerance while
        its load rises: a decode short on a ramp slows every stream it holds, and no
        queue drains it."""
        if self.margin is None or (role == Role.decode and self.factor(role) > 1.0):
            return ctx.tol
        return self.margin

    def factor(self, role: Role, forecast: bool = True) -> float:
        """What today's load is multiplied by to size for the time new engines serve."""
        return max(self.growth[role], self.ahead.get(role, 1.0) if forecast else 1.0)


def ttft_missed(ctx: Context, m: MetricsSnapshot) -> bool:
    ttft = prefill_latency(ctx.auto, m)
    return ttft is not None and ttft > ctx.auto.slo.ttft_ms * (1.0 + ctx.tol)


def limit(ctx: Context, role: Role) -> int:
    """The most engines the role may have: its bounds, and the whole GPU budget."""
    _, high = ctx.bounds(role)
    budget = ctx.auto.gpu_budget
    return high if budget is None else min(high, budget // ctx.gpus(role))


def _grown(
    ctx: Context, view: View, model: Model, role: Role, forecast: bool = True, queue: bool = True
) -> Model:
    """The model at the load new engines will serve: a window ahead by the trend or a
    start-up ahead by the forecast, plus the tolerance (room for noise, since latency
    rises steeply near capacity), plus the rate that drains the queue within a window."""
    backlog = view.backlog.get(role, 0.0) if queue else 0.0
    grown = view.factor(role, forecast) * (1.0 + view.sizing_margin(ctx, role))
    return replace(model, rate=model.rate * grown + backlog)


def calm_noise(ctx: Context, view: View, role: Role, need: Need) -> bool:
    """Whether a scale-up is one the models ask for, at their calm load's half
    tolerance, on a load that is not rising and whose measured quantile keeps its
    target within the whole tolerance: it may be noise in their calibration (one noisy
    window asked for an engine that the next gave back), so it must be wanted twice."""
    if view.sizing_margin(ctx, role) >= ctx.tol or need.up <= view.current[role] or need.violated:
        return False
    return view.factor(role) <= 1.0 and view.backlog.get(role, 0.0) <= 0


def backlog_rate(ctx: Context, queue: float | None, ready: float | None) -> float:
    """Requests/s beyond the arrivals that drain a queue within one metrics window; none
    for a queue of under one request per engine (batches forming, not a backlog)."""
    if queue is None or queue <= max(ready or 0.0, 1.0):
        return 0.0
    return queue / ctx.auto.window_seconds


def queue_growing(m: MetricsSnapshot, role: Role) -> bool:
    """Requests arrive at the role faster than it serves them: its queue grows."""
    if role == Role.prefill:
        served = m.prefill.tokens_per_s
        return served is not None and m.request_rate * (m.mean_input_tokens or 0.0) > served
    # Decode holds a request for its whole output: more waiting than running engines can
    # take means the KV cache is full and new requests queue behind it.
    kv = m.decode_kv_usage
    return kv is not None and kv > models.KV_LIMIT


@dataclass(frozen=True)
class Sized:
    up: int
    down: int
    driver: Cause | None  # the queue or the forecast, where either made `up` larger
    floor: int | None  # the recent peak's need, where it holds `down` above today's


def sized(ctx: Context, view: View, role: Role, base: Model, fewest, most: int) -> Sized:
    """The role's need up (with the trend, the forecast and the queue) and down (at the
    recent peak's load, a prefill wait no lower than M/M/1's), and which addition, if
    one, made it larger. `fewest(model, margin)` sizes a model (None: not within
    `most`); `base` is calibrated at today's load."""

    def engines(model: Model, margin: float, otherwise: int) -> int:
        return fewest(model, margin) or otherwise

    margin = view.sizing_margin(ctx, role)
    model = _grown(ctx, view, base, role)
    up = engines(model, margin, most)
    kept = model.for_scale_down() if isinstance(model, models.PrefillModel) else model
    peak = replace(kept, rate=kept.rate * view.peak.get(role, 1.0))
    down = max(engines(peak, -margin, most), up)
    floor = down if down > max(engines(kept, -margin, up), up) else None
    driver = None
    if view.backlog.get(role, 0.0) > 0 and up > engines(
        _grown(ctx, view, base, role, queue=False), margin, most
    ):
        driver = Cause.queue_backlog
    elif view.factor(role) > view.factor(role, forecast=False) and up > engines(
        _grown(ctx, view, base, role, forecast=False), margin, most
    ):
        driver = Cause.forecast_ramp
    return Sized(up, down, driver, floor)


def steady_prefill(ctx: Context, m: MetricsSnapshot, view: View) -> bool:
    """Whether the window's rates and busy share stand for the prefill engines it saw:
    traffic seen for a whole window, and the same engines ready all of it (the window's
    mean ready count a whole number). Prometheus's rate() divides a younger series by the
    whole window, and an engine that joined within it computed for part of it: the
    arrivals and the busy share then read low (a third of the truth in the first window
    of the Mooncake conversation hour). Engines that became ready since do not matter:
    the window measured the ones before them."""
    ready = m.prefill.ready
    return view.traffic_s >= m.window_s and ready is not None and abs(ready - round(ready)) < 0.05


def _prefill_model(
    ctx: Context, m: MetricsSnapshot, view: View, ttft: float | None, steady: bool
) -> models.PrefillModel:
    wait = _mean_wait(m)
    served = None if m.prefill.tokens_per_s is None else m.prefill.tokens_per_s / (m.mean_input_tokens or 1.0)
    ready = m.prefill.ready
    model = models.calibrate_prefill(
        view.profile,
        rate=m.request_rate,
        input_tokens=m.mean_input_tokens or 1.0,
        hit_ratio=min(max(m.prefix_hit_ratio or 0.0, 0.0), 0.95),
        quantile=ctx.auto.slo.quantile.fraction,
        engines=ready if ready is not None else float(ctx.seen(Role.prefill).ready),
        observed_ttft_ms=ttft,
        observed_wait_ms=wait,
        observed_wait_q_ms=wait_quantile(ctx.auto, m) if m.prefill.queue_time_ms is not None else wait,
        served_rate=served,
        lengths=m.prefill.prompt_tokens,
        own_prefill=ctx.auto.ttft_includes_prefill,
        measured_busy=prefill_busy(m) if steady else None,
    )
    return model


def prefill_part(ctx: Context, m: MetricsSnapshot, view: View) -> float | None:
    """The TTFT quantile prefill engines answer for: all of it, unless the router shows the
    time went after prefill (a decode wait, a slow hand-off); then the share of the mean
    TTFT that came before the prefill's answer. Without it a decode backlog read as a
    prefill's fixed cost of seconds, and prefill kept the engines decode needed."""
    ttft, stages = prefill_latency(ctx.auto, m), view.stages
    if ttft is None or stages is None or not _lost_after_prefill(view) or not m.ttft_mean_ms:
        return ttft
    before = stages.router_ms + stages.prefill_queue_ms + stages.prefill_compute_ms
    return ttft * min(before / m.ttft_mean_ms, 1.0)


def prefill_need(ctx: Context, m: MetricsSnapshot, view: View) -> Need:
    target, tol = float(ctx.auto.slo.ttft_ms), ctx.tol
    ttft = prefill_part(ctx, m, view)
    steady = steady_prefill(ctx, m, view)
    base = _prefill_model(ctx, m, view, ttft, steady)
    model = _grown(ctx, view, base, Role.prefill)
    bound_up, bound_down = (
        prefill_bound(model.fixed_ms, target, tol),
        prefill_bound(model.fixed_ms, target, -tol),
    )
    notes = []
    if model.fixed_ms > target * (1 - QUEUEING_SHARE) * (1 - tol):
        notes.append(
            note(NoteKind.queueing_share, fixed_ms=model.fixed_ms, queueing_ms=bound_up - model.fixed_ms)
        )
    most = limit(ctx, Role.prefill)
    if fewest_prefill(model, target, most, tol) is None:
        notes.append(note(NoteKind.beyond_limit, Role.prefill, load=model.load(), limit=most))
    size = sized(
        ctx, view, Role.prefill, base, lambda mo, margin: fewest_prefill(mo, target, most, margin), most
    )
    up = size.up
    need = Need(
        up,
        size.down,
        cause_down=Cause.prefill_headroom,
        load_engines=model.load(),
        floor=size.floor,
        notes=tuple(notes),
    )
    if ttft is not None:
        violated = ttft > bound_up
        # Without a measured wait the split into fixed and queueing is the model's
        # guess: then only headroom against the target itself counts.
        measured = m.prefill.queue_time_q_ms is not None
        queued = _mean_wait(m) or 0.0
        need = replace(
            need,
            pressure=ttft * (1 + tol) / bound_up,
            violated=violated,
            headroom=ttft < bound_down and (measured or ttft < target * (1 - tol)),
            # Unless the time went after prefill: prefill engines would not help then.
            reactive=violated
            and queued > 0.1 * target
            and up <= view.current[Role.prefill]
            and not _lost_after_prefill(view),
        )
    cur, step_ms = view.current[Role.prefill], view.prefill_step_ms
    grown = _growth(ctx, m, view, Role.prefill)
    burst = burst_of(ctx, m, model, grown, step_ms) if steady and need.violated and need.up > cur else None
    if burst is not None:
        drains = note(
            NoteKind.burst_drains,
            Role.prefill,
            ttft_ms=ttft,
            wait_x=burst.wait_x,
            busy=burst.busy,
            drain_s=burst.drain_s,
            startup_s=burst.startup_s,
            engines=cur,
        )
        need = replace(need, up=cur, burst=burst, notes=(*need.notes, drains))
    cause = Cause.ttft_over_target if need.violated else Cause.prefill_short
    need = replace(need, cause_up=size.driver or cause)
    # Under half the TTFT target the measured bound outranks the model's busy cap: on
    # ServeGen's day one prefill engine at 60% busy answered in 150 ms while the trend
    # asked for a second (and flapped it all day). The bound holds at the forecast's load,
    # not the trend's: ServeGen's rates change in steps, which the window's mean shows as
    # a ramp for a whole window, and the trend carries it a window past the new level. A
    # load that does keep rising takes the TTFT past half its target, and the model decides.
    cur, growth = view.current[Role.prefill], _growth(ctx, m, view, Role.prefill, trend=False)
    busy = prefill_busy(m)
    if need.up > cur and need.pressure < 0.5 and prefill_holds(ctx, m, growth, view.prefill_step_ms):
        held = note(
            NoteKind.measured_holds,
            Role.prefill,
            want=need.up,
            ttft_ms=ttft,
            busy=busy,
            growth=growth,
            engines=cur,
        )
        need = replace(need, up=cur, down=min(need.down, cur), notes=(*need.notes, held))
    elif need.down >= cur >= 2 and need.pressure < 0.3 and prefill_spares_one(ctx, m, view, cur):
        # The same bound lets go of an engine the recent peak's load would still keep; under
        # a third of the target only (at half, the Mooncake conversation hour lost 0.3 points).
        need = replace(need, down=cur - 1)
    return need


def prefill_spares_one(ctx: Context, m: MetricsSnapshot, view: View, engines: int) -> bool:
    """Whether `engines - 1` prefill engines keep the TTFT target at the recent peak's load
    (`prefill_holds` at engines / (engines - 1) times it)."""
    peak = max(view.factor(Role.prefill), view.peak.get(Role.prefill, 1.0)) * (1.0 + ctx.tol)
    return prefill_holds(ctx, m, peak * engines / (engines - 1), view.prefill_step_ms)


def _growth(ctx: Context, m: MetricsSnapshot, view: View, role: Role, trend: bool = True) -> float:
    """The load a bound must hold at, over today's: the law's factor (without `trend`, the
    forecast's alone) with its tolerance, plus the rate that drains the role's queue
    within a window."""
    factor = view.factor(role) if trend else max(view.ahead.get(role, 1.0), 1.0)
    return factor * (1.0 + ctx.tol) + view.backlog.get(role, 0.0) / max(m.request_rate, 1e-9)


def _mean_wait(m: MetricsSnapshot) -> float | None:
    """The mean prefill wait (ms); without the histogram, from the queue length (Little's law)."""
    if m.prefill.queue_time_ms is not None or m.prefill_queue is None:
        return m.prefill.queue_time_ms
    return m.prefill_queue / m.request_rate * 1000.0


def _lost_after_prefill(view: View) -> bool:
    return largest_stage(view.stages) in (Stage.kv_handoff, Stage.decode_wait)


def _decode_model(ctx: Context, m: MetricsSnapshot, view: View) -> models.DecodeModel:
    # While prefill drains a backlog, decode receives more than arrives.
    served = 0.0 if m.prefill.tokens_per_s is None else m.prefill.tokens_per_s / (m.mean_input_tokens or 1.0)
    ready = m.decode.ready
    model = models.calibrate_decode(
        view.profile,
        rate=max(m.request_rate, served),
        input_tokens=m.mean_input_tokens or 1.0,
        output_tokens=m.mean_output_tokens or 1.0,
        engines=ready if ready is not None else float(ctx.seen(Role.decode).ready),
        observed_itl_ms=seen_itl_ms(m, m.decode),
        observed_kv_usage=m.decode_kv_usage,
    )
    return model


def decode_need(ctx: Context, m: MetricsSnapshot, view: View) -> Need:
    target, tol = float(ctx.auto.slo.itl_ms), ctx.tol
    base = _decode_model(ctx, m, view)
    most = limit(ctx, Role.decode)
    reachable = fewest_decode(_grown(ctx, view, base, Role.decode), target, most, tol) is not None
    notes = () if reachable else (note(NoteKind.beyond_limit, Role.decode, limit=most, target_ms=target),)
    size = sized(
        ctx, view, Role.decode, base, lambda mo, margin: fewest_decode(mo, target, most, margin), most
    )
    up = size.up
    need = Need(up, size.down, cause_down=Cause.decode_headroom, floor=size.floor, notes=notes)
    itl, kv = seen_itl_ms(m, m.decode), m.decode_kv_usage
    kv_full = kv is not None and kv > models.KV_LIMIT
    if itl is not None:
        violated = itl > target * (1.0 + tol) or kv_full
        need = replace(
            need,
            pressure=max(itl / target, (kv or 0.0) / models.KV_LIMIT),
            violated=violated,
            headroom=itl < target * (1.0 - tol)
            and not (kv is not None and kv > models.KV_LIMIT * (1.0 - tol)),
            reactive=violated and up <= view.current[Role.decode],
        )
    need = replace(need, cause_up=size.driver or decode_cause(kv_full, need.violated))
    # Under half the ITL target the measured bound outranks the fit: one from a narrow
    # spread of loads asked for a second engine at a third of the target (ServeGen's day).
    cur, growth = view.current[Role.decode], _growth(ctx, m, view, Role.decode)
    if need.up > cur and need.pressure < 0.5 and decode_holds(ctx, m, growth):
        held = note(
            NoteKind.measured_holds,
            Role.decode,
            want=need.up,
            itl_ms=seen_itl_ms(m, m.decode),
            kv=m.decode_kv_usage or 0.0,
            growth=growth,
            engines=cur,
        )
        need = replace(need, up=cur, down=min(need.down, cur), notes=(held,))
    # Without the transfer-time series (vLLM 0.32 exports none) a decode wait may be a
    # slow hand-off: only a measured split asks for decode.
    waited = largest_stage(view.stages) == Stage.decode_wait and m.kv_handoff_ms is not None
    if not (waited and ttft_missed(ctx, m)):
        return need
    # Requests wait for a decode step before their first token: decode is short.
    more = max(need.up, view.current[Role.decode] + 1)
    itl_missed = itl is not None and itl > target * (1.0 + tol)
    return replace(
        need,
        up=more,
        down=more,
        violated=True,
        headroom=False,
        pressure=max(need.pressure, (prefill_latency(ctx.auto, m) or 0.0) / ctx.auto.slo.ttft_ms),
        cause_up=need.cause_up if kv_full or itl_missed else Cause.decode_wait,
    )


def decode_cause(kv_full: bool, violated: bool) -> Cause:
    if kv_full:
        return Cause.kv_cache_full
    return Cause.itl_over_target if violated else Cause.decode_short


def feedback_need(
    ctx: Context, m: MetricsSnapshot, view: View, role: Role, unseen: str, shed: bool = False
) -> Need:
    """A role whose capacity is not learned yet: one more engine while its SLO is
    missed; fewer only where another role needs the GPUs, or, with `shed` (decode that
    stays unfitted), where one fewer is bound to keep the target (`decode_spares_one`)."""
    cur, slo, tol = view.current[role], ctx.auto.slo, ctx.tol
    if role == Role.prefill:
        target, seen, full = float(slo.ttft_ms), prefill_part(ctx, m, view), False
    else:
        target, seen = float(slo.itl_ms), seen_itl_ms(m, m.decode)
        full = m.decode_kv_usage is not None and m.decode_kv_usage > models.KV_LIMIT
    need = Need(cur, cur, notes=(note(NoteKind.feedback_only, role, unseen=unseen),))
    if seen is not None:
        need = replace(
            need,
            pressure=seen / target,
            violated=seen > target * (1.0 + tol) or full,
            headroom=seen < target * (1.0 - tol),
        )
    if need.violated:
        need = replace(need, up=cur + 1, down=cur + 1)
    elif need.headroom:
        # Not fewer of its own accord (need.down) unless that is safe, but at a full GPU
        # budget it may lend one engine to a role that misses its target (need.up).
        spare = shed and role == Role.decode and decode_spares_one(ctx, m, cur)
        need = replace(need, up=max(cur - 1, 1), down=cur - 1 if spare else cur)
    cause = Cause.ttft_over_target if role == Role.prefill else decode_cause(full, need.violated)
    down = Cause.prefill_headroom if role == Role.prefill else Cause.decode_headroom
    return replace(need, cause_up=cause, cause_down=down)
