"""A seasonal forecast of load, learned online from the load the law has seen.

Serving load repeats by the day: ServeGen's m-large moves 2.6x within a median day, the
Azure 2024 code trace 5-11x within a weekday (../shared/traces/README.md). A law that
only reacts starts engines when a ramp has begun and they arrive one start-up late; a
law that remembers yesterday can start them one start-up ahead.

The forecast keeps, for each bucket of the day (`BUCKET_S`), a smoothed mean of the load
seen in that bucket on past days. Its prediction for a horizon is the largest
remembered load in the buckets the horizon spans, times today's trend (the load now over
what the profile remembers for now), so a day busier than yesterday lifts the whole
forecast. A bucket counts as memory of a time of day only once the forecast saw that
time a day before: on the first day a bucket closed minutes ago is the load of minutes
ago, and read as this time of day it made a lull between bursts look like a ramp to
come. With no memory of the buckets ahead (the first day) it predicts nothing and the
law stays reactive. Only the past is used: a bucket enters the profile when it ends.

The state is plain numbers in `status.autoscaling` (`to_status`/`from_status`), so an
operator restart keeps what was learned. The prefill:decode and the colocated law
consult it through seasonal.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdcluster.api.v1alpha1 import SeasonalMemory

DAY_S = 86_400.0
BUCKET_S = 600.0
BUCKETS = int(DAY_S // BUCKET_S)
# How much a new day counts against the remembered ones: a weekly pattern or a holiday
# moves the profile by a third, it does not replace it.
DAY_WEIGHT = 0.35
# Today's level against the profile is believed only within this band: a burst is the
# burst logic's to handle, not a reason to scale the whole day's forecast by ten.
TREND_BAND = (0.5, 2.0)


@dataclass
class SeasonalForecast:
    profile: list[float | None] = field(default_factory=lambda: [None] * BUCKETS)
    bucket: int | None = None  # absolute bucket number (time // BUCKET_S) being filled
    total: float = 0.0
    samples: int = 0
    first: int | None = None  # the absolute bucket of the first sample (None: unknown, trusted)

    def observe(self, now_s: float, load: float) -> None:
        """One sample of the load (engines needed, or requests/s) at time `now_s`."""
        if not math.isfinite(load) or load < 0:
            return
        bucket = int(now_s // BUCKET_S)
        if self.first is None and self.bucket is None:  # new; one restored without `first` is trusted
            self.first = bucket
        if self.bucket is not None and bucket != self.bucket:
            self._close()
        if self.bucket != bucket:
            self.bucket, self.total, self.samples = bucket, 0.0, 0
        self.total += load
        self.samples += 1

    def _close(self) -> None:
        """The bucket being filled has ended: fold its mean into the day's profile."""
        if self.bucket is None or not self.samples:
            return
        slot = self.bucket % BUCKETS
        mean = self.total / self.samples
        old = self.profile[slot]
        self.profile[slot] = mean if old is None else (1 - DAY_WEIGHT) * old + DAY_WEIGHT * mean

    def remembered(self, t_s: float) -> float | None:
        """The profile at time of day t, interpolated between bucket centres (a ramp is a
        ramp inside a bucket too); the nearer neighbour where the other is unknown."""
        x = t_s / BUCKET_S - 0.5
        low = math.floor(x)
        near, far = self._of_past_days(low), self._of_past_days(low + 1)
        if near is None or far is None:
            return near if far is None else far
        w = x - low
        return (1 - w) * near + w * far

    def _of_past_days(self, bucket: int) -> float | None:
        """The profile's value for an absolute bucket, if the forecast saw it a day before."""
        if self.first is not None and bucket - BUCKETS < self.first:
            return None
        return self.profile[bucket % BUCKETS]

    def trend(self, now_s: float, load_now: float) -> float | None:
        """Today's load over the remembered load at this time of day, within TREND_BAND."""
        remembered = self.remembered(now_s)
        if remembered is None or remembered <= 0:
            return None
        return min(max(load_now / remembered, TREND_BAND[0]), TREND_BAND[1])

    def predict(self, now_s: float, horizon_s: float, load_now: float) -> float | None:
        """The load to be ready for over [now, now + horizon], or None without memory of it."""
        trend = self.trend(now_s, load_now)
        if trend is None:
            return None
        end = now_s + max(horizon_s, 0.0)
        centres = [(b + 0.5) * BUCKET_S for b in range(int(now_s // BUCKET_S), int(end // BUCKET_S) + 1)]
        ahead = [self.remembered(t) for t in (now_s, *(c for c in centres if now_s < c < end), end)]
        return max(v for v in ahead if v is not None) * trend

    def to_status(self) -> SeasonalMemory:
        """Status keeps integers: demands are tokens per second, so rounding loses nothing
        that matters (a load in single units would, and is not what the law feeds it)."""
        return SeasonalMemory(
            profile=[-1 if v is None else round(v) for v in self.profile],
            bucket=self.bucket,
            total=round(self.total),
            samples=self.samples,
            first=self.first,
        )

    @classmethod
    def from_status(cls, memory: SeasonalMemory | None) -> SeasonalForecast:
        """The forecast kept in status; a missing or malformed one starts empty (it is a
        memory, not a spec: losing it makes the law reactive for a day, nothing worse)."""
        if memory is None or len(memory.profile) != BUCKETS:
            return cls()
        profile = [None if v < 0 else float(v) for v in memory.profile]
        return cls(profile, memory.bucket, float(memory.total), memory.samples, memory.first)
