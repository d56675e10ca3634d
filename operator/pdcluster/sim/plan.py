"""`pdctl plan`: replay a trace on a simulated fleet under several policies.

Policies: `static:P:D`; `static-best` (every split of the GPUs, the best in hindsight);
`dynamo` (Dynamo's SLA planner, sim/dynamo/; `dynamo-constant` with its constant
predictor); `pdcluster` (pdcluster.control.decide with a PDCluster whose autoscaling
block matches the flags). Dynamic policies start from the split the capacity model
gives for the trace's mean load, as a user sizing from the same trace would.

A request meets the SLO when its TTFT and its mean ITL are within the targets;
attainment is the share that does, goodput those per second of trace, GPU-hours the
integral of GPUs held (starting and draining engines count).

`--store-gib` replays the trace instead on one static split (`--policy static:P:D`, or
static-best without a store) with a Mooncake store of each DRAM size (sim/tiered_store.py):
how much of the prompts the store serves, the prefill GPU-seconds it saves against the
trace's reusable share, and the TTFT it buys.

This module is the planner; sim/plan_cli.py turns the command line into a PlanConfig
(sim/plan_config.py) and prints what comes back.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from multiprocessing import get_context

from pdcluster import observability as obs
from pdcluster import perf
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.control import sizing
from pdcluster.sim import longload, plan_report
from pdcluster.sim.cutoff import Cutoff, Deadlines
from pdcluster.sim.dynamo import Dynamo, DynamoLoad
from pdcluster.sim.fleet import FleetConfig, Result, simulate
from pdcluster.sim.fleet_state import Policy
from pdcluster.sim.llmd import LLMD
from pdcluster.sim.oracle import Oracle
from pdcluster.sim.plan_config import PlanConfig, PolicyKnobs, Start
from pdcluster.sim.plan_policies import PolicyChoice, PolicyKind
from pdcluster.sim.policies import FlexiblePDCluster, PDCluster, Static
from pdcluster.sim.scoring import SLO, Score, band, score
from pdcluster.sim.trace import Trace, TraceError, load_trace

Say = Callable[[str], None]  # where progress goes


def quiet(_message: str) -> None:
    pass


# ------------------------------------------------------------------------- setup
@dataclass(frozen=True)
class Setup:
    trace: Trace  # already scaled
    profile: perf.Profile
    slo: SLO
    fleet: FleetConfig
    knobs: PolicyKnobs
    warmup_s: float = 0.0  # requests before this are warm-up: served, never scored

    @cached_property
    def targets_s(self) -> list[float]:
        return self.slo.ttft_targets_s(self.trace, self.profile)

    @cached_property
    def deadlines(self) -> Deadlines:
        first = bisect.bisect_left(self.trace.arrival_s, self.warmup_s) if self.warmup_s > 0 else 0
        return Deadlines.of(self.trace.arrival_s, self.targets_s, self.slo.itl_ms / 1000.0, first)

    @property
    def engines(self) -> int:
        """Engines the cluster's GPUs hold (an engine takes the profile's GPUs)."""
        return self.fleet.gpus // self.fleet.gpus_per_engine


def spec_for(setup: Setup, start: tuple[int, int], prior: bool = False) -> PDClusterSpec:
    knobs = setup.knobs
    n, gpus = setup.engines, setup.fleet.gpus_per_engine
    return PDClusterSpec.model_validate(
        {
            "model": {"name": "simulated"},
            "prefill": {"replicas": start[0], "minReplicas": 1, "maxReplicas": n - 1, "gpusPerPod": gpus},
            "decode": {"replicas": start[1], "minReplicas": 1, "maxReplicas": n - 1, "gpusPerPod": gpus},
            "autoscaling": {
                "enabled": True,
                "gpuBudget": n,
                **({"profile": setup.profile.name} if prior else {}),
                "slo": {
                    "ttftMs": round(setup.slo.ttft_ms),
                    "itlMs": round(setup.slo.itl_ms),
                    "quantile": "p90",
                },
                "ttftIncludesPrefill": not setup.slo.plus_prefill,
                "intervalSeconds": knobs.interval_s,
                "windowSeconds": knobs.window_s,
                "scaleUpStabilizationSeconds": knobs.scale_up_stabilization_s,
                "scaleDownStabilizationSeconds": knobs.scale_down_stabilization_s,
                "cooldownSeconds": knobs.cooldown_s,
                "maxStep": knobs.max_step,
                "tolerancePercent": knobs.tolerance_percent,
            },
        }
    )


def size_for(
    profile: perf.Profile, slo: SLO, rate: float, lengths: list[int], outputs: list[int], engines: int
) -> tuple[int, int]:
    """The split the control law's sizing gives for a load (no observations), within `engines`."""
    # The prompt-length histogram vLLM would export of this load (the convex prefill cost).
    bounds = obs.vllm_request_token_buckets(1 << 20)
    counts = [0] * (len(bounds) + 1)
    for n in lengths:
        counts[bisect.bisect_left(bounds, n)] += 1
    histogram = tuple(zip((*map(float, bounds), math.inf), map(float, counts), strict=True))
    p, d = sizing.engines_for(
        profile,
        rate=rate,
        input_tokens=sum(lengths) / len(lengths),
        output_tokens=sum(outputs) / len(outputs),
        lengths=histogram,
        ttft_ms=slo.ttft_ms,
        itl_ms=slo.itl_ms,
        quantile=0.9,
        own_prefill=not slo.plus_prefill,
        limit=engines - 1,
    )
    if p + d > engines:
        p = min(max(round(engines * p / (p + d)), 1), engines - 1)
        d = engines - p
    return p, d


