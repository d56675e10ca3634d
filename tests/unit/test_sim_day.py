"""Day scenarios (sim/day.py): the load sized to the peak hour, attainment per hour, the
sources' days with their warm-up, and the figure."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from pdcluster import perf
from pdcluster.sim import day, scoring
from pdcluster.sim.fleet import Result
from pdcluster.sim.trace import Trace

SLO = scoring.SLO(500.0, 25.0, False)
PROFILE = perf.load(perf.DEFAULT_PROFILE)


def a_source(rate: float = 10.0, burst: int = 1) -> day.DaySource:
    """Lengths uniform; the peak hour (here 5 minutes) at `rate` requests/s, arriving
    `burst` at a time."""
    rng = random.Random(1)
    inputs = [rng.randint(200, 4000) for _ in range(2000)]
    outputs = [rng.randint(10, 400) for _ in range(2000)]

    def peak(factor: float) -> Trace:
        draw = random.Random(2)
        arrival: list[float] = []
        t = 0.0
        while t < 300.0:
            t += draw.expovariate(rate * factor / burst)
            arrival += [t] * burst
        ins = [draw.choice(inputs) for _ in arrival]
        outs = [draw.choice(outputs) for _ in arrival]
        return Trace("peak", arrival, ins, outs, [() for _ in arrival])

    return day.DaySource("synthetic", rate, inputs, outputs, lambda f: Trace("x", [], [], [], []), peak)


@pytest.mark.parametrize("engines", [4, 9, 24])
def test_the_factor_is_the_smallest_whose_peak_needs_the_engines(engines: int) -> None:
    source = a_source()
    factor = day.factor_for_peak(source, PROFILE, SLO, engines)
    assert sum(day.peak_split(source, PROFILE, SLO, factor)) >= engines
    assert sum(day.peak_split(source, PROFILE, SLO, factor * 0.98)) < engines
    # twice the peak rate: half the factor
    doubled = day.factor_for_peak(a_source(20.0), PROFILE, SLO, engines)
    assert doubled == pytest.approx(factor / 2, rel=1e-6)


def test_a_level_set_by_simulation_is_the_largest_load_the_engines_serve() -> None:
    """The same mean rate, requests alone or in bursts of 8: the capacity models see the
    mean and set one load for both; simulation sets a lower one for the bursts. Each level
    attains the target, and a load `precision` above it (squared, as the search brackets
    within it) does not."""
    fleet = day.fleet_config(day.PlanConfig(gpus=3 * PROFILE.gpus, slo=SLO), PROFILE)

    def attained(source: day.DaySource, factor: float) -> float:
        setup = day.Setup(source.make_peak(factor), PROFILE, SLO, fleet, day.PolicyKnobs())
        return day.static_best(setup, 1, exhaustive=False)[0].attainment

    alone, bursts = a_source(burst=1), a_source(burst=8)
    assert day.factor_for_peak(alone, PROFILE, SLO, 3) == day.factor_for_peak(bursts, PROFILE, SLO, 3)
    levels = [
        day.level_by_simulation(s, PROFILE, SLO, 3, attains=0.95, precision=1.1) for s in (alone, bursts)
    ]
    assert levels[1].factor < levels[0].factor / 1.1
    for source, level in zip((alone, bursts), levels, strict=True):
        assert level.attainment >= 0.95 and sum(level.split) == 3
        assert attained(source, level.factor) == level.attainment
        assert attained(source, level.factor * 1.1 * 1.1) < 0.95
    # From another start (a known level scaled), the bracket lands on the same level.
    started = day.level_by_simulation(
        bursts, PROFILE, SLO, 3, attains=0.95, precision=1.1, start=levels[1].factor * 4
    )
    assert started.attainment >= 0.95 and attained(bursts, started.factor * 1.1 * 1.1) < 0.95
    assert levels[1].factor / 1.1 < started.factor < levels[1].factor * 1.1


def test_no_level_when_no_load_is_light_enough() -> None:
    """Bursts of 40 long prompts miss a 500 ms TTFT however rare they are: a clear error,
    not a search without end."""
    with pytest.raises(ValueError, match="brackets 95%"):
        day.level_by_simulation(a_source(burst=40), PROFILE, SLO, 3, attains=0.95, precision=1.1)


def test_attainment_per_hour_counts_each_hour_after_the_warm_up() -> None:
    # one request every 20 minutes from t = 0 over 5 hours; the warm-up is the first 2 hours
    arrival = [k * 1200.0 for k in range(15)]
    trace = Trace("x", arrival, [100] * 15, [10] * 15, [() for _ in arrival])
    late = {6, 10, 11}  # hour 0 of the day: 6, 7, 8; hour 1: 9, 10, 11; hour 2: 12, 13, 14
    ttft = [0.6 if i in late else 0.1 for i in range(15)]
    result = Result(
        "p", ttft, [0.01] * 15, [i != 14 for i in range(15)], 0.0, 18000.0, [(0.0, 1, 1, 1, 1, 2)]
    )
    assert day.hourly(result, trace, [0.5] * 15, 0.025, 7200.0, 4) == [2 / 3, 1 / 3, 2 / 3, None]


def test_a_plot_is_written(tmp_path: Path) -> None:
    arrival = [k * 60.0 for k in range(200)]
    trace = Trace("x", arrival, [100] * 200, [10] * 200, [() for _ in arrival])
    timeline = [(0.0, 1, 1, 1, 1, 2), (5000.0, 2, 1, 2, 1, 3)]
    result = Result("p", [0.1] * 200, [0.01] * 200, [True] * 200, 0.0, 12000.0, timeline)
    path = tmp_path / "day.png"
    day.plot(path, "a day", trace, {"p": result}, {"p": [1.0, 0.5]}, 3600.0)
    assert path.stat().st_size > 5000 and path.read_bytes()[:4] == b"\x89PNG"


@pytest.fixture(scope="module")
def traces() -> Path:
    try:
        root = perf.traces_dir()
    except FileNotFoundError:
        pytest.skip("the public traces (../shared/traces) are not here")
    if not (root / "servegen").is_dir() or not (root / "azure2024").is_dir():
        pytest.skip("the long-horizon sources (../shared/traces) are not here")
    return root


def check_day(trace: Trace, peak_rps: float, factor: float) -> None:
    """26 hours from 0, the warm-up's 2 first, and no hour of the day above its peak by much."""
    assert 0 <= trace.arrival_s[0] < 600 and trace.arrival_s[-1] > day.DAY_S + day.WARMUP_S - 600
    assert trace.arrival_s[-1] < day.DAY_S + day.WARMUP_S
    hours = [0] * 26
    for t in trace.arrival_s:
        hours[int(t // 3600)] += 1
    busiest = max(hours[2:]) / 3600
    assert busiest == pytest.approx(peak_rps * factor, rel=0.2)
    assert all(n > 0 for n in hours[:2])  # the warm-up has traffic to warm up on


def test_the_azure_weekday_is_the_code_shape_over_code_requests(traces: Path) -> None:
    source = day.azure_code_weekday(traces)
    assert source.name == "azure-code-weekday" and len(source.peak_inputs) == len(source.peak_outputs) > 1000
    factor = 0.003
    trace = source.make(factor)
    check_day(trace, source.peak_rps, factor)
    # a weekday swings (5-11x within a day in the source): the night is well below the peak
    assert source.peak_rps > 4 * min(r for _, _, r in source_curve_day(traces))


def source_curve_day(traces: Path):
    from pdcluster.sim import longload

    week = longload.azure2024_curve(traces / "azure2024" / "azure2024_code_hourly_digitized.csv")
    return week.cut(day.AZURE_WEEKDAY_START_H * 3600.0, day.DAY_S).windows()


def test_the_servegen_day_is_m_large_from_day_thirteen(traces: Path) -> None:
    source = day.servegen_day(traces)
    assert 150 < source.peak_rps < 400  # m-large's busiest hour that day (it averages 196 req/s)
    factor = 0.004
    trace = source.make(factor)
    check_day(trace, source.peak_rps, factor)
    assert math.isclose(day.SERVEGEN_DAY_START_S / 86400, 12)  # 00:00 of day 13


def test_a_prior_day_leaves_the_scored_day_as_it_was(traces: Path) -> None:
    factor = 0.003
    alone = day.azure_code_weekday(traces, seed=3)
    after = day.azure_code_weekday(traces, seed=3, prior_day=True)
    assert (alone.warmup_s, after.warmup_s) == (day.WARMUP_S, day.WARMUP_S + day.DAY_S)
    today, both = alone.make(factor), after.make(factor)
    prior = sum(1 for t in both.arrival_s if t < day.DAY_S)
    assert prior > 0.5 * len(today)  # the day before is a weekday-sized day of its own
    assert [t - day.DAY_S for t in both.arrival_s[prior:]] == pytest.approx(today.arrival_s)
    assert both.input_tokens[prior:] == today.input_tokens and both.blocks[prior:] == today.blocks


def test_the_day_before_is_not_todays_bursts_a_day_early(traces: Path) -> None:
    """The Azure day plays one base hour round and round: in phase, yesterday's minute-by-
    minute arrivals would be today's, and a forecast would remember bursts that real traffic
    does not repeat. The day before plays the base from half its span on."""
    factor = 0.01
    both = day.azure_code_weekday(traces, prior_day=True).make(factor)

    def per_minute(start_s: float) -> list[int]:
        counts = [0] * 60
        for t in both.arrival_s:
            if start_s <= t < start_s + 3600.0:
                counts[int((t - start_s) // 60)] += 1
        return counts

    # the same hour of the day (11:00, before the ramp), yesterday and today
    yesterday = per_minute(day.WARMUP_S + 11 * 3600.0)
    today = per_minute(day.DAY_S + day.WARMUP_S + 11 * 3600.0)
    assert np.corrcoef(yesterday, today)[0, 1] < 0.5
    # while a base hour half a span on is that hour's arrivals shifted
    base = day.load_trace(traces / "AzureLLMInferenceTrace_code_2023.csv")
    turned = day.rotated(base, base.span_s / 2.0)
    assert len(turned) == len(base) and turned.arrival_s == sorted(turned.arrival_s)
    assert turned.arrival_s[0] >= base.arrival_s[0] and turned.arrival_s[-1] <= base.arrival_s[-1]


def test_a_day_after_a_prior_one_shares_no_prefix_and_no_time() -> None:
    today = Trace("d", [0.0, 5.0], [10, 20], [5, 6], [(1, 2), (1, 3)])
    both = day.after_prior(Trace("p", [0.0, 100.0], [30, 40], [7, 8], [(1, 2), ()]), today)
    assert both.arrival_s == [0.0, 100.0, day.DAY_S, day.DAY_S + 5.0]
    assert both.input_tokens == [30, 40, 10, 20]
    assert both.blocks[2:] == today.blocks and not {1, 2} & set(both.blocks[0])  # other users
    with pytest.raises(ValueError, match="must end within"):
        day.after_prior(Trace("p", [0.0, day.DAY_S], [10, 10], [5, 5], [(), ()]), today)


def test_engines_over_time_are_time_weighted_means() -> None:
    # 1:1 for the first 900 s, 3:2 until 2700 s, 2:2 until the end at 3600 s; bins of 1800 s
    timeline = [(0.0, 1, 1, 1, 1, 2), (900.0, 3, 2, 3, 2, 5), (2700.0, 2, 2, 2, 2, 4)]
    result = Result("p", [], [], [], 0.0, 3600.0, timeline)
    centres, prefill, decode = day.engines_over_time(result, 1800.0)
    assert centres == [-0.25, 0.25]
    assert prefill == [pytest.approx(2.0), pytest.approx(2.5)]
    assert decode == [pytest.approx(1.5), pytest.approx(2.0)]
