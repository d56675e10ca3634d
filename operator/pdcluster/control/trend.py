"""The demand each role saw over the last window, and how much its trend grows it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import pairwise

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


# How long the scale-down floor remembers a peak while the load is bursty: an hour. The
# Azure code trace's bursts come every few minutes to half an hour and last less than an
# engine's start-up, so a floor that forgets them after the stabilization (300 s) lets
# engines go that the next burst needs. With the prior (autoscaling.profile) an hour's
# memory took that day from 96.55% on 64.76 GPU-hours to 97.65% on 62.35 at peak 4, and
# from 95.38% on 105.45 to 97.17% on 98.21 at peak 8 (docs/benchmarks.md, "The prior's
# scale, and bursts held for an hour").
PEAK_SPAN_S = 3600
# Bursty: the demand of the stabilization span's runs jumps by this share of its mean
# from one run to the next (the median jump). A load that moved once (a prompt mix that
# changed) is followed within the stabilization, as before: an hour's memory for every
# load cost the mix shift 19% more GPU-hours; at 0.2 the Azure code weekday at peak 8
# kept 96.84% on 99.02 GPU-hours, at 0.1 97.17% on 98.21.
BURSTY_JUMP = 0.1
# Past the stabilization only the floor reads the history: it keeps one sample per this
# many seconds, each role's most, so the status holds a few dozen samples, not hundreds.
PEAK_BUCKET_S = 300


def recent_span_s(ctx: Context) -> int:
    """The runs kept whole: the trend's window and the scale-down stabilization (as a
    Horizontal Pod Autoscaler's recommendations, the floor looks that far back)."""
    return max(ctx.auto.window_seconds, ctx.auto.scale_down_stabilization_seconds)


def recent_runs(ctx: Context, history: History) -> History:
    """The runs of the recent span, each as it was (before it the history is buckets)."""
    recent = ctx.now - timedelta(seconds=recent_span_s(ctx))
    return tuple(s for s in history if s.time >= recent)


def record(ctx: Context, history: History, m: MetricsSnapshot) -> History:
    """This run's demand with those before it: the recent span whole, and before it, up
    to PEAK_SPAN_S back, the most of each PEAK_BUCKET_S."""
    horizon = ctx.now - timedelta(seconds=max(recent_span_s(ctx), PEAK_SPAN_S))
    recent = ctx.now - timedelta(seconds=recent_span_s(ctx))
    buckets: dict[int, Sample] = {}
    for s in history:
        if horizon <= s.time < recent:
            key = int(s.time.timestamp() // PEAK_BUCKET_S)
            held = buckets.get(key, s)
            # The bucket's most, dated by its latest sample: it leaves the span with that.
            buckets[key] = Sample(
                max(held.time, s.time), max(held.prefill, s.prefill), max(held.decode, s.decode)
            )
    kept = tuple(s for s in history if recent <= s.time < ctx.now)
    prefill, decode = demand(m)
    return (*buckets.values(), *kept, Sample(ctx.stamp, round(prefill), round(decode)))


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


def bursty(values: list[float]) -> bool:
    """Whether the demand jumps from run to run: the median jump, over the mean, is at
    least BURSTY_JUMP. A median, so that a load that moved once (one large jump) is not
    bursty."""
    mean = sum(values) / len(values) if values else 0.0
    if len(values) < 3 or mean <= 0:
        return False
    jumps = sorted(abs(b - a) for a, b in pairwise(values))
    return jumps[len(jumps) // 2] / mean >= BURSTY_JUMP


def peak_spans(ctx: Context, history: History) -> dict[Role, int]:
    """Per role, how far back the scale-down floor looks: the recent span, or the hour
    while the role's demand over the recent span is bursty."""
    runs = recent_runs(ctx, history)
    spans = {}
    for role in ROLES:
        burst = bursty([s.of(role) for s in runs])
        spans[role] = max(recent_span_s(ctx), PEAK_SPAN_S) if burst else recent_span_s(ctx)
    return spans


def peaks(ctx: Context, history: History, spans: dict[Role, int]) -> dict[Role, float]:
    """Per role, the most demand of its peak span over the demand now (at least 1): a
    scale-down keeps what that peak needs, so a lull inside a burst is not a night."""
    if not history:
        return {role: 1.0 for role in ROLES}
    now, out = history[-1], {}
    for role in ROLES:
        since = ctx.now - timedelta(seconds=spans[role])
        most = max(s.of(role) for s in history if s.time >= since)
        out[role] = most / now.of(role) if now.of(role) > 0 else 1.0
    return out


def sizing_margin(ctx: Context, history: History) -> float:
    """The share the capacity models size with beyond the load and short of the target:
    the tolerance, or half of it once the recent span's runs show neither role's demand
    bursty (a calm load needs less room; the measured latencies keep the whole tolerance
    against their own noise)."""
    runs = recent_runs(ctx, history)
    calm = len(runs) >= 3 and not any(bursty([s.of(role) for s in runs]) for role in ROLES)
    return ctx.tol / 2 if calm else ctx.tol
