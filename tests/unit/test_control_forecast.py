"""The seasonal forecast (control/forecast.py) on synthetic daily series."""

from __future__ import annotations

import math

import pytest

from pdcluster.api.v1alpha1 import SeasonalMemory
from pdcluster.control.forecast import BUCKET_S, BUCKETS, DAY_S, TREND_BAND, SeasonalForecast

STEP_S = 30.0  # one law decision


def daily(t: float, level: float = 1.0) -> float:
    """A day with a night trough of 4 and an afternoon peak of 16 (4x within the day)."""
    return level * (10.0 - 6.0 * math.cos(2 * math.pi * t / DAY_S))


def fed(days: float, load=daily, start: float = 0.0) -> SeasonalForecast:
    forecast = SeasonalForecast()
    t = start
    while t < start + days * DAY_S:
        forecast.observe(t, load(t))
        t += STEP_S
    return forecast


def test_the_first_day_predicts_nothing():
    forecast = fed(0.5)
    assert forecast.predict(0.5 * DAY_S, 600, daily(0.5 * DAY_S)) is None


def test_a_bucket_closed_minutes_ago_is_no_memory_of_this_time_of_day():
    """On the first day, a minute into a bucket, the last one has closed: it is the load
    of ten minutes ago, not of this time yesterday. Read as such, a lull between bursts
    (a twentieth of that load) was forecast to climb back threefold, and the colocated
    pool law added an engine in lull after lull (docs/benchmarks.md)."""
    now = 0.5 * DAY_S + 60.0
    forecast = fed(0.5)
    forecast.observe(now, daily(now) / 20)
    assert forecast.profile[int(now // BUCKET_S) - 1] is not None
    assert forecast.predict(now, 120, daily(now) / 20) is None
    assert forecast.trend(now, daily(now)) is None
    # A day later the same bucket, and the one ahead, are yesterday's.
    later = fed(1.0)
    assert later.predict(DAY_S + now, 120, daily(now)) == pytest.approx(daily(now + 120), rel=0.01)


def test_a_ramp_seen_yesterday_is_forecast_one_start_up_ahead():
    forecast = fed(1.0)
    # Morning of day 2, on the ramp: the load five minutes from now, not the load now.
    now, horizon = DAY_S + 6 * 3600.0, 300.0
    predicted = forecast.predict(now, horizon, daily(now))
    assert predicted == pytest.approx(daily(now + horizon), rel=0.01)
    assert predicted > daily(now)


def test_a_busier_day_lifts_the_forecast_by_its_trend():
    forecast = fed(1.0)
    now = DAY_S + 9 * 3600.0
    busier = forecast.predict(now, 600, 1.5 * daily(now))
    usual = forecast.predict(now, 600, daily(now))
    assert busier == pytest.approx(1.5 * usual, rel=1e-6)
    # A tenfold burst is not a new day: the trend stays within its band.
    assert forecast.trend(now, 10 * daily(now)) == TREND_BAND[1]


def test_the_profile_learns_a_new_shape_over_days_without_forgetting_at_once():
    forecast = fed(2.0)
    noon = 12 * 3600.0
    old, new = daily(noon), daily(noon + 3 * 3600.0)
    learnt = forecast.profile[int(noon // BUCKET_S)]
    assert learnt == pytest.approx(old, rel=0.02)
    # Feed the shifted shape on top of the old memory, day by day: it moves towards the new one.
    memory = fed(2.0)
    for day in range(2, 6):
        t = day * DAY_S
        while t < (day + 1) * DAY_S:
            memory.observe(t, daily(t + 3 * 3600.0))
            t += STEP_S
        gap = abs(memory.profile[int(noon // BUCKET_S)] - new)
        assert gap < abs(old - new)
    assert memory.profile[int(noon // BUCKET_S)] == pytest.approx(new, rel=0.1)


def test_a_silent_bucket_and_bad_samples_leave_the_profile_usable():
    forecast = SeasonalForecast()
    for k in range(BUCKETS):
        if k == 10:
            continue  # the operator was down for this bucket
        forecast.observe(k * BUCKET_S + 1, 5.0)
        forecast.observe(k * BUCKET_S + 2, float("nan"))
        forecast.observe(k * BUCKET_S + 3, -1.0)
    forecast.observe(DAY_S, 5.0)
    assert forecast.profile[10] is None
    assert forecast.profile[9] == 5.0
    assert forecast.predict(DAY_S + 9 * BUCKET_S, BUCKET_S, 5.0) == 5.0


def test_status_round_trip_and_a_damaged_status_starts_empty():
    def tokens(t: float) -> float:
        return daily(t, 1000.0)  # prompt tokens per second, as the law feeds it

    forecast = fed(1.2, tokens)
    back = SeasonalForecast.from_status(forecast.to_status())
    now = 1.2 * DAY_S
    assert back.predict(now, 600, tokens(now)) == pytest.approx(
        forecast.predict(now, 600, tokens(now)), rel=1e-3
    )
    assert back.bucket == forecast.bucket and back.samples == forecast.samples
    assert back.first == forecast.first == 0
    for damaged in (None, SeasonalMemory(profile=[1]), SeasonalMemory(profile=[])):
        assert SeasonalForecast.from_status(damaged).profile == [None] * BUCKETS