def model_split(setup: Setup) -> tuple[int, int]:
    """The split the capacity models give for the trace's mean load (no observations)."""
    tr = setup.trace
    rate = len(tr) / max(tr.span_s, 1e-9)
    return size_for(setup.profile, setup.slo, rate, tr.input_tokens, tr.output_tokens, setup.engines)


def make_policy(choice: PolicyChoice, setup: Setup, start: tuple[int, int] | None = None) -> Policy:
    if choice.split is not None:
        return Static(*choice.split)
    start = start or model_split(setup)
    kind = choice.kind
    if kind is PolicyKind.PDCLUSTER:  # as deployed by default: no profile, capacity learned online
        return PDCluster(spec_for(setup, start), None)
    if kind is PolicyKind.PDCLUSTER_FLEX:
        return FlexiblePDCluster(spec_for(setup, start), None, choice.name)
    if kind is PolicyKind.PDCLUSTER_PRIOR:  # given the simulated engines' own profile as the prior
        return PDCluster(spec_for(setup, start, prior=True), setup.profile, choice.name)
    if kind is PolicyKind.ORACLE:
        return Oracle(
            setup.trace,
            lambda rate, lengths, outputs: size_for(
                setup.profile, setup.slo, rate, lengths, outputs, setup.engines
            ),
            setup.engines,
            setup.fleet.startup_s,
            float(setup.knobs.interval_s),
        )
    # The baselines get the engines' true profile where they need one, and the SLO.
    given = {
        "ttft_ms": setup.slo.ttft_ms,
        "itl_ms": setup.slo.itl_ms,
        "gpu_budget": setup.fleet.gpus,
        "start": start,
    }
    dynamo_interval = setup.knobs.dynamo_interval_s
    if kind is PolicyKind.DYNAMO_LOAD:  # throughput + load-based, Dynamo's advice for bursty traffic
        return DynamoLoad(setup.profile, **given, interval_s=dynamo_interval)
    if kind is PolicyKind.LLMD:
        return LLMD(setup.profile, **given, gpus_per_engine=setup.fleet.gpus_per_engine)
    if kind in (PolicyKind.DYNAMO, PolicyKind.DYNAMO_CONSTANT):
        predictor = "constant" if kind is PolicyKind.DYNAMO_CONSTANT else "arima"
        return Dynamo(setup.profile, **given, interval_s=dynamo_interval, predictor=predictor)
    raise ValueError(f"{choice.name} is a search over static splits, not one policy")


def _simulate(
    setup: Setup, start: tuple[int, int] | None, choice: PolicyChoice, needed: int | None = None
) -> tuple[Score, Result]:
    """One policy's run and score; with `needed`, stopped once fewer than that many scored
    requests can still meet the SLO (its attainment is then that bound, `cut` set)."""
    policy = make_policy(choice, setup, start)
    fleet = replace(setup.fleet, flexible=choice.kind is PolicyKind.PDCLUSTER_FLEX)
    cutoff = None if needed is None else Cutoff(setup.deadlines, needed)
    result = simulate(setup.trace, setup.profile, policy, fleet, cutoff)
    scored = score(result, setup.trace, setup.targets_s, setup.slo.itl_ms, setup.warmup_s)
    if cutoff is not None and result.cut_s is not None:
        bound = setup.deadlines.scored - cutoff.missed
        scored = replace(scored, attainment=bound / max(scored.requests, 1), cut=True)
    if isinstance(policy, Static):
        scored = replace(scored, split=policy.split)
    return scored, result


