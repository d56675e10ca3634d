"""The Dynamo load-based planner and the llm-d HPA baselines, run in the fleet simulator."""

from __future__ import annotations

import itertools
import random

import pytest

from pdcluster import perf
from pdcluster.sim import scrapes
from pdcluster.sim.dynamo import (
    INDEPENDENT,
    UP_EITHER_DOWN_BOTH,
    Dynamo,
    DynamoLoad,
    LoadRegression,
    one_step,
)
from pdcluster.sim.fleet import Fleet, FleetConfig, Result, simulate
from pdcluster.sim.llmd import HPA, LLMD, clip_to_budget
from pdcluster.sim.trace import Trace

PROFILE = perf.load()
SLO = {"ttft_ms": 500.0, "itl_ms": 25.0}


def trace(
    rates: list[tuple[float, float]],
    isl: tuple[int, int] = (3000, 8000),
    osl: tuple[int, int] = (50, 150),
    seed: int = 1,
) -> Trace:
    """Poisson arrivals at rates[k][1] until rates[k][0] seconds."""
    rng = random.Random(seed)
    t, arrival = 0.0, []
    end = rates[-1][0]
    while True:
        t += rng.expovariate(next(rate for until, rate in rates if t < until))
        if t >= end:
            break
        arrival.append(t)
    n = len(arrival)
    inputs = [rng.randint(*isl) for _ in range(n)]
    outputs = [rng.randint(*osl) for _ in range(n)]
    return Trace("synthetic", arrival, inputs, outputs, [()] * n)


PREFILL_BURST = trace([(60, 2.0), (120, 20.0), (300, 2.0)])  # 110k prompt tokens/s for a minute
HIGH_THEN_LOW = trace([(180, 12.0), (500, 1.0)])
LONG_OUTPUTS = trace([(30, 0.5), (300, 3.0)], isl=(6000, 9000), osl=(1500, 2500))
BOTH_HEAVY = trace([(30, 0.5), (400, 8.0)], isl=(6000, 9000), osl=(1500, 2500))
CONFIG = FleetConfig(gpus=16, startup_s=30.0)


def run(policy, tr: Trace, config: FleetConfig = CONFIG) -> tuple[Result, Fleet]:
    fleet = Fleet(tr, PROFILE, policy, config)
    return fleet.run(), fleet


def recorded(policy):
    """Wrap policy.decide to keep (time, throughput floor, what it returned)."""
    seen = []
    decide = policy.decide

    def spy(now_s, fleet):
        out = decide(now_s, fleet)
        seen.append((now_s, getattr(policy, "lower_bound", None), out))
        return out

    policy.decide = spy
    return seen


# ---------------------------------------------------------------- Dynamo, load-based


def test_regression_solves_for_the_largest_load_within_the_sla() -> None:
    line = LoadRegression(window=50, min_observations=5)
    for x in (1000.0, 2000.0, 3000.0, 4000.0):
        line.add(x, 100.0 + 0.01 * x)
    assert line.max_load(500.0) is None  # cold start: 4 of 5 observations
    line.add(5000.0, 150.0)
    assert line.max_load(500.0) == pytest.approx(40000.0)
    assert line.max_load(50.0) == 0.0  # the target is below the intercept: clamped


def test_regression_without_a_rising_slope_trusts_only_observed_loads() -> None:
    falling = LoadRegression(window=50, min_observations=2)
    for x, y in ((1000.0, 900.0), (3000.0, 400.0), (5000.0, 300.0)):
        falling.add(x, y)
    assert falling.max_load(500.0) == 3000.0  # the lightest load that met the target
    assert falling.max_load(100.0) == 1000.0  # none met it: the lightest of all


def test_the_window_forgets_old_observations() -> None:
    line = LoadRegression(window=3, min_observations=3)
    for x, y in ((0.0, 900.0), (1.0, 1000.0), (2.0, 0.0), (3.0, 100.0), (4.0, 200.0)):
        line.add(x, y)
    assert line.fit() == pytest.approx((100.0, -200.0))  # the last three points only


@pytest.mark.parametrize(
    ("loads", "workers", "expected"),
    [
        ([10.0, 6.0], 2, 3),  # every worker above the target of 5
        ([10.0, 0.0], 2, None),  # one worker still has room
        ([1.0, 1.9], 2, 1),  # all below 5 * (2 - 1) / 2 * 0.8 = 2
        ([1.0, 2.1], 2, None),
        ([0.0], 1, None),  # never below one worker
    ],
)
def test_one_replica_moves_need_every_worker_to_agree(loads, workers, expected) -> None:
    assert one_step(loads, 5.0, workers) == expected


