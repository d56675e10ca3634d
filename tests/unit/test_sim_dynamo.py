"""The Dynamo SLA-planner re-implementation: its formulas, budget clamp and predictors."""

from __future__ import annotations

import math
import random

import pytest

from pdcluster import perf
from pdcluster.sim import scrapes
from pdcluster.sim.dynamo import ArimaPredictor, ConstantPredictor, DecodeInterpolator, Dynamo
from pdcluster.sim.fleet import Fleet, FleetConfig
from pdcluster.sim.trace import Trace

PROFILE = perf.load()


def planner(budget: int = 8, **kw) -> Dynamo:
    return Dynamo(PROFILE, ttft_ms=500, itl_ms=25, gpu_budget=budget, start=(1, 1), **kw)


@pytest.mark.parametrize(
    ("budget", "wanted", "expected"),
    [
        (8, (3, 4), (3, 4)),  # fits
        (8, (6, 6), (4, 4)),  # scale 8/12: prefill floor(6 * 0.667) = 4, decode the rest
        (8, (10, 1), (7, 1)),  # prefill capped so that decode keeps min_endpoint
        (8, (1, 12), (1, 7)),
        (1, (3, 3), (0, 0)),  # the budget cannot hold one engine of each
        (-1, (30, 30), (30, 30)),  # -1 disables the clamp
    ],
)
def test_global_gpu_budget_clamp(budget: int, wanted: tuple[int, int], expected: tuple[int, int]) -> None:
    assert planner(budget).apply_global_gpu_budget(*wanted) == expected


def test_constant_predictor_skips_leading_idle_zeros() -> None:
    p = ConstantPredictor()
    for value in (0.0, 0.0, math.nan):
        p.add(value)
    assert p.data == [] and p.predict() == 0.0
    p.add(12.0)
    p.add(math.nan)
    assert p.data == [12.0, 0.0] and p.predict() == 0.0


def test_arima_needs_five_points_and_follows_a_trend() -> None:
    p = ArimaPredictor()
    for value in (10.0, 20.0, 30.0, 40.0):
        p.add(value)
    assert p.predict() == 40.0  # fewer than 5 points: the last value
    p.add(50.0)
    for value in (60.0, 70.0, 80.0):
        p.add(value)
    assert p.predict() == pytest.approx(90.0, rel=1e-6)
    flat = ArimaPredictor()
    for _ in range(8):
        flat.add(7.0)
    assert flat.predict() == 7.0


def test_arima_forecasts_are_never_negative() -> None:
    p = ArimaPredictor()
    for value in (100.0, 80.0, 60.0, 40.0, 20.0, 5.0):
        p.add(value)
    assert p.predict() >= 0.0


def test_best_decode_throughput_is_at_the_highest_kv_load_within_the_itl() -> None:
    grid = DecodeInterpolator(PROFILE)
    best = grid.find_best_throughput_per_gpu(25.0, 3000.0)
    iy = grid._row(3000.0)
    ix = next(i for i in range(99, -1, -1) if grid.itl[iy, i] <= 25.0)
    assert best == pytest.approx(grid.thpt[iy, ix])
    assert ix == 99 or grid.itl[iy, ix + 1] > 25.0
    # A looser target allows more KV load and more throughput.
    assert grid.find_best_throughput_per_gpu(40.0, 3000.0) > best


def test_a_decision_follows_the_published_formulas() -> None:
    rng = random.Random(5)
    t, arrival = 0.0, []
    while t < 400:
        t += rng.expovariate(6.0)
        arrival.append(t)
    n = len(arrival)
    trace = Trace("steady", arrival, [rng.randint(2000, 6000) for _ in range(n)], [150] * n, [()] * n)
    dynamo = planner(16, predictor="constant")
    fleet = Fleet(trace, PROFILE, dynamo, FleetConfig(gpus=16))
    seen = []
    decide = dynamo.decide

    def spy(now_s, fl):
        m = scrapes.frontend_averages(fl.scrapes, now_s, 180.0)
        num_d = len(fl.ready["decode"])
        seen.append((now_s, m, num_d, decide(now_s, fl)))
        return seen[-1][-1]

    dynamo.decide = spy
    fleet.run()
    now, m, num_d, decided = seen[0]
    assert now == 180.0
    p_corr = m.ttft_ms / PROFILE.prefill_one_ms(int(m.isl))
    prefill = m.num_req * m.isl / 180.0 * min(1.0, p_corr) / PROFILE.prefill_tokens_per_s(int(m.isl))
    concurrency = m.num_req / num_d * m.request_duration_s / 180.0
    d_corr = m.itl_ms / dynamo.decode_interp.interpolate_itl(concurrency, m.isl + m.osl / 2)
    per_gpu = dynamo.decode_interp.find_best_throughput_per_gpu(25.0 / d_corr, m.isl + m.osl / 2)
    decode = m.num_req * m.osl / 180.0 / per_gpu
    expected = (max(math.ceil(prefill), 1), max(math.ceil(decode), 1))
    assert decided == expected
