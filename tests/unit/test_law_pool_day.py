"""The colocated pool law with the prefill:decode law's forecast and burst handling:
a ramp seen yesterday met a start-up ahead, none on the first day, and a growing
queue's step past maxStep within the cooldown."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from tests.unit.test_control_pool import T0, fleet, pool, spec

from pdcluster.api.v1alpha1 import AutoscalingState
from pdcluster.control import Observed, RoleMetrics, RoleObserved, decide, decide_outcome
from pdcluster.control.cause import Cause
from pdcluster.timestamps import time_ms

MIDNIGHT = T0.replace(hour=0)
DAY = timedelta(days=1)


def rate(at) -> float:
    """2 requests/s at night, 12 from 07:00 (a ramp over ten minutes)."""
    into = (at - at.replace(hour=0, minute=0, second=0)).total_seconds() - 7 * 3600
    return 2.0 + 10.0 * min(max(into / 600.0, 0.0), 1.0)


def engines_of(n: int) -> Observed:
    """`n` engines ready, whose start-up was measured at five minutes (a download)."""
    none = RoleObserved(0, 0, 0)
    return Observed(none, none, RoleObserved(n, n, n, startup_s=300.0))


def morning(start, state):
    """06:00 to 08:00, every 30 s, engines ready at once: (time, engines, cause) per run."""
    s = spec(2, cooldownSeconds=0, maxStep=2)
    engines, steps = 2, []
    state = state.model_copy(update={"colocated": engines}) if state else None
    at = start + timedelta(hours=6)
    while at < start + timedelta(hours=8):
        state, decision = decide(s, fleet(rate(at), engines), state, engines_of(engines), at)
        engines = decision.colocated
        steps.append((at, engines, decision.cause))
        at += timedelta(seconds=30)
    return state, steps


def test_the_pool_scales_ahead_of_a_ramp_seen_yesterday_and_not_on_the_first_day():
    state, day1 = morning(MIDNIGHT, None)
    assert all(cause != Cause.forecast_ramp.value for _, _, cause in day1)
    ramp = MIDNIGHT + timedelta(hours=7)
    assert max(n for at, n, _ in day1 if at < ramp) == min(n for at, n, _ in day1 if at < ramp)
    state, _ = morning(MIDNIGHT, state)
    _, day2 = morning(MIDNIGHT + DAY, state)
    led = [(at, n) for at, n, cause in day2 if cause == Cause.forecast_ramp.value]
    assert led and led[0][0] < ramp + DAY
    at_ramp = [next(n for at, n, _ in steps if at >= ramp + k * DAY) for k, steps in enumerate((day1, day2))]
    assert at_ramp[1] > at_ramp[0]


def test_a_growing_pool_queue_steps_past_max_step_within_the_cooldown():
    s = spec(2, maxStep=1, cooldownSeconds=600)
    m = fleet(12.0, 2)
    # Twelve requests/s arrive, two engines compute four's prompts, 90 wait.
    m = replace(m, colocated=RoleMetrics(kv_usage=0.3, ready=2, waiting=90.0, tokens_per_s=4000.0))
    state = AutoscalingState(colocated=2, last_change_time=time_ms(T0 - timedelta(seconds=30)))
    outcome = decide_outcome(s, m, state, pool(2), T0)
    assert outcome.decision.colocated - 2 > 1
    assert outcome.decision.cause == Cause.queue_growing.value
    assert outcome.figures.queue["colocated"] == 90.0


def test_a_lull_between_bursts_on_the_first_day_is_no_ramp_to_come():
    """Six requests/s for five minutes, then 0.3 for two, all morning of the first day.
    A bucket closed minutes ago is not this time of day: read as such, each lull was
    forecast to climb back (at most threefold) and the pool added an engine for it."""
    s = spec(3, cooldownSeconds=0)
    state, engines, causes = None, 3, []
    for k in range(240):
        at = MIDNIGHT + timedelta(hours=6, seconds=30 * k)
        load = 0.3 if k % 14 >= 10 else 6.0
        state, decision = decide(s, fleet(load, engines), state, engines_of(engines), at)
        engines = decision.colocated
        causes.append(decision.cause)
    assert Cause.forecast_ramp.value not in causes
    assert state is not None and state.forecast is not None
    assert max(v for v in state.forecast["colocated"].profile) > 0  # it did learn the morning