# A pool worker's setup, given once by its initializer (forked, not pickled per task).
_WORKER_INPUTS: tuple[Setup, tuple[int, int] | None] | None = None


def _init_worker(setup: Setup, start: tuple[int, int] | None) -> None:
    global _WORKER_INPUTS
    _WORKER_INPUTS = (setup, start)


def _simulate_in_worker(task: tuple[PolicyChoice, int | None]) -> tuple[Score, Result]:
    assert _WORKER_INPUTS is not None
    return _simulate(*_WORKER_INPUTS, *task)


def run_many(
    setup: Setup,
    choices: list[PolicyChoice],
    jobs: int,
    start: tuple[int, int] | None = None,
    needed: int | None = None,
) -> list[tuple[Score, Result]]:
    """Every choice's run; `needed`: each may stop once it cannot have that many good requests."""
    if jobs <= 1 or len(choices) <= 1:  # a pool of none or one is only overhead (and none is an error)
        return [_simulate(setup, start, c, needed) for c in choices]
    with ProcessPoolExecutor(
        min(jobs, len(choices)),
        mp_context=get_context("fork"),
        initializer=_init_worker,
        initargs=(setup, start),
    ) as pool:
        return list(pool.map(_simulate_in_worker, [(c, needed) for c in choices]))


def static_best(setup: Setup, jobs: int, exhaustive: bool) -> tuple[Score, Result, list[Score]]:
    """The best split in hindsight: every split, or a hill climb from the model's split.
    A split that can no longer attain as much as the best so far (the climb's centre)
    stops early (sim/cutoff.py): the answer is the one every split run to the end gives."""
    n = setup.engines
    seen: dict[int, tuple[Score, Result]] = {}

    def run(splits: list[int], needed: int | None) -> None:
        for q, result in zip(
            splits,
            run_many(setup, [PolicyChoice.static(q, n - q) for q in splits], jobs, needed=needed),
            strict=True,
        ):
            seen[q] = result

    if exhaustive:
        batch = max(jobs, 1)
        for at in range(1, n, batch):
            best_good = max((sc.good for sc, _ in seen.values() if not sc.cut), default=None)
            run(list(range(at, min(at + batch, n))), best_good)
    else:
        p = model_split(setup)[0]
        run([p], None)
        while True:
            run([q for q in (p - 1, p + 1) if 1 <= q < n and q not in seen], seen[p][0].good)
            best = max(seen, key=lambda q: (seen[q][0].attainment, -abs(q - p)))
            if best == p:
                break
            p = best
    runs = [seen[q] for q in sorted(seen)]
    best_score, best_result = max(runs, key=lambda r: r[0].attainment)
    named = replace(best_score, policy=PolicyChoice(PolicyKind.STATIC_BEST, best_score.split).name)
    return named, best_result, [r[0] for r in runs]


def best_split_of(setup: Setup, total: int, jobs: int, cache: dict[tuple[int, int], Score]) -> Score:
    """The best split of `total` engines in hindsight: hill-climbed from the best share
    found so far (_prefill_share), a neighbour stopping early once it cannot attain as much
    as the split it is compared with. `cache` keeps every simulated split."""

    def run(splits: list[tuple[int, int]], needed: int | None) -> None:
        # A split stopped early is known to fall below what it was run against; asked
        # against less, it runs again.
        todo = [sp for sp in splits if sp not in cache or not _settles(cache[sp], needed)]
        for sp, (sc, _) in zip(
            todo,
            run_many(setup, [PolicyChoice.static(p, d) for p, d in todo], jobs, needed=needed),
            strict=True,
        ):
            cache[sp] = sc

    p = min(max(round(total * _prefill_share(setup, total, cache)), 1), total - 1)
    run([(p, total - p)], None)
    while True:
        centre = cache[(p, total - p)]
        run([(q, total - q) for q in (p - 1, p + 1) if 1 <= q < total], centre.good)
        around = [q for q in (p - 1, p, p + 1) if 1 <= q < total]
        q = max(around, key=lambda q: (cache[(q, total - q)].attainment, -abs(q - p)))
        if q == p:
            return centre
        p = q