def test_a_prefill_burst_adds_a_replica_within_a_load_interval_or_two() -> None:
    load = DynamoLoad(PROFILE, **SLO, gpu_budget=16, start=(1, 1))
    seen = recorded(load)
    simulate(PREFILL_BURST, PROFILE, load, CONFIG)
    first_up = next((t, floor, out) for t, floor, out in seen if out is not None and out[0] > 1)
    t, floor, _ = first_up
    assert 60.0 < t <= 70.0
    assert floor == (1, 1)  # the load loop did it: no throughput result had come yet
    # The throughput planner alone cannot react before its first 180 s interval.
    alone = simulate(PREFILL_BURST, PROFILE, Dynamo(PROFILE, **SLO, gpu_budget=16, start=(1, 1)), CONFIG)
    assert not [d for d in alone.decisions if d[0] < 180.0]


def test_load_decisions_never_go_below_the_throughput_result() -> None:
    load = DynamoLoad(PROFILE, **SLO, gpu_budget=16, start=(1, 1))
    steps = []  # (what the load rules wanted, the throughput floor, the decision)
    combined, load_step = load.combined, load.load_step

    def keep_wanted(*args):
        steps.append([combined(*args)])
        return steps[-1][0]

    def keep_decision(now_s, fleet):
        out = load_step(now_s, fleet)
        steps[-1] += [load.lower_bound, out]
        return out

    load.combined, load.load_step = keep_wanted, keep_decision
    simulate(HIGH_THEN_LOW, PROFILE, load, CONFIG)
    decisions = [step for step in steps if step[0] is not None]
    assert decisions
    assert all(out[0] >= floor[0] and out[1] >= floor[1] for _, floor, out in decisions)
    # After the busy first interval the floor holds prefill up while the load wants it down.
    assert any(out[0] > wanted[0] for wanted, _, out in decisions)


@pytest.mark.parametrize(
    ("combine", "p_desired", "d_desired", "current", "expected"),
    [
        (INDEPENDENT, 3, None, (2, 2), (3, 2)),
        (INDEPENDENT, None, 1, (2, 2), (2, 1)),  # decode alone may scale down
        (INDEPENDENT, 3, 1, (2, 2), (3, 1)),
        (INDEPENDENT, None, None, (2, 2), None),
        (UP_EITHER_DOWN_BOTH, 3, 1, (2, 2), (3, 2)),  # an up wins; the other role holds
        (UP_EITHER_DOWN_BOTH, None, 1, (2, 2), None),  # down needs both
        (UP_EITHER_DOWN_BOTH, 1, None, (2, 2), None),
        (UP_EITHER_DOWN_BOTH, 1, 1, (2, 2), (1, 1)),
        (UP_EITHER_DOWN_BOTH, None, 3, (2, 2), (2, 3)),
    ],
)
def test_how_the_two_roles_combine(combine, p_desired, d_desired, current, expected) -> None:
    load = DynamoLoad(PROFILE, **SLO, gpu_budget=16, start=(1, 1), combine=combine)
    assert load.combined(p_desired, d_desired, *current) == expected


def test_prefill_scales_down_alone_only_when_roles_are_independent() -> None:
    def prefill_targets(combine: str) -> tuple[list[int], list[int]]:
        load = DynamoLoad(PROFILE, **SLO, gpu_budget=16, start=(1, 1), combine=combine)
        result = simulate(HIGH_THEN_LOW, PROFILE, load, CONFIG)
        return [row[3] for row in result.timeline], [row[4] for row in result.timeline]

    prefill, decode = prefill_targets(INDEPENDENT)
    assert set(decode) == {1}  # decode never has a replica to give back
    assert max(prefill) > 1 and any(b < a for a, b in itertools.pairwise(prefill))
    prefill, decode = prefill_targets(UP_EITHER_DOWN_BOTH)
    assert set(decode) == {1} and max(prefill) > 1
    assert prefill == sorted(prefill)  # decode never agrees, so prefill never comes down


def test_dynamo_load_stays_within_the_gpu_budget() -> None:
    load = DynamoLoad(PROFILE, **SLO, gpu_budget=3, start=(1, 1))
    result = simulate(BOTH_HEAVY, PROFILE, load, CONFIG)
    assert max(p + d for _, _, _, p, d, _ in result.timeline) == 3
    assert all(p >= 1 and d >= 1 for _, _, _, p, d, _ in result.timeline)


# ---------------------------------------------------------------- llm-d, HPA per role


