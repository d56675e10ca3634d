"""The law over a day (trajectories in the style of LWS's ComputeAllSteps): the seasonal
forecast starts a scale-up ahead of a ramp seen yesterday, the first day stays reactive,
the start-up time is an input; and its burst handling: the recent peak's floor, a
queue's backlog and bigger steps while a queue grows; a burst the engines drain holds prefill."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from tests.unit.test_control_law import PROFILE, T0, metrics, spec

from pdcluster.api.v1alpha1 import AutoscalingState, LoadSample
from pdcluster.control import Observed, RoleObserved, decide, decide_outcome
from pdcluster.control.cause import Cause
from pdcluster.control.context import context
from pdcluster.control.trend import PEAK_BUCKET_S, Sample, recent_runs, record
from pdcluster.timestamps import time_ms

DAY = timedelta(days=1)
MIDNIGHT = T0.replace(hour=0)
RAMP = MIDNIGHT + timedelta(hours=7)  # 20 -> 80 requests/s over ten minutes


def rate(at) -> float:
    into = (at - at.replace(hour=0, minute=0, second=0)).total_seconds() - 7 * 3600
    return 20.0 + 60.0 * min(max(into / 600.0, 0.0), 1.0)


def morning(start, state, startup_s: float | None = None):
    """06:00 to 08:00 of the day at `start`, every 30 s, engines ready as soon as asked
    (the law's own trajectory). Returns the state and (time, prefill, cause) per run."""
    s = spec(1, 1, gpuBudget=40, maxStep=2, cooldownSeconds=0)
    p, d, steps = 2, 2, []
    # The night before ended at two engines each (the forecast is what the day left).
    state = state.model_copy(update={"prefill": p, "decode": d}) if state else None
    at = start + timedelta(hours=6)
    while at < start + timedelta(hours=8):
        seen = Observed(
            RoleObserved(p, p, p, startup_s=startup_s), RoleObserved(d, d, d, startup_s=startup_s)
        )
        m = metrics(rate=rate(at), engines=(p, d), ttft=250.0, itl=15.0)
        state, decision = decide(s, m, state, seen, at, profile=PROFILE)
        p, d = decision.prefill, decision.decode
        steps.append((at, p, decision.cause))
        at += timedelta(seconds=30)
    return state, steps


def first_rise(steps, start) -> timedelta:
    base = steps[0][1]
    return next(at for at, p, _ in steps if p > base) - (start + timedelta(hours=7))


def test_the_first_day_is_reactive_and_the_second_scales_ahead_of_the_ramp():
    state, day1 = morning(MIDNIGHT, None)
    assert all(cause != Cause.forecast_ramp.value for _, _, cause in day1)
    assert first_rise(day1, MIDNIGHT) >= timedelta(0)  # nothing before the load moves
    state, _ = morning(MIDNIGHT, state)  # the rest of the memory: one more morning seen
    _, day2 = morning(MIDNIGHT + DAY, state)
    led = [at for at, _, cause in day2 if cause == Cause.forecast_ramp.value]
    assert led and led[0] < RAMP + DAY
    assert first_rise(day2, MIDNIGHT + DAY) < timedelta(0)  # engines asked for before the ramp
    when_the_ramp_starts = [
        next(p for at, p, _ in steps if at >= RAMP + k * DAY) for k, steps in enumerate((day1, day2))
    ]
    assert when_the_ramp_starts[1] > when_the_ramp_starts[0]


def test_a_longer_start_up_starts_the_scale_up_earlier():
    state, _ = morning(MIDNIGHT, None)
    state, _ = morning(MIDNIGHT, state)
    _, quick = morning(MIDNIGHT + DAY, state, startup_s=60.0)
    _, slow = morning(MIDNIGHT + DAY, state, startup_s=600.0)
    assert first_rise(slow, MIDNIGHT + DAY) < first_rise(quick, MIDNIGHT + DAY)


def held_state(peak: bool) -> AutoscalingState:
    """Eight prefill engines, their scale-down wanted for ten minutes; a burst of 20x the load 2 min ago or not."""
    m = metrics(rate=4.0, engines=(8, 4))
    history = [
        LoadSample(
            time=time_ms(T0 - timedelta(seconds=120)),
            prefill=round(4.0 * 3000 * (20 if peak else 1)),
            decode=1,
        )
    ]
    return winding_down(history), m


def winding_down(history: list[LoadSample]) -> AutoscalingState:
    """8:4 engines, the prefill scale-down wanted for ten minutes, after `history`."""
    return AutoscalingState(
        prefill=8,
        decode=4,
        last_run_time=time_ms(T0 - timedelta(seconds=30)),
        down_wanted_since={"prefill": time_ms(T0 - timedelta(minutes=10))},
        history=history,
    )


def test_a_scale_down_keeps_what_the_recent_peak_needed():
    s = spec(8, 4, gpuBudget=40, cooldownSeconds=0)
    seen = Observed(RoleObserved(8, 8, 8), RoleObserved(4, 4, 4))
    state, m = held_state(peak=False)
    calm = decide_outcome(s, replace(m, ttft_ms=100.0), state, seen, T0, profile=PROFILE)
    assert calm.decision.prefill < 8 and calm.decision.cause == Cause.prefill_headroom.value
    state, m = held_state(peak=True)
    after_burst = decide_outcome(s, replace(m, ttft_ms=100.0), state, seen, T0, profile=PROFILE)
    assert after_burst.decision.prefill > calm.decision.prefill
    assert after_burst.figures.floor["prefill"] >= after_burst.decision.prefill


def test_a_growing_queue_takes_several_max_steps_at_once():
    s = spec(2, 4, gpuBudget=40, maxStep=1, cooldownSeconds=0)
    seen = Observed(RoleObserved(2, 2, 2), RoleObserved(4, 4, 4))
    base = metrics(rate=4.0, engines=(2, 4))
    quiet = decide(s, base, None, seen, T0, profile=PROFILE)[1]
    # Three times the prompts arrive than are computed, and 60 requests wait.
    burst = replace(
        base,
        request_rate=12.0,
        prefill_queue=60.0,
        ttft_ms=4000.0,
        prefill=replace(base.prefill, queue_time_ms=3500.0, ttft_ms=3800.0),
    )
    state = AutoscalingState(prefill=2, decode=4)
    outcome = decide_outcome(s, burst, state, seen, T0, profile=PROFILE)
    assert 1 < outcome.decision.prefill - 2 <= 3  # three maxSteps of 1 at most
    assert outcome.decision.cause == Cause.queue_growing.value
    assert outcome.figures.queue["prefill"] == 60.0
    assert quiet.prefill <= 2


def hour_state(recent: list[float]) -> AutoscalingState:
    """Eight prefill engines, their scale-down wanted for ten minutes; a burst of 20x the
    load 40 minutes ago, and the last five minutes' demand as `recent` (x the load)."""
    load = 4.0 * 3000
    history = [LoadSample(time=time_ms(T0 - timedelta(minutes=40)), prefill=round(20 * load), decode=1)]
    history += [
        LoadSample(
            time=time_ms(T0 - timedelta(seconds=30 * (len(recent) - i))), prefill=round(x * load), decode=1
        )
        for i, x in enumerate(recent)
    ]
    return winding_down(history)


def test_a_bursty_load_keeps_the_hours_peak_and_a_steady_one_lets_it_go():
    """A burst 40 minutes ago: while the demand of the last five minutes still varies by
    more than a fifth of its mean (29% here), the scale-down keeps what that burst needed; where the demand
    has been steady since, it is a load that moved, and the engines go."""
    s = spec(8, 4, gpuBudget=40, cooldownSeconds=0)
    seen = Observed(RoleObserved(8, 8, 8), RoleObserved(4, 4, 4))
    m = replace(metrics(rate=4.0, engines=(8, 4)), ttft_ms=100.0)
    steady = decide_outcome(s, m, hour_state([1.0] * 10), seen, T0, profile=PROFILE)
    assert steady.decision.prefill < 8 and steady.decision.cause == Cause.prefill_headroom.value
    stepped = decide_outcome(s, m, hour_state([1.8] * 5 + [1.0] * 5), seen, T0, profile=PROFILE)
    assert stepped.figures.peak_span_s["prefill"] == 300
    bursty = decide_outcome(s, m, hour_state([1.0, 1.8] * 5), seen, T0, profile=PROFILE)
    assert bursty.decision.prefill > steady.decision.prefill
    assert bursty.figures.peak_span_s["prefill"] == 3600
    assert steady.figures.peak_span_s["prefill"] == 300


def test_the_history_keeps_the_recent_span_whole_and_each_five_minutes_most_before_it():
    """Runs every 30 s for 90 minutes: the last 300 s stay as they were, the hour before
    them is one sample per five minutes holding each role's most, older runs are gone."""
    ctx = context(spec(1, 1), None, Observed(RoleObserved(1, 1, 1), RoleObserved(1, 1, 1)), T0)
    history = tuple(
        Sample(T0 - timedelta(seconds=30 * k), prefill=k, decode=200 - k) for k in range(180, 0, -1)
    )
    m = metrics(rate=4.0, engines=(1, 1))
    kept = record(ctx, history, m)
    recent = recent_runs(ctx, kept)
    assert [h.prefill for h in recent[:-1]] == list(range(10, 0, -1))
    older = kept[: len(kept) - len(recent)]
    assert 10 <= len(older) <= 3600 // PEAK_BUCKET_S + 1
    # Each bucket holds each role's most, so both roles' maxima of the hour survive.
    assert max(h.prefill for h in older) == 120  # the run 3600 s ago; older ones are gone
    assert max(h.decode for h in older) == 200 - 11


def night_with_a_burst(busy_in_burst: float) -> list[tuple[int, str]]:
    """Six minutes at 2 requests/s on 4:4 with a minute and a half of TTFT misses after
    the first window (the wait 1.8 s), the engines showing `busy_in_burst`; every 30 s,
    engines ready as soon as asked. Returns (prefill, cause) per run."""
    s, state, p, d, steps = spec(), None, 4, 4, []
    for run in range(12):
        missed = 5 <= run < 8
        m = metrics(rate=2.0, ttft=2400 if missed else 150, wait=1800 if missed else 5, engines=(p, d))
        busy = busy_in_burst if missed else 0.05
        shown = replace(m.prefill, steps_per_s=busy * p * 1000.0 / 200.0, prefill_time_ms=200.0)
        seen = Observed(RoleObserved(p, p, p), RoleObserved(d, d, d))
        at = T0 + timedelta(seconds=30 * run)
        state, decision = decide(
            s, replace(m, prefill=shown, prefill_queue=4.0), state, seen, at, profile=PROFILE
        )
        p, d = decision.prefill, decision.decode
        steps.append((p, decision.cause))
    return steps


def test_a_burst_the_engines_drain_never_starts_an_engine_and_a_load_does():
    # Without the rule (BURST_WAIT_X out of reach) the same night goes 4 -> 6 -> 8 prefill.
    drained = night_with_a_burst(busy_in_burst=0.1)
    assert max(p for p, _ in drained) == 4, drained
    assert [c for _, c in drained[5:8]] == [Cause.burst_drains.value] * 3, drained
    loaded = night_with_a_burst(busy_in_burst=0.8)
    assert max(p for p, _ in loaded[5:8]) > 4, loaded
    assert Cause.burst_drains.value not in [c for _, c in loaded]