def _prefill_share(setup: Setup, total: int, cache: dict[tuple[int, int], Score]) -> float:
    """Where a climb starts: the best whole run's prefill share at the nearest size run, else the
    model's, which a day's bursts can put far from the best split (each step a whole-day run)."""
    whole = {sp: sc for sp, sc in cache.items() if not sc.cut}
    if not whole:
        mp, md = model_split(setup)
        return mp / (mp + md)
    size = min({sum(sp) for sp in whole}, key=lambda n: (abs(n - total), -n))
    return max((sp for sp in whole if sum(sp) == size), key=lambda sp: whole[sp].attainment)[0] / size


def smallest_static(
    setup: Setup, attainment: float, jobs: int, cache: dict[tuple[int, int], Score], near: int | None = None
) -> Score | None:
    """The smallest static fleet (fewest engines, the best split of them, in hindsight)
    that attains at least `attainment`; None if the whole budget cannot. Attainment grows
    with engines, so the size is bisected (best_split_of each), within a bracket found
    from `near` (a size thought close) if given: each size is a hill climb of whole runs."""

    def attains(total: int) -> bool:
        return best_split_of(setup, total, jobs, cache).attainment >= attainment

    low, high = 2, setup.engines  # the answer, if any, is in [low, high]
    if near is not None:
        low, high = _bracket(attains, low, high, min(max(near, low), high))
    while low < high:
        middle = (low + high) // 2
        if attains(middle):
            high = middle
        else:
            low = middle + 1
    found = best_split_of(setup, low, jobs, cache)
    return found if found.attainment >= attainment else None


def _bracket(attains: Callable[[int], bool], low: int, high: int, near: int) -> tuple[int, int]:
    """A narrower [low, high] with the smallest size that attains, probed from `near` in doubling steps."""
    step = 1
    if attains(near):
        high = near
        while high - step >= low:
            if not attains(high - step):
                return high - step + 1, high
            high, step = high - step, step * 2
        return low, high
    low = min(near + 1, high)  # near == high: the final check says whether it attains
    while low + step - 1 < high:
        if attains(low + step - 1):
            return low, low + step - 1
        low, step = low + step, step * 2
    return low, high


def _settles(known: Score, needed: int | None) -> bool:
    """Whether a run made answers one against `needed` good requests: whole, or its bound short of it."""
    if not known.cut:
        return True
    return needed is not None and round(known.attainment * known.requests) < needed


def find_rate_scale(make_setup: Callable[[float], Setup], jobs: int, log: Say, target: float = 0.9) -> float:
    """A rate scale at which static-best attains about `target` (geometric bisection)."""
    low_band, high_band = band(target)
    setup = make_setup(1.0)
    tr, profile = setup.trace, setup.profile
    rate = len(tr) / max(tr.span_s, 1e-9)
    isl = sum(tr.input_tokens) / len(tr)
    osl = sum(tr.output_tokens) / len(tr)
    context = isl + osl / 2
    gpu_load = rate * isl / profile.prefill_tokens_per_s(int(isl)) + rate * osl / max(
        profile.decode_tokens_per_s(setup.slo.itl_ms, int(context)), 1.0
    )
    scale = 0.8 * setup.engines / gpu_load
    low, high = 0.0, math.inf
    for _ in range(12):
        attained = static_best(make_setup(scale), jobs, exhaustive=False)[0].attainment
        log(f"  rate scale {scale:.2f}: static-best attainment {attained:.3f}")
        if low_band <= attained <= high_band:
            return scale
        if attained > high_band:
            low = scale
        else:
            high = scale
        if low and math.isfinite(high):
            scale = math.sqrt(low * high)
        else:
            scale = scale * 1.6 if math.isfinite(scale) and not math.isfinite(high) else scale / 1.6
    return scale


# ------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class Evaluation:
    report: dict
    results: dict[str, Result]  # by policy name
    setup: Setup
    scores: list[Score]  # in the order of the report's policies


def fleet_config(config: PlanConfig, profile: perf.Profile) -> FleetConfig:
    return FleetConfig(
        gpus=config.gpus,
        startup_s=config.startup_s,
        link_gbps=config.link_gbps,
        router=config.router,
        gpus_per_engine=profile.gpus,
    )


