"""What every run of a control law starts from: the spec, the time, and the timers kept
in status, read into typed values once and written back once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum

from pdcluster.api.v1alpha1 import AutoscalingMode, AutoscalingSpec, AutoscalingState, PDClusterSpec
from pdcluster.control.notes import Note, NoteKind, note
from pdcluster.control.types import Observed, RoleObserved
from pdcluster.timestamps import parse, time_ms


class Role(StrEnum):
    prefill = "prefill"
    decode = "decode"
    colocated = "colocated"


ROLES = (Role.prefill, Role.decode)  # the roles of the prefill:decode law
# An engine's start-up (pod created to Ready) until one is measured: the fleet
# simulator's default, a model already on the node (docs/benchmarks.md).
DEFAULT_STARTUP_S = 60.0
# A scale-up whose pods are all scheduled gets at least this many of its role's measured
# start-ups before the law gives up on it. `scaleUpTimeoutSeconds` is for pods that
# cannot start (no free GPUs); where every pod downloads the model, a start-up can
# outlast it, and giving up deletes pods about to serve: at a 900 s start-up and the
# default 600 s, the law kept giving up on a second prefill engine on the Azure code day
# (docs/benchmarks.md).
STARTUPS_BEFORE_TIMEOUT = 2.0


def other(role: Role) -> Role:
    return Role.decode if role == Role.prefill else Role.prefill


@dataclass(frozen=True)
class Context:
    """One run's fixed inputs."""

    spec: PDClusterSpec
    prev: AutoscalingState
    observed: Observed
    now: datetime
    # `now` as status keeps it (milliseconds): a timer started now reads back the same.
    stamp: datetime

    @property
    def auto(self) -> AutoscalingSpec:
        return self.spec.autoscaling

    @property
    def recommend(self) -> bool:
        return self.auto.mode == AutoscalingMode.recommend

    @property
    def tol(self) -> float:
        return self.auto.tolerance_percent / 100.0

    @property
    def stale(self) -> bool:
        """Timers only mean "wanted continuously" if the law kept running."""
        if self.prev.last_run_time is None:
            return True
        gap = (self.now - parse(self.prev.last_run_time)).total_seconds()
        return gap > max(3 * self.auto.interval_seconds, self.auto.window_seconds)

    @property
    def cooling(self) -> bool:
        """Within the cooldown of the last change the law applied."""
        if self.prev.last_change_time is None or self.recommend:
            return False
        since = (self.now - parse(self.prev.last_change_time)).total_seconds()
        return since < self.auto.cooldown_seconds

    def seen(self, role: Role) -> RoleObserved:
        return self.observed.role(role)

    def gpus(self, role: Role) -> int:
        return max(self.spec.role(role).gpus, 1)

    def bounds(self, role: Role) -> tuple[int, int]:
        r = self.spec.role(role)
        return r.min_replicas, max(r.max_replicas, r.min_replicas)

    def stored(self, role: Role) -> int:
        """The count the law last set (in recommend mode, what runs), before any clamp."""
        if self.recommend:
            return self.seen(role).desired
        stored = getattr(self.prev, role)
        return stored if stored is not None else self.spec.role(role).replicas

    def startup_s(self, role: Role) -> float:
        """How long a new engine of the role takes to serve: measured, else the default."""
        measured = self.seen(role).startup_s
        return measured if measured is not None and measured > 0 else DEFAULT_STARTUP_S

    def scale_up_timeout_s(self, role: Role) -> int:
        """How long a scale-up's pods may take to become ready: `scaleUpTimeoutSeconds`
        while any cannot be scheduled, else at least STARTUPS_BEFORE_TIMEOUT of the
        role's start-ups."""
        timeout = self.auto.scale_up_timeout_seconds
        if self.seen(role).unschedulable:
            return timeout
        return max(timeout, round(STARTUPS_BEFORE_TIMEOUT * self.startup_s(role)))

    def since(self, moment: datetime) -> float:
        return (self.now - moment).total_seconds()

    def clamped(self, role: Role, bounds: tuple[int, int]) -> tuple[int, Note | None]:
        """The stored count within the role's bounds, and a note when it was not."""
        value, (low, high) = self.stored(role), bounds
        if low <= value <= high:
            return value, None
        return min(max(value, low), high), note(NoteKind.clamped, role, value=value, low=low, high=high)


def context(
    spec: PDClusterSpec, state: AutoscalingState | None, observed: Observed, now: datetime
) -> Context:
    now = now if now.tzinfo else now.replace(tzinfo=UTC)
    return Context(spec, state or AutoscalingState(), observed, now, parse(time_ms(now)))


Times = Mapping[Role, datetime]


class Timer(StrEnum):
    """The timers Timers keeps per role (each names its field)."""

    pending = "pending"
    blocked = "blocked"
    up_since = "up_since"
    down_since = "down_since"


@dataclass(frozen=True)
class Timers:
    """Per role: since when a scale-up has waited for ready pods (`pending`), until when
    scale-ups are blocked after a timeout, since when a scale-up or a scale-down has been
    wanted, and the most replicas a running scale-down has wanted (where it goes)."""

    pending: Times = field(default_factory=dict)
    blocked: Times = field(default_factory=dict)
    up_since: Times = field(default_factory=dict)
    down_since: Times = field(default_factory=dict)
    down_most: Mapping[Role, int] = field(default_factory=dict)

    @classmethod
    def load(cls, ctx: Context) -> Timers:
        prev, stale = ctx.prev, ctx.stale
        blocked = {r: t for r, t in _read(prev.blocked_until).items() if t > ctx.now}
        return cls(
            pending=_read(prev.pending_since),
            blocked=blocked,
            up_since={} if stale else _read(prev.up_wanted_since),
            down_since={} if stale else _read(prev.down_wanted_since),
            down_most={} if stale else {Role(r): n for r, n in (prev.down_wanted_most or {}).items()},
        )

    def status(self) -> dict[str, dict[str, str] | None]:
        """The AutoscalingState fields that hold them."""
        return {
            "pending_since": _write(self.pending),
            "blocked_until": _write(self.blocked),
            "up_wanted_since": _write(self.up_since),
            "down_wanted_since": _write(self.down_since),
            "down_wanted_most": {r.value: n for r, n in self.down_most.items() if r in self.down_since}
            or None,
        }

    def set(self, timer: Timer, role: Role, moment: datetime | None) -> Timers:
        """These timers with one of `role`'s set (None clears it)."""
        times = dict(getattr(self, timer))
        if moment is None:
            times.pop(role, None)
        else:
            times[role] = moment
        return replace(self, **{timer: times})

    def start(self, timer: Timer, role: Role, now: datetime) -> Timers:
        """These timers with one of `role`'s running since now, unless it already runs."""
        return self if role in getattr(self, timer) else self.set(timer, role, now)

    def most(self, role: Role, replicas: int) -> Timers:
        """These timers with the most replicas `role`'s scale-down has wanted set."""
        return replace(self, down_most={**self.down_most, role: replicas})

    def cleared(self, *timers: Timer) -> Timers:
        return replace(self, **{timer: {} for timer in timers})


def _read(times: Mapping[str, str] | None) -> dict[Role, datetime]:
    return {Role(r): parse(t) for r, t in (times or {}).items()}


def _write(times: Times) -> dict[str, str] | None:
    return {r.value: time_ms(t) for r, t in times.items()} or None
