"""The oracle sized by the simulator in hindsight (sim/schedule.py): the choice of one size
per window is the exact fewest engine-windows, the plan starts engines a start-up early
and lets them go at their window's end, and the planned fleet is smaller where the load
is, with nothing scored before the warm-up's end."""

from __future__ import annotations

import itertools
import random

import pytest

from pdcluster import perf
from pdcluster.sim import plan, schedule, scoring
from pdcluster.sim.fleet import FleetConfig
from pdcluster.sim.plan_config import PolicyKnobs
from pdcluster.sim.schedule import Option, Plan, Scheduled
from pdcluster.sim.trace import Trace


def a_window(rng: random.Random, requests: int) -> list[Option]:
    good, found = 0, []
    for engines in range(2, rng.randint(3, 6)):
        good = min(requests, good + rng.randint(0, requests // 2))
        p = rng.randint(1, engines - 1)
        found.append(Option((p, engines - p), good, requests))
    return found


@pytest.mark.parametrize("seed", range(40))
def test_the_choice_is_the_fewest_engines_that_reach_the_good_requests(seed: int) -> None:
    rng = random.Random(seed)
    windows = [a_window(rng, rng.randint(5, 40)) for _ in range(rng.randint(1, 4))]
    best = max(sum(o.good for o in combo) for combo in itertools.product(*windows))
    needed = rng.randint(0, best + 3)  # past `best` at times: then the most good requests
    chosen = schedule.choose(windows, needed)
    assert [any(c is o for o in w) for c, w in zip(chosen, windows, strict=True)] == [True] * len(windows)
    combos = list(itertools.product(*windows))
    enough = [c for c in combos if sum(o.good for o in c) >= needed]
    good = sum(o.good for o in chosen)
    engines = sum(o.engines for o in chosen)
    if enough:
        assert good >= needed
        assert engines == min(sum(o.engines for o in c) for c in enough)
    else:
        assert good == best
        assert engines == min(sum(o.engines for o in c) for c in combos if sum(o.good for o in c) == best)


def test_engines_start_one_start_up_early_and_go_when_their_window_ends() -> None:
    made = Plan(3600.0, [(1, 1), (3, 1), (1, 2)], good=0, requests=0)
    played = Scheduled(made, engines=5, startup_s=60.0, interval_s=30.0)
    assert played.initial() == (1, 1)
    assert played.split_at(3600.0 - 91.0) == (1, 1)
    assert played.split_at(3600.0 - 89.0) == (3, 1)  # its engines serve from the window's start
    assert played.split_at(3600.0) == (3, 1)
    assert played.split_at(7200.0 - 60.0) == (3, 2)  # both windows' engines, within the budget
    assert played.split_at(7200.0) == (1, 2)  # the prefill engines go with their window
    assert played.split_at(99_999.0) == (1, 2)  # past the plan: its last window
    tight = Scheduled(made, engines=4, startup_s=60.0, interval_s=30.0)
    assert tight.split_at(7200.0 - 60.0) == (1, 2)  # 3:2 does not fit: the coming window first


WINDOW_S = 300.0


def two_windows(seed: int = 0) -> Trace:
    """A quiet window, then one at twenty times the rate."""
    rng = random.Random(seed)
    arrival, t = [], rng.expovariate(1.0)
    while t < 2 * WINDOW_S:
        arrival.append(t)
        t += rng.expovariate(1.0 if t < WINDOW_S else 20.0)
    inputs = [rng.randint(500, 6000) for _ in arrival]
    outputs = [rng.randint(10, 200) for _ in arrival]
    return Trace("two windows", arrival, inputs, outputs, [() for _ in arrival])


def a_setup(trace: Trace, warmup_s: float = 0.0) -> plan.Setup:
    profile = perf.load(perf.DEFAULT_PROFILE)
    fleet = FleetConfig(gpus=6, startup_s=60.0)
    return plan.Setup(trace, profile, scoring.SLO(300.0, 25.0, False), fleet, PolicyKnobs(), warmup_s)


def test_the_plan_holds_fewer_engines_where_the_load_is_light_and_reaches_its_target() -> None:
    setup = a_setup(two_windows())
    made = schedule.plan(setup, 0.95, WINDOW_S)
    quiet, busy = made.splits
    assert sum(quiet) < sum(busy)
    assert made.attainment >= 0.95
    assert made.requests == len(setup.trace)
    # Each window on one engine fewer (where it can) falls short: no engine is spare.
    windows = [schedule.options(setup, w * WINDOW_S, WINDOW_S) for w in range(2)]
    chosen = [next(o for o in w if o.split == s) for w, s in zip(windows, made.splits, strict=True)]
    for k, window in enumerate(windows):
        smaller = [o for o in window if o.engines == chosen[k].engines - 1]
        if smaller:
            assert (
                smaller[0].good + sum(c.good for j, c in enumerate(chosen) if j != k) < 0.95 * made.requests
            )
    scored, result = schedule.run(setup, made)
    assert result.decisions  # the busy window's engines were added
    assert scored.gpu_hours < sum(busy) * 2 * WINDOW_S / 3600.0  # less than the busy window's fleet all along


def test_the_warm_up_is_served_well_and_not_counted() -> None:
    setup = a_setup(two_windows(), warmup_s=WINDOW_S)
    made = schedule.plan(setup, 0.9, WINDOW_S)
    assert made.requests == len(setup.trace) - sum(1 for t in setup.trace.arrival_s if t < WINDOW_S)
    warm = schedule.options(setup, 0.0, WINDOW_S)
    assert made.splits[0] == max(warm, key=lambda o: (o.good, -o.engines)).split
    with pytest.raises(ValueError, match="window's edge"):
        schedule.plan(a_setup(two_windows(), warmup_s=1800.0), 0.9)


def test_a_colocated_pool_is_planned_the_same_way_one_engine_up() -> None:
    """The colocated pool's options start at one engine (a pool needs no pair) and stop
    growing once a size serves every request; the plan is the same knapsack."""
    trace, profile = two_windows(), perf.load(perf.DEFAULT_PROFILE)
    every = [
        schedule.colocated_options(trace, profile, w * WINDOW_S, WINDOW_S, 8, 0.3, 25.0) for w in range(2)
    ]
    for window in every:
        assert [o.split for o in window] == [(k, 0) for k in range(1, len(window) + 1)]
        assert all(o.requests == window[0].requests for o in window)
        assert window[-1].good == window[-1].requests or len(window) == 8
        assert all(o.good < o.requests for o in window[:-1])  # it stopped at the first that served all
    made = schedule.plan_of(every, 0.0, WINDOW_S, 0.95)
    quiet, busy = (p for p, _ in made.splits)
    assert quiet < busy and made.attainment >= 0.95 and made.requests == len(trace)
    assert schedule.colocated_options(trace, profile, 5 * WINDOW_S, WINDOW_S, 8, 0.3, 25.0) == [
        schedule.Option((1, 0), 0, 0)
    ]