def setup_maker(config: PlanConfig, base: Trace | None = None) -> Callable[[float], Setup]:
    """The setup at each rate scale: the trace (`base`, or `config.trace` read) scaled as
    `config` says."""
    profile = perf.load(config.profile)
    if config.gpus // profile.gpus < 2:
        raise TraceError(
            f"--gpus {config.gpus} holds {config.gpus // profile.gpus} engine(s) of {profile.gpus} GPU(s); "
            "prefill and decode need one each"
        )
    if base is None:
        base = load_trace(config.trace, config.trace_format, seed=config.seed)
    curve = longload.read_rate_curve(config.rate_curve) if config.rate_curve else None
    fleet = fleet_config(config, profile)

    def make_setup(scale: float) -> Setup:
        if curve is not None:
            trace = longload.curve_over_trace(base, curve.scaled(scale), seed=config.seed)
        elif config.rate_mode == "compress":
            trace = base.scaled(scale)
        else:
            trace = base.replicated(scale, config.seed)
        return Setup(trace, profile, config.slo, fleet, config.knobs, config.warmup_s)

    return make_setup


def evaluate(config: PlanConfig, say: Say = quiet, base: Trace | None = None) -> Evaluation:
    """Simulate every policy `config` asks for: the report, the raw results and the setup.
    `base`: a trace already in memory, instead of `config.trace`."""
    make_setup = setup_maker(config, base)
    searched = config.rate_scale is None
    if searched:
        low, high = band(config.static_attains)
        say(f"searching the rate scale at which static-best attains {low:.1%}-{high:.1%} ...")
    scale = config.rate_scale or find_rate_scale(make_setup, config.jobs, say, config.static_attains)
    setup = make_setup(scale)
    scores, results, best, start = run_policies(setup, config)
    report = plan_report.build_report(setup, config, scale, searched, scores, results, best, start)
    if config.equal_attainment:
        add_static_at_equal_attainment(report, setup, config, scores, results)
    return Evaluation(report, results, setup, scores)


def run_policies(
    setup: Setup, config: PlanConfig
) -> tuple[list[Score], dict[str, Result], Score | None, tuple[int, int]]:
    """Every policy's score and result; static-best's score when asked for; and the
    split the dynamic policies started from."""
    best_wanted = PolicyChoice(PolicyKind.STATIC_BEST) in config.policies
    single_runs = [c for c in config.policies if c.kind is not PolicyKind.STATIC_BEST]
    scores: list[Score] = []
    results: dict[str, Result] = {}
    best = None
    if best_wanted or (any(c.dynamic for c in single_runs) and config.start == "best"):
        best, result, _ = static_best(setup, config.jobs, exhaustive=True)
        if best_wanted:
            scores.append(best)
            results[best.policy] = result
    start = start_split(config.start, setup, best)
    for sc, result in run_many(setup, single_runs, config.jobs, start):
        scores.append(sc)
        results[sc.policy] = result
    return scores, results, (best if best_wanted else None), start


def start_split(start: Start, setup: Setup, best: Score | None) -> tuple[int, int]:
    if isinstance(start, tuple):
        return start
    if start == "neutral":  # what a cluster applied with minReplicas would start from
        return 1, 1
    if start == "best" and best is not None and best.split is not None:
        return best.split
    return model_split(setup)  # "model", or "best" where static-best did not run


def add_static_at_equal_attainment(
    report: dict, setup: Setup, config: PlanConfig, scores: list[Score], results: dict[str, Result]
) -> None:
    """For each dynamic policy, the smallest static fleet that attains as much; the static
    runs already made (a fixed split, static-best) are not made again."""
    dynamic = {c.name for c in config.policies if c.dynamic}  # a score carries its policy's name
    cache = {sc.split: sc for sc in scores if sc.split is not None and sc.policy not in dynamic}
    near = None
    for sc in scores:
        if sc.policy in dynamic:
            # The search starts at the last answer, or at the most engines the policy held:
            # a static fleet that serves as well is seldom far from either.
            near = near or max((p + d for _, p, d, *_ in results[sc.policy].timeline), default=2)
            match = smallest_static(setup, sc.attainment, config.jobs, cache, near)
            near = near if match is None else sum(match.split)
            report["policies"][sc.policy]["static_at_equal_attainment"] = (
                None if match is None else {"split": f"{match.split[0]}:{match.split[1]}", **match.as_dict()}
            )
