"""From what the signals want to what the law sets: stabilization windows, max_step,
the cooldown, and the timeout of scale-ups whose pods never become ready. The steps
per role are shared by both laws (law.py, pool.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from pdcluster.control.budget import Counts, gpu_total
from pdcluster.control.context import ROLES, Context, Role, Timer, Timers
from pdcluster.control.notes import Note, NoteKind, note
from pdcluster.timestamps import time_ms

# While a queue grows, a scale-up takes this many maxSteps at once (measured: 3 did what
# an unlimited step did on the burst and mix scenarios; the cooldown still holds, since
# skipping it cost the Mooncake conversation run 2 points, docs/benchmarks.md).
SURGE_STEPS = 3


@dataclass(frozen=True)
class TimeOut:
    """A scale-up given up: the count to fall back to, and why."""

    fallback: int
    note: Note


def time_out(ctx: Context, timers: Timers, role: Role, current: int) -> tuple[Timers, TimeOut | None]:
    """Fall back to the ready count when a scale-up has waited too long for its pods."""
    seen = ctx.seen(role)
    if ctx.recommend or current <= seen.ready:
        return timers.set(Timer.pending, role, None), None
    timers = timers.start(Timer.pending, role, ctx.stamp)
    waited = ctx.since(timers.pending[role])
    timeout = ctx.scale_up_timeout_s(role)
    if waited < timeout:
        return timers, None
    low, _ = ctx.bounds(role)
    fallback = max(low, seen.ready)
    timers = (
        timers.set(Timer.pending, role, None)
        .set(Timer.up_since, role, None)
        .set(Timer.blocked, role, ctx.now + timedelta(seconds=timeout))
    )
    why = note(
        NoteKind.scale_up_timed_out,
        role,
        target=current,
        waited=waited,
        ready=seen.ready,
        unschedulable=seen.unschedulable,
        fallback=fallback,
        timeout=timeout,
    )
    return timers, TimeOut(fallback, why)


@dataclass(frozen=True)
class Step:
    """One role's change this run, once its wish has waited long enough."""

    target: int
    timers: Timers
    note: Note | None = None  # why it waits, when it does
    blocked: bool = False  # a scale-up within the block after a timeout
    wanted_s: float = 0.0  # how long the scale-up has been wanted


def step(
    ctx: Context,
    timers: Timers,
    role: Role,
    current: int,
    want: int,
    down_wait_s: int,
    surge: bool = False,
    up_wait_s: int = 0,
    to_most: bool = False,
) -> Step:
    """Move towards `want` by at most max_step once the wish has lasted its window (a
    scale-down, `down_wait_s`); while the role's queue grows (`surge`), a scale-up takes
    SURGE_STEPS of them: each step short of the need lets the queue grow one interval more.
    A scale-up waits for `scaleUpStabilizationSeconds`, or `up_wait_s` if longer. With
    `to_most`, a scale-down goes to the most replicas wanted while it waited, as a
    HorizontalPodAutoscaler's does, not to this run's wish."""
    auto = ctx.auto
    if want > current:
        timers = timers.set(Timer.down_since, role, None)
        if role in timers.blocked:
            blocked = note(NoteKind.blocked, role, until=time_ms(timers.blocked[role]))
            return Step(current, timers, blocked, blocked=True)
        timers = timers.start(Timer.up_since, role, ctx.stamp)
        wanted = ctx.since(timers.up_since[role])
        needed = max(auto.scale_up_stabilization_seconds, up_wait_s)
        if wanted < needed:
            return Step(current, timers, note(NoteKind.up_waiting, role, wanted=wanted, needed=needed))
        most = auto.max_step * (SURGE_STEPS if surge else 1)
        return Step(current + min(want - current, most), timers, wanted_s=wanted)
    if want < current:
        running = to_most and role in timers.down_since
        down_to = max(want, timers.down_most.get(role, want)) if running else want
        timers = timers.set(Timer.up_since, role, None).start(Timer.down_since, role, ctx.stamp)
        timers = timers.most(role, down_to) if to_most else timers
        since = timers.down_since[role]
        waited = ctx.since(since)
        if waited < down_wait_s:
            return Step(
                current,
                timers,
                note(NoteKind.down_waiting, role, want=down_to, waited=waited, needed=down_wait_s),
            )
        # The next step of the same scale-down waits for a window of metrics at the new
        # count, and for the stabilization since the wish began.
        settle = max(auto.scale_down_stabilization_seconds - auto.window_seconds, 0)
        timers = timers.set(Timer.down_since, role, max(since, ctx.now - timedelta(seconds=settle)))
        # The next step starts its own most from this run's wish.
        timers = timers.most(role, want) if to_most else timers
        return Step(current - min(current - down_to, auto.max_step), timers)
    return Step(current, timers.set(Timer.up_since, role, None).set(Timer.down_since, role, None))


@dataclass(frozen=True)
class Settled:
    """The law's targets this run, and what held them back."""

    target: Counts
    timers: Timers
    notes: tuple[Note, ...] = ()
    blocked: Role | None = None  # the first role whose scale-up a timeout blocks
    cooling: bool = False
    surged: Role | None = None  # a role whose growing queue took a step past max_step


def stabilise(
    ctx: Context,
    timers: Timers,
    current: Counts,
    wants: Counts,
    donor: Role | None,
    surge: frozenset[Role] = frozenset(),
    up_waits: Mapping[Role, int] | None = None,
) -> Settled:
    auto = ctx.auto
    target, notes, blocked, taking_waits = dict(current), [], None, False
    for role in ROLES:
        # Giving engines to the other role moves capacity rather than removing it:
        # headroom seen over a whole window is enough.
        down_wait = auto.window_seconds if role == donor else auto.scale_down_stabilization_seconds
        up_wait = (up_waits or {}).get(role, 0)
        s = step(ctx, timers, role, current[role], wants[role], down_wait, role in surge, up_wait)
        timers, target[role] = s.timers, s.target
        notes += [s.note] if s.note else []
        blocked = blocked or (role if s.blocked else None)
        if (
            donor is not None
            and role != donor
            and s.target > current[role]
            and s.wanted_s < auto.window_seconds
        ):
            # Taking engines from the other role costs a drain and a start-up: only for
            # a shortfall seen over a whole window, not one burst.
            free = max(auto.gpu_budget - gpu_total(ctx, current), 0) // ctx.gpus(role)
            if s.target - current[role] > free:
                notes.append(
                    note(
                        NoteKind.taking_waits,
                        role,
                        wanted=s.wanted_s,
                        window=auto.window_seconds,
                        donor=donor,
                    )
                )
                target[role] = current[role] + free
                taking_waits = True
    if donor is not None and (taking_waits or all(target[r] <= current[r] for r in ROLES if r != donor)):
        # Nobody takes the donor's GPUs (a taker waiting for its window has only the free
        # ones): the donor keeps them, and shrinks on its own by its own stabilization.
        target[donor] = current[donor]
    if auto.gpu_budget is not None:
        for role in ROLES:  # a donor limited by max_step limits the taker too
            while gpu_total(ctx, target) > auto.gpu_budget and target[role] > current[role]:
                target[role] -= 1
    surged = next((r for r in ROLES if r in surge and target[r] - current[r] > auto.max_step), None)
    if ctx.cooling and target != current:
        notes.append(note(NoteKind.cooling_down, since=ctx.prev.last_change_time))
        return Settled(dict(current), timers, tuple(notes), blocked, cooling=True)
    return Settled(target, timers, tuple(notes), blocked, surged=surged)
