"""The demand each role saw over the last window, and how much its trend grows it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from pdcluster.api.v1alpha1 import LoadSample
from pdcluster.control.context import ROLES, Context, Role
from pdcluster.control.types import MetricsSnapshot
from pdcluster.timestamps import parse, time_ms

MAX_GROWTH = 2.0  # the most a trend may grow the load in one window (start-up transients)


@dataclass(frozen=True)
class Sample:
    """One run's demand (see `demand`)."""

    time: datetime
    prefill: int
    decode: int

    def of(self, role: Role) -> float:
        return float(self.prefill if role == Role.prefill else self.decode)


History = tuple[Sample, ...]


def load_history(ctx: Context) -> History:
    if ctx.stale:
        return ()
    return tuple(Sample(parse(h.time), h.prefill, h.decode) for h in ctx.prev.history or [])


def history_status(history: History) -> list[LoadSample] | None:
    return [LoadSample(time=time_ms(s.time), prefill=s.prefill, decode=s.decode) for s in history] or None


def demand(m: MetricsSnapshot) -> tuple[float, float]:
    """What each role has to serve: prefill, prompt tokens per second; decode, the KV
    its sequences hold over their lives (requests/s x output tokens x mean context) / 1000."""
    isl, osl = m.mean_input_tokens or 0.0, m.mean_output_tokens or 0.0
    return m.request_rate * isl, m.request_rate * osl * (isl + osl / 2.0) / 1000.0


def peak_span_s(ctx: Context) -> int:
    """How far back the scale-down floor looks: the scale-down stabilization, as a
    Horizontal Pod Autoscaler's recommendations do, and at least the trend's window."""
    return max(ctx.auto.window_seconds, ctx.auto.scale_down_stabilization_seconds)


def record(ctx: Context, history: History, m: MetricsSnapshot) -> History:
    """This run's demand with those of the peak span (the trend's and the floor's input)."""
    horizon = ctx.now - timedelta(seconds=peak_span_s(ctx))
    kept = tuple(s for s in history if horizon <= s.time < ctx.now)
    prefill, decode = demand(m)
    return (*kept, Sample(ctx.stamp, round(prefill), round(decode)))


def growth(ctx: Context, history: History, role: Role, m: MetricsSnapshot) -> float:
    """How much the role's demand grows over the next window if its trend goes on.

    Engines asked for now serve a load one window later (the measurement lags by half
    a window, a start-up takes about another half). The trend is the least-squares
    slope of the demand the runs of the last window saw; with fewer than three runs
    behind it, prefill falls back to the window before this one (what Prometheus
    shows without history) and decode has none. A falling load is not extrapolated:
    scaling down stays cautious.
    """
    window = ctx.auto.window_seconds
    recent = [s for s in history if (ctx.now - s.time).total_seconds() <= window]
    points = [((s.time - ctx.now).total_seconds(), s.of(role)) for s in recent]
    current = points[-1][1] if points else 0.0
    if len(points) >= 3 and current > 0:
        mean_t = sum(t for t, _ in points) / len(points)
        mean_v = sum(v for _, v in points) / len(points)
        spread = sum((t - mean_t) ** 2 for t, _ in points)
        slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / spread if spread else 0.0
        rise = 1.0 + slope * window / current
    elif role == Role.prefill and m.request_rate_before:
        rise = m.request_rate / m.request_rate_before
    else:
        rise = 1.0
    return min(max(rise, 1.0), MAX_GROWTH)


def growths(ctx: Context, history: History, m: MetricsSnapshot) -> dict[Role, float]:
    return {role: growth(ctx, history, role, m) for role in ROLES}


def peaks(history: History) -> dict[Role, float]:
    """Per role, the most demand of the peak span over the demand now (at least 1): a
    scale-down keeps what that peak needs, so a lull inside a burst is not a night."""
    if not history:
        return {role: 1.0 for role in ROLES}
    now = history[-1]
    return {
        role: max(s.of(role) for s in history) / now.of(role) if now.of(role) > 0 else 1.0 for role in ROLES
    }