def test_hpa_tolerance_and_ratio_rule() -> None:
    assert HPA(target=5.0, replicas=1).sync(0.0, 5.4, pods=1) == 1  # ratio 1.08: within 10%
    assert HPA(target=5.0, replicas=1).sync(0.0, 5.6, pods=1) == 2  # ceil(5.6 / 5)
    assert HPA(target=0.8, replicas=2).sync(0.0, 1.7, pods=2) == 2  # ratio 1.06
    assert HPA(target=0.8, replicas=2).sync(0.0, 1.9, pods=2) == 3  # ceil(1.9 / 0.8), one pod per step


def test_hpa_adds_at_most_one_pod_per_180_s() -> None:
    hpa = HPA(target=1.0, replicas=1)
    steps = {t: hpa.sync(t, 10.0, pods=hpa.replicas) for t in range(0, 400, 15)}
    assert steps[0] == 2 and steps[165] == 2 and steps[180] == 3 and steps[345] == 3 and steps[360] == 4


def test_hpa_scale_down_waits_for_its_stabilization_window() -> None:
    hpa = HPA(target=1.0, replicas=3)
    assert hpa.sync(0.0, 3.0, pods=3) == 3
    steps = {t: hpa.sync(t, 0.0, pods=hpa.replicas) for t in range(15, 700, 15)}
    assert steps[285] == 3  # the recommendation of 3 at t=0 is still in the 300 s window
    assert steps[300] == 2  # then one pod ...
    assert steps[585] == 2 and steps[600] == 1  # ... per 300 s, down to minReplicas
    assert steps[690] == 1


@pytest.mark.parametrize(
    ("wanted", "engines", "expected"),
    [((2, 2), 8, (2, 2)), ((6, 4), 5, (3, 2)), ((9, 1), 4, (3, 1)), ((2, 2), 3, (2, 1))],
)
def test_budget_clips_both_roles_in_proportion(wanted, engines, expected) -> None:
    assert clip_to_budget(*wanted, engines) == expected


def test_llmd_scales_prefill_when_the_queue_passes_its_target() -> None:
    llmd = LLMD(PROFILE, **SLO, gpu_budget=16, start=(1, 1))
    seen = recorded(llmd)
    result, fleet = run(llmd, PREFILL_BURST)
    t, _, out = next(s for s in seen if s[2] is not None and s[2][0] > 1)
    assert 60.0 < t <= 120.0
    snap = scrapes.snapshot(fleet.scrapes, t, llmd.window_s, 0.5)
    assert snap.prefill_queue > 5.0
    assert out[1] == 1  # decode KV stays far below 0.8 of one pod
    assert not [s for s in seen if s[0] < 60.0 and s[2] is not None and s[2][0] > 1]
    assert max(row[3] for row in result.timeline) >= 2


def test_llmd_scales_decode_when_kv_usage_passes_its_target() -> None:
    llmd = LLMD(PROFILE, **SLO, gpu_budget=16, start=(1, 1))
    seen = recorded(llmd)
    _, fleet = run(llmd, LONG_OUTPUTS)
    decided = [(t, out) for t, _, out in seen if out is not None]
    ups = [t for (_, before), (t, out) in itertools.pairwise(decided) if out[1] > before[1]]
    assert ups
    snap = scrapes.snapshot(fleet.scrapes, ups[0], llmd.window_s, 0.5)
    assert snap.decode_kv_usage * snap.decode.ready > 0.8 * (1 + 0.1)
    assert all(b - a >= 180.0 for a, b in itertools.pairwise(ups))  # one pod per 180 s
    assert all(out[0] == 1 for _, _, out in seen if out)  # nothing waits for prefill


def test_llmd_stays_within_the_gpu_budget_when_both_roles_want_more() -> None:
    llmd = LLMD(PROFILE, **SLO, gpu_budget=3, start=(1, 1))
    wanted = []
    decide = llmd.decide

    def spy(now_s, fleet):
        out = decide(now_s, fleet)
        wanted.append((llmd.prefill.replicas, llmd.decode.replicas, out))
        return out

    llmd.decide = spy
    result = simulate(BOTH_HEAVY, PROFILE, llmd, CONFIG)
    assert max(p + d for _, _, _, p, d, _ in result.timeline) == 3
    clipped = [(p, d, out) for p, d, out in wanted if p + d > 3]
    assert clipped  # both HPAs asked for more than fits
    assert all(out[0] >= 1 and out[1] >= 1 and sum(out) == 3 for _, _, out in clipped)
