"""The cut-off (sim/cutoff.py): a run stops only once it cannot attain what it is asked,
and the searches that use it give the answers of the searches that run every split to
the end. Warm-up: every policy is scored on the same requests after it."""

from __future__ import annotations

import random

import pytest

from pdcluster import perf
from pdcluster.sim import plan, scoring
from pdcluster.sim.fleet import FleetConfig
from pdcluster.sim.plan_config import PolicyKnobs
from pdcluster.sim.plan_policies import PolicyChoice, PolicyKind
from pdcluster.sim.trace import Trace


def a_trace(seed: int, requests: int = 700, rate: float = 6.0) -> Trace:
    rng = random.Random(seed)
    t, arrival, inputs, outputs = 0.0, [], [], []
    for k in range(requests):
        # a load that doubles for a while: splits differ, and some fall short
        t += rng.expovariate(rate * (2.0 if requests // 3 < k < requests // 2 else 1.0))
        arrival.append(t)
        inputs.append(rng.randint(300, 6000))
        outputs.append(rng.randint(10, 300))
    return Trace(f"t{seed}", arrival, inputs, outputs, [() for _ in arrival])


def a_setup(trace: Trace, gpus: int = 6, warmup_s: float = 0.0) -> plan.Setup:
    profile = perf.load(perf.DEFAULT_PROFILE)
    fleet = FleetConfig(gpus=gpus, startup_s=60.0)
    return plan.Setup(trace, profile, scoring.SLO(300.0, 25.0, False), fleet, PolicyKnobs(), warmup_s)


def never_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """The searches as they were: every split run to the end."""
    monkeypatch.setattr(plan, "Cutoff", lambda deadlines, needed: None)


def test_a_run_asked_for_nothing_is_the_whole_run() -> None:
    setup = a_setup(a_trace(1))
    whole, _ = plan._simulate(setup, None, PolicyChoice.static(2, 3))
    asked, result = plan._simulate(setup, None, PolicyChoice.static(2, 3), needed=0)
    assert result.cut_s is None and not asked.cut
    assert asked == whole


def test_a_stopped_run_falls_short_of_what_it_was_asked() -> None:
    setup = a_setup(a_trace(2, rate=14.0))
    whole, _ = plan._simulate(setup, None, PolicyChoice.static(1, 1))
    assert whole.attainment < 0.7  # overloaded: misses pile up long before the end
    needed = (whole.good + whole.requests) // 2
    stopped, result = plan._simulate(setup, None, PolicyChoice.static(1, 1), needed=needed)
    assert result.cut_s is not None and stopped.cut
    assert result.end_s < setup.trace.arrival_s[-1]  # it stopped before the trace ran out
    assert whole.attainment <= stopped.attainment < needed / whole.requests
    # asked for what it does attain, it runs to the end
    reached, result = plan._simulate(setup, None, PolicyChoice.static(1, 1), needed=whole.good)
    assert result.cut_s is None and reached == whole


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_the_pruned_searches_pick_what_the_full_ones_pick(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = a_setup(a_trace(seed, rate=9.0 + seed))
    pruned_cache: dict = {}
    pruned = [plan.smallest_static(setup, a, 1, pruned_cache) for a in (0.5, 0.8, 0.95)]
    climbed = plan.static_best(setup, 1, exhaustive=False)
    every = plan.static_best(setup, 2, exhaustive=True)
    with monkeypatch.context() as m:
        never_cut(m)
        full_cache: dict = {}
        full = [plan.smallest_static(setup, a, 1, full_cache) for a in (0.5, 0.8, 0.95)]
        assert plan.static_best(setup, 1, exhaustive=False)[0] == climbed[0]
        assert plan.static_best(setup, 2, exhaustive=True)[0] == every[0]
    assert pruned == full
    # the complete runs are the same runs; some were stopped (the test would not tell otherwise)
    assert all(full_cache[sp] == sc for sp, sc in pruned_cache.items() if not sc.cut)
    assert any(sc.cut for sc in pruned_cache.values()) or any(sc.cut for sc in every[2])


def test_warm_up_is_scored_by_no_policy() -> None:
    trace = a_trace(6, requests=900)
    warmup = trace.arrival_s[300]
    setup = a_setup(trace, warmup_s=warmup)
    kinds = (
        PolicyKind.PDCLUSTER,
        PolicyKind.PDCLUSTER_FLEX,
        PolicyKind.DYNAMO_LOAD,
        PolicyKind.LLMD,
        PolicyKind.ORACLE,
    )  # those of the day scenarios (benchmarks/plan_bench.py)
    choices = [PolicyChoice.static(2, 2), *(PolicyChoice(kind) for kind in kinds)]
    for sc, result in plan.run_many(setup, choices, 1, start=(1, 1)):
        assert sc.requests == len(trace) - 300
        whole = scoring.score(result, trace, setup.targets_s, 25.0)
        assert whole.requests == len(trace)
        # the GPU-hours are those held after the warm-up: the whole run's less those before
        before = scoring.gpu_seconds_before(result, warmup) / 3600.0
        assert 0 < before < whole.gpu_hours
        assert sc.gpu_hours == pytest.approx(whole.gpu_hours - before)
        # attainment counts only the requests after it
        targets, itl_s = setup.targets_s, 0.025
        good_after = sum(
            1
            for i in range(300, len(trace))
            if result.finished[i] and result.ttft_s[i] <= targets[i] and result.itl_s[i] <= itl_s
        )
        assert sc.good == good_after and sc.attainment == good_after / (len(trace) - 300)


def test_gpu_seconds_before_integrates_the_timeline() -> None:
    from pdcluster.sim.fleet import Result

    timeline = [(0.0, 1, 1, 1, 1, 2), (10.0, 2, 1, 2, 1, 3), (30.0, 1, 1, 1, 1, 2)]
    result = Result("x", [], [], [], 2 * 10 + 3 * 20 + 2 * 10, 40.0, timeline)
    assert scoring.gpu_seconds_before(result, 5.0) == 10.0
    assert scoring.gpu_seconds_before(result, 20.0) == 20 + 30
    assert scoring.gpu_seconds_before(result, 40.0) == result.gpu_seconds


@pytest.mark.parametrize("answer", range(2, 32))
def test_the_bracket_from_any_size_holds_the_smallest_that_attains(answer: int) -> None:
    # sizes 2-30; answer 31: none attains
    for near in range(2, 31):
        probed: list[int] = []

        def attains(total: int, probed: list[int] = probed) -> bool:
            probed.append(total)
            return total >= answer

        low, high = plan._bracket(attains, 2, 30, near)
        assert low <= min(answer, 30) <= high
        assert high - low <= 2 * abs(answer - near)  # the bracket narrows with the guess
        if abs(answer - near) <= 1:  # a close guess costs at most three sizes
            assert len(probed) <= 3


@pytest.mark.parametrize("near", [2, 6, 10])
def test_the_search_from_a_size_finds_what_the_bisection_finds(near: int) -> None:
    setup = a_setup(a_trace(4, rate=40.0), gpus=10)
    cache: dict = {}
    targets = (0.5, 0.8, 0.95, 0.999, 1.01)
    plain = [plan.smallest_static(setup, a, 1, cache) for a in targets]
    assert [plan.smallest_static(setup, a, 1, cache, near) for a in targets] == plain
    sizes = [sum(sc.split) for sc in plain[:-1]]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] and plain[-1] is None  # 1.01: none can


def test_each_dynamic_policy_is_matched_with_the_smallest_static_fleet() -> None:
    from pdcluster.sim.plan_config import PlanConfig

    trace = a_trace(4, requests=2500, rate=12.0)
    config = PlanConfig(
        gpus=10,
        slo=scoring.SLO(300.0, 25.0, False),
        rate_scale=1.0,
        policies=(PolicyChoice(PolicyKind.PDCLUSTER), PolicyChoice(PolicyKind.DYNAMO_LOAD)),
        equal_attainment=True,
        startup_s=5.0,
    )
    evaluation = plan.evaluate(config, base=trace)
    for sc in evaluation.scores:
        match = plan.smallest_static(evaluation.setup, sc.attainment, 1, {})  # bisected from no guess
        found = evaluation.report["policies"][sc.policy]["static_at_equal_attainment"]
        assert match is not None and found["split"] == f"{match.split[0]}:{match.split[1]}"
        assert (
            found["attainment"] == pytest.approx(match.attainment, abs=1e-4)
            and match.attainment >= sc.attainment
        )
