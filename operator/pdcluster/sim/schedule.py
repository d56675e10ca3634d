"""A bound sized by the simulator in hindsight: each window of the trace (an hour by
default) on the fewest engines that let the whole day attain a target.

The capacity-model oracle (sim/oracle.py) sizes from mean rates, so it loses the bursts
within the minute that the Azure code trace is made of, and attains 10-25 points less
than the law there (docs/benchmarks.md); its GPU-hours are then no bound at the law's
attainment. This one knows every request: each window's requests alone are simulated
on static fleets of each size up to the budget, the best split of each (hill-climbed as
the static searches do, sim/plan.py `best_split_of`), from a ready fleet. One size per
window is then chosen, exactly (a multiple-choice knapsack by dynamic programming over
engine-windows), to hold the fewest engine-windows whose good requests reach the target
over the scored windows. The plan is played as a policy: a window's extra engines start
one start-up early, engines go when their window ends, and the run is scored as every
policy is. A window simulated alone starts with an empty queue and ends with none
carried over, so the run can attain a little more or less than the plan says; both are
reported.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, replace

from pdcluster.perf import Profile
from pdcluster.sim.colocated import ColocatedConfig, simulate_colocated
from pdcluster.sim.fleet import Fleet, Result, simulate
from pdcluster.sim.plan import Setup, best_split_of
from pdcluster.sim.scoring import Score, score
from pdcluster.sim.trace import Trace


@dataclass(frozen=True)
class Option:
    """A window on a static fleet: its best split of so many engines, and how it did."""

    split: tuple[int, int]
    good: int
    requests: int

    @property
    def engines(self) -> int:
        return sum(self.split)


@dataclass(frozen=True)
class Plan:
    window_s: float
    splits: list[tuple[int, int]]  # one per window, from the trace's start
    good: int  # scored windows' good requests, as simulated window by window
    requests: int

    @property
    def attainment(self) -> float:
        return self.good / max(self.requests, 1)


def window_of(trace: Trace, start_s: float, length_s: float) -> Trace:
    """The requests arriving in [start, start + length), their times from the start."""
    lo, hi = bisect_left(trace.arrival_s, start_s), bisect_left(trace.arrival_s, start_s + length_s)
    return Trace(
        f"{trace.name} [{start_s:.0f}, {start_s + length_s:.0f}) s",
        [t - start_s for t in trace.arrival_s[lo:hi]],
        trace.input_tokens[lo:hi],
        trace.output_tokens[lo:hi],
        trace.blocks[lo:hi],
        trace.block_tokens,
    )


def options(setup: Setup, start_s: float, length_s: float, jobs: int = 1) -> list[Option]:
    """The window's best split of each size, from two engines up; the sizes stop growing
    once one serves every request within the SLO (a larger fleet cannot do better)."""
    trace = window_of(setup.trace, start_s, length_s)
    if not len(trace):
        return [Option((1, 1), 0, 0)]
    alone = replace(setup, trace=trace, warmup_s=0.0)
    found: list[Option] = []
    cache: dict[tuple[int, int], Score] = {}
    for total in range(2, setup.engines + 1):
        best = best_split_of(alone, total, jobs, cache)
        assert best.split is not None
        found.append(Option(best.split, best.good, best.requests))
        if best.good == best.requests:
            break
    return found


def colocated_options(
    trace: Trace, profile: Profile, start_s: float, length_s: float, most: int, ttft_s: float, itl_ms: float
) -> list[Option]:
    """A colocated pool's options for one window: static fleets of 1 to `most` engines
    (split (k, 0)), the sizes stopping once one serves every request within the SLO."""
    part = window_of(trace, start_s, length_s)
    if not len(part):
        return [Option((1, 0), 0, 0)]
    found: list[Option] = []
    for engines in range(1, most + 1):
        result = simulate_colocated(part, profile, ColocatedConfig(engines=engines))
        judged = score(result, part, [ttft_s] * len(part), itl_ms)
        found.append(Option((engines, 0), judged.good, judged.requests))
        if judged.good == judged.requests:
            break
    return found


def choose(windows: list[list[Option]], good_needed: int) -> list[Option]:
    """One option per window, holding the fewest engine-windows whose good requests add
    up to `good_needed` (exact: the most good requests for each total of engines, by
    dynamic programming); the most good requests possible where none reaches it."""
    most: dict[int, tuple[int, list[int]]] = {0: (0, [])}  # engines -> (good, choice per window)
    for window in windows:
        step: dict[int, tuple[int, list[int]]] = {}
        for engines, (good, picks) in most.items():
            for k, option in enumerate(window):
                key = engines + option.engines
                total = good + option.good
                if key not in step or total > step[key][0]:
                    step[key] = (total, [*picks, k])
        most = step
    enough = [engines for engines, (good, _) in most.items() if good >= good_needed]
    engines = min(enough) if enough else max(most, key=lambda e: (most[e][0], -e))
    return [window[k] for window, k in zip(windows, most[engines][1], strict=True)]


def windows(setup: Setup, window_s: float = 3600.0, jobs: int = 1) -> list[list[Option]]:
    """Every window's options, from the trace's start (what plans for several targets share)."""
    end = setup.trace.arrival_s[-1] if len(setup.trace) else 0.0
    count = max(math.ceil((end + 1e-9) / window_s), 1)
    return [options(setup, w * window_s, window_s, jobs) for w in range(count)]


def plan(
    setup: Setup,
    attains: float,
    window_s: float = 3600.0,
    jobs: int = 1,
    every: list[list[Option]] | None = None,
) -> Plan:
    """The plan for `setup`'s trace (`every`: its windows' options, computed if not given):
    windows before the warm-up's end get the split that serves them best (they are neither
    scored nor counted); the scored windows the fewest engine-windows that attain
    `attains` of their requests."""
    every = every if every is not None else windows(setup, window_s, jobs)
    return plan_of(every, setup.warmup_s, window_s, attains)


def plan_of(every: list[list[Option]], warmup_s: float, window_s: float, attains: float) -> Plan:
    """The plan from every window's options (those of a prefill:decode fleet or of a
    colocated pool): the windows before the warm-up's end get the option that serves them
    best, the scored windows the fewest engine-windows that attain `attains`."""
    first_scored = math.ceil(warmup_s / window_s - 1e-9)
    if warmup_s and abs(first_scored * window_s - warmup_s) > 1e-6:
        raise ValueError(f"the warm-up ({warmup_s:g} s) must end on a window's edge ({window_s:g} s)")
    warm = [max(o, key=lambda x: (x.good, -x.engines)) for o in every[:first_scored]]
    scored = every[first_scored:]
    requests = sum(o[0].requests for o in scored)
    chosen = choose(scored, math.ceil(attains * requests - 1e-9))
    return Plan(
        window_s,
        [o.split for o in warm + chosen],
        sum(o.good for o in chosen),
        requests,
    )


class Scheduled:
    """A plan played as a policy: at each interval, for every role, the most engines any
    window needs from now until what it asks for now could serve (one start-up and one
    interval ahead), so engines start a start-up early and go when their window ends."""

    name = "oracle-schedule"

    def __init__(self, plan: Plan, engines: int, startup_s: float, interval_s: float = 30.0) -> None:
        self.plan, self.engines = plan, engines
        self.startup_s, self.interval_s = startup_s, interval_s
        self.last_reason = ""

    def split_at(self, now_s: float) -> tuple[int, int]:
        splits = self.plan.splits
        first = min(int(now_s // self.plan.window_s), len(splits) - 1)
        last = min(int((now_s + self.startup_s + self.interval_s) // self.plan.window_s), len(splits) - 1)
        ahead = splits[first : last + 1]
        p, d = max(s[0] for s in ahead), max(s[1] for s in ahead)
        if p + d > self.engines:  # two windows' splits do not fit together: the next one first
            p, d = splits[last]
        self.last_reason = f"windows {first}-{last}"
        return p, d

    def initial(self) -> tuple[int, int]:
        return self.split_at(0.0)

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None:
        return self.split_at(now_s)


def run(setup: Setup, made: Plan) -> tuple[Score, Result]:
    """The plan played over the whole trace, scored as every policy is."""
    policy = Scheduled(made, setup.engines, setup.fleet.startup_s, float(setup.knobs.interval_s))
    result = simulate(setup.trace, setup.profile, policy, setup.fleet)
    return score(result, setup.trace, setup.targets_s, setup.slo.itl_ms, setup.warmup_s), result
