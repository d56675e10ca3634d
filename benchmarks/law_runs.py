"""Quick runs of the law for comparing two versions of it side by side: the hour table at
fixed rate scales, and one policy alone over a day.

    .venv/bin/python benchmarks/law_runs.py hours [--scenarios mix,burst]
        [--policies pdcluster,pdcluster-prior] [--tolerance 5]
    .venv/bin/python benchmarks/law_runs.py day servegen-day 0.1945 5 [--policy pdcluster]
        [--startup 300] [--tolerance 0] [--decisions 8,11] [--by-hour] [--seeds 0,1,2] [--prior-day]
    .venv/bin/python benchmarks/law_runs.py hour azure-code 31.202 16 [--policy oracle]
        [--startup 300] [--decisions] [--spans 300]
    .venv/bin/python benchmarks/law_runs.py schedule azure-code-weekday 0.047 5 --attains 0.977,0.863
        [--window 3600] [--startup 300] [--seed 1] [--jobs 2]     (or: schedule azure-code 31.202 16 --window 300 ...)
    .venv/bin/python benchmarks/law_runs.py level azure-code-weekday 24 --from 0.39 [--jobs 2]
    .venv/bin/python benchmarks/law_runs.py fleets azure-code-weekday 0.4678 30 --engines 12 --attains 0.95
        [--jobs 2] [--prefill 7-11]

`hours` runs plan_bench's hour scenarios at the rate scales of docs/benchmarks.md's hour
table (the scales plan_bench's level search found: fixed here, so that a change of the law
does not move the load it is judged on), 8 GPUs, the policies from 1:1; each cell is
attainment and GPU-hours. The scales are as printed, rounded: where a run is sensitive to
its arrivals' jitter (the burst, docs/benchmarks.md) a cell can differ from plan_bench's. `hour` runs one policy alone from 1:1 on one hour scenario at a
rate scale and GPU budget, with its decisions and attainment by span if asked. `day` runs
one policy alone from 1:1 over a day scenario
(sim/day.py) at a rate factor and GPU budget, with the default policy settings, warm-up
unscored; with `--prior-day` the warm-up is also the whole day before (sim/day.py), so
the seasonal forecast has a yesterday; plan_bench's day runs add every other policy and
the static searches.
`schedule` sizes a day (or an hour scenario) in hindsight by the simulator, window by
window (sim/schedule.py), for the fewest GPU-hours at each attainment asked: the bound a
dynamic policy of that attainment is compared with. `level` finds a day's load level by
simulation, as plan_bench does, from a starting factor (e.g. a smaller level's, scaled).
`fleets` runs every split of so many static engines over a day, each stopped once it
cannot attain the figure asked: where none does, the smallest static fleet of that
attainment is larger, a bound at a fraction of plan_bench's search.
Run it once on each version of the law (e.g. a `git worktree` of the one before, with
PYTHONPATH pointing at its operator/) and compare the lines.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plan_bench
from pdcluster import perf
from pdcluster.sim import day, fleet, plan, schedule, scoring
from pdcluster.sim.plan_config import PlanConfig, PolicyKnobs
from pdcluster.sim.plan_policies import PolicyChoice, parse_policy

# (scenario, level, rate scale): docs/benchmarks.md's hour table.
HOUR_RUNS = (
    ("conv", 0.99, 1.704), ("conv", 0.9, 2.727), ("synthetic", 0.99, 1.45), ("synthetic", 0.9, 2.321),
    ("azure", 0.99, 21.252), ("azure", 0.9, 22.872), ("mix", 0.99, 1.832), ("mix", 0.9, 2.931),
    ("burst", 0.99, 10.15), ("burst", 0.9, 10.607),
)  # fmt: skip
HOUR_GPUS = 8


def hours(scenarios: set[str], policies: list[str], tolerance: int = PolicyKnobs.tolerance_percent) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, level, scale in HOUR_RUNS:
            if name not in scenarios:
                continue
            trace, plus_prefill = plan_bench.scenario(name)
            path = Path(tmp) / f"{name}.jsonl"
            plan_bench.write_jsonl(trace, path)
            config = plan_bench.plan_config(path, plus_prefill, level, 1, HOUR_GPUS)
            config = replace(
                config,
                knobs=replace(config.knobs, tolerance_percent=tolerance),
                rate_scale=scale,
                equal_attainment=False,
                policies=tuple(parse_policy(p) for p in policies),
            )
            started = time.process_time()
            report = plan.evaluate(config).report
            cells = [
                f"{p['attainment'] * 100:.1f}%, {p['gpu_hours']:.2f}" for p in report["policies"].values()
            ]
            cpu = time.process_time() - started
            print(f"{name} {level} {scale}x: " + " | ".join(cells) + f"  [{cpu:.0f} s CPU]", flush=True)


def _alone(setup: plan.Setup, policy: str, label: str) -> tuple[scoring.Score, fleet.Result]:
    """Simulate one policy from 1:1 and print its line: attainment, GPU-hours, decisions."""
    started = time.process_time()
    score, result = plan._simulate(setup, (1, 1), parse_policy(policy))
    cpu = time.process_time() - started
    print(
        f"{label}, {policy}: {score.attainment:.2%}, {score.gpu_hours:.2f} GPU-h, "
        f"{len(result.decisions)} decisions, {result.flips} flips  [{cpu:.0f} s CPU]"
    )
    return score, result


def hour_setup(name: str, scale: float, gpus: int, startup_s: float) -> plan.Setup:
    trace, plus_prefill = plan_bench.scenario(name)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.jsonl"
        plan_bench.write_jsonl(trace, path)
        config = replace(plan_bench.plan_config(path, plus_prefill, 0.99, 1, gpus), startup_s=startup_s)
        return plan.setup_maker(config)(scale)


def one_hour(
    name: str, scale: float, gpus: int, policy: str, startup_s: float, decisions: bool, span_s: float | None
) -> None:
    setup = hour_setup(name, scale, gpus, startup_s)
    _, result = _alone(setup, policy, f"{name} x{scale} on {gpus} GPUs, {startup_s:g} s start-up")
    if decisions:
        for t, prefill, decode, why in result.decisions:
            print(f"  {t:7.0f} s  {prefill}:{decode}  {why}")
    if span_s:
        spans = math.ceil(setup.trace.arrival_s[-1] / span_s)
        _print_spans(setup, result, 0.0, span_s, spans, "min", 60.0)


def one_day(
    name: str,
    factor: float,
    gpus: int,
    policy: str,
    startup_s: float,
    tolerance: int,
    decisions: tuple[float, float] | None = None,
    by_hour: bool = False,
    seeds: tuple[int, ...] = (0,),
    prior_day: bool = False,
) -> None:
    """The policy's run on each of the day's arrival draws (`seeds`); with several, also
    their mean and range: a change of the law is judged against that spread, since a day's
    figures move by a few per cent with its arrivals' jitter alone."""
    scores = []
    for seed in seeds:
        setup = day_setup(name, factor, gpus, startup_s, tolerance, seed, prior_day)
        drawn = f", seed {seed}" if len(seeds) > 1 else ""
        before = ", after the day before" if prior_day else ""
        score, result = _alone(
            setup,
            policy,
            f"{name} x{factor} on {gpus} GPUs, {startup_s:g} s start-up, tolerance {tolerance}%{drawn}{before}",
        )
        scores.append(score)
        if by_hour:
            _print_spans(setup, result, setup.warmup_s, 3600.0, round(day.DAY_S / 3600), "hour", 3600.0)
        if decisions:
            # Hours of the trace as without the day before.
            shift = setup.warmup_s - day.WARMUP_S
            start, end = (h * 3600.0 + shift for h in decisions)
            for t, prefill, decode, why in result.decisions:
                if start <= t <= end:
                    print(f"  {(t - shift) / 3600:6.3f} h  {prefill}:{decode}  {why}")
    if len(scores) > 1:
        attained = [s.attainment for s in scores]
        gpu_hours = [s.gpu_hours for s in scores]
        print(
            f"  {len(scores)} draws: attainment {np.mean(attained):.2%} ({min(attained):.2%}-{max(attained):.2%}), "
            f"{np.mean(gpu_hours):.2f} GPU-h ({min(gpu_hours):.2f}-{max(gpu_hours):.2f})"
        )


def day_setup(
    name: str,
    factor: float,
    gpus: int,
    startup_s: float,
    tolerance: int,
    seed: int = 0,
    prior_day: bool = False,
) -> plan.Setup:
    profile, slo = perf.load(perf.DEFAULT_PROFILE), scoring.SLO(500.0, 25.0, False)
    source = day.day_source(name, perf.traces_dir(), seed, prior_day)
    config = PlanConfig(
        gpus=gpus, slo=slo, rate_scale=1.0, start="neutral", warmup_s=source.warmup_s, startup_s=startup_s
    )
    knobs = PolicyKnobs(tolerance_percent=tolerance)
    fleet_config = plan.fleet_config(config, profile)
    # Requests still unfinished this long after the trace's start are given up on.
    fleet_config = replace(
        fleet_config, max_time_s=max(fleet_config.max_time_s, source.warmup_s + 2 * day.DAY_S)
    )
    return plan.Setup(source.make(factor), profile, slo, fleet_config, knobs, source.warmup_s)


def scheduled(
    name: str,
    factor: float,
    gpus: int,
    targets: list[float],
    window_s: float,
    startup_s: float,
    seed: int,
    jobs: int = 1,
) -> None:
    """A day (or an hour scenario) sized in hindsight window by window (sim/schedule.py)
    for each target, and its run; the windows are simulated once for all targets, the
    splits a climb compares `jobs` at a time."""
    if name in day.DAY_SCENARIOS:
        setup = day_setup(name, factor, gpus, startup_s, PolicyKnobs.tolerance_percent, seed)
    else:
        setup = hour_setup(name, factor, gpus, startup_s)
    started = cpu_s()
    every = schedule.windows(setup, window_s, jobs)
    print(
        f"{name} x{factor} on {gpus} GPUs, {startup_s:g} s start-up, {window_s:g} s windows "
        f"simulated in {cpu_s() - started:.0f} s CPU, workers included"
    )
    for attains in targets:
        made = schedule.plan(setup, attains, window_s, every=every)
        score, result = schedule.run(setup, made)
        engines = [sum(s) for s in made.splits][math.ceil(setup.warmup_s / window_s) :]
        print(
            f"  oracle-schedule for {attains:.2%}: planned {made.attainment:.2%}, run {score.attainment:.2%}, "
            f"{score.gpu_hours:.2f} GPU-h, {score.goodput_per_gpu_hour:,.0f} good requests per GPU-hour, "
            f"{len(result.decisions)} decisions, {np.mean(engines):.2f} engines on average"
        )
        print("    engines per window: " + " ".join(f"{p}:{d}" for p, d in made.splits))


def fleets(
    name: str, factor: float, gpus: int, engines: int, attains: float, jobs: int, prefill: range | None = None
) -> None:
    """Whether any split of `engines` static engines attains `attains` over a day: every
    split run, each stopped once it cannot (sim/cutoff.py, a bound: a stopped split is
    known to fall short). No split attaining it bounds the smallest static fleet of that
    attainment from below, at a fraction of the searches' cost. The splits run `jobs` at
    a time, each line printed as it ends and its run dropped: a day of ServeGen at 24
    engines is 24 M requests, and fifteen runs kept at once did not fit in 24 GB."""
    setup = day_setup(name, factor, gpus, 60.0, PolicyKnobs.tolerance_percent)
    needed = math.ceil(attains * setup.deadlines.scored - 1e-9)
    started = cpu_s()
    splits = [(p, engines - p) for p in range(1, engines) if prefill is None or p in prefill]
    print(f"{name} x{factor}, {engines} static engines, to attain {attains:.2%} ({needed:,} good requests):")
    attained = []
    for at in range(0, len(splits), max(jobs, 1)):
        batch = splits[at : at + max(jobs, 1)]
        runs = plan.run_many(setup, [PolicyChoice.static(p, d) for p, d in batch], jobs, needed=needed)
        for (p, d), (sc, result) in zip(batch, runs, strict=True):
            if sc.cut:
                # Rounded down: a bound just under the target must not print as the target.
                bound = math.floor(sc.attainment * 1e4) / 1e4
                print(
                    f"  {p}:{d}: stopped at hour {result.cut_s / 3600:.1f}, at most {bound:.2%}", flush=True
                )
            else:
                print(f"  {p}:{d}: {sc.attainment:.2%}, {sc.gpu_hours:.2f} GPU-h", flush=True)
            if sc.attainment >= attains:
                attained.append(f"{p}:{d}")
        del runs
    print(
        f"  {'attained by ' + ', '.join(attained) if attained else 'no split attains it'} "
        f"[{cpu_s() - started:.0f} s CPU, workers included]"
    )


def cpu_s() -> float:
    """CPU seconds of this process and of its finished workers."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def level(name: str, engines: int, start: float | None, jobs: int) -> None:
    """plan_bench's day level (`--day-level simulated`) from a given starting factor."""
    profile, slo = perf.load(perf.DEFAULT_PROFILE), scoring.SLO(500.0, 25.0, False)
    started = time.process_time()
    found = day.level_by_simulation(
        day.day_source(name, perf.traces_dir()), profile, slo, engines, jobs=jobs, start=start
    )
    print(
        f"{name} at {engines} engines: rate factor {found.factor:.4f}, the peak hour {found.attainment:.2%} "
        f"as {found.split[0]}:{found.split[1]}, {found.simulated} peak hours simulated "
        f"[{time.process_time() - started:.0f} s CPU in this process]"
    )


def _print_spans(
    setup: plan.Setup,
    result: fleet.Result,
    start_s: float,
    span_s: float,
    spans: int,
    unit: str,
    unit_s: float,
) -> None:
    """Each scored span from `start_s`: requests, attainment, the requests that missed TTFT
    and those that missed only ITL, and the mean prefill and decode engines the policy
    asked for."""
    seen, ttft, itl = (np.zeros(spans) for _ in range(3))
    itl_s = setup.slo.itl_ms / 1000.0
    for i, t in enumerate(setup.trace.arrival_s):
        h = int((t - start_s) // span_s)
        if 0 <= h < spans:
            seen[h] += 1
            late = not result.finished[i] or result.ttft_s[i] > setup.targets_s[i]
            slow = not late and result.itl_s[i] > itl_s
            ttft[h], itl[h] = ttft[h] + late, itl[h] + slow
    engines = np.zeros((spans, 2))
    held = np.zeros(spans)
    ends = [t for t, *_ in result.timeline[1:]] + [result.end_s]
    for (t0, _, _, p, d, _), t1 in zip(result.timeline, ends, strict=True):
        # An entry holds until the next; spread its span over the spans it covers.
        while t0 < t1:
            h = int((t0 - start_s) // span_s)
            upto = min(t1, start_s + (h + 1) * span_s)
            if 0 <= h < spans:
                engines[h] += (upto - t0) * np.array([p, d])
                held[h] += upto - t0
            t0 = upto
    print(f"  {unit:>6}  requests  attained  TTFT-miss  ITL-miss  prefill  decode")
    for h in range(spans):
        p, d = engines[h] / held[h] if held[h] else (0.0, 0.0)
        share = 1.0 - (ttft[h] + itl[h]) / seen[h] if seen[h] else float("nan")
        at = h * span_s / unit_s
        print(f"  {at:6g}  {seen[h]:8.0f}  {share:8.2%}  {ttft[h]:9.0f}  {itl[h]:8.0f}  {p:7.2f}  {d:6.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    h = sub.add_parser("hours", help="the hour table at fixed rate scales")
    h.add_argument("--scenarios", default=",".join(dict.fromkeys(r[0] for r in HOUR_RUNS)))
    h.add_argument("--policies", default="pdcluster,pdcluster-prior")
    h.add_argument(
        "--tolerance", type=int, default=PolicyKnobs.tolerance_percent, help="autoscaling.tolerancePercent"
    )
    d = sub.add_parser("day", help="one policy alone over a day scenario")
    d.add_argument("scenario", choices=sorted(day.DAY_SCENARIOS))
    d.add_argument("factor", type=float, help="the rate factor (plan_bench prints a level's)")
    d.add_argument("gpus", type=int)
    d.add_argument("--policy", default="pdcluster")
    d.add_argument("--startup", type=float, default=60.0, help="engine start-up (s), pod created to Ready")
    d.add_argument(
        "--tolerance", type=int, default=PolicyKnobs.tolerance_percent, help="autoscaling.tolerancePercent"
    )
    d.add_argument(
        "--decisions", metavar="H0,H1", help="also print the decisions between these hours of the trace"
    )
    d.add_argument("--by-hour", action="store_true", help="also print each scored hour's figures")
    d.add_argument(
        "--seeds", default="0", help="the arrival draws to run, comma-separated; several print their spread"
    )
    d.add_argument(
        "--prior-day", action="store_true", help="warm up on the day before too: the forecast's yesterday"
    )
    c = sub.add_parser(
        "schedule", help="a day or an hour sized in hindsight, window by window, for an attainment"
    )
    c.add_argument("scenario", help="a day scenario, or one of plan_bench's hour scenarios")
    c.add_argument("factor", type=float, help="the rate factor or scale (plan_bench prints a level's)")
    c.add_argument("gpus", type=int)
    c.add_argument(
        "--attains", required=True, help="the scored day's attainments to reach (0-1), comma-separated"
    )
    c.add_argument("--window", type=float, default=3600.0, help="seconds per window (the warm-up's divisor)")
    c.add_argument("--startup", type=float, default=60.0, help="engine start-up (s), pod created to Ready")
    c.add_argument("--seed", type=int, default=0, help="a day's arrival draw (day's --seeds)")
    c.add_argument("--jobs", type=int, default=1)
    v = sub.add_parser("level", help="a day's load level for a number of engines at the peak, by simulation")
    v.add_argument("scenario", choices=sorted(day.DAY_SCENARIOS))
    v.add_argument("engines", type=int)
    v.add_argument(
        "--from", dest="start", type=float, help="the rate factor to bracket from (default: the models')"
    )
    v.add_argument("--jobs", type=int, default=1)
    f = sub.add_parser(
        "fleets", help="whether any split of so many static engines attains a figure over a day"
    )
    f.add_argument("scenario", choices=sorted(day.DAY_SCENARIOS))
    f.add_argument("factor", type=float, help="the rate factor (plan_bench prints a level's)")
    f.add_argument("gpus", type=int)
    f.add_argument("--engines", type=int, required=True)
    f.add_argument("--attains", type=float, required=True, help="the scored day's attainment (0-1)")
    f.add_argument("--jobs", type=int, default=1)
    f.add_argument("--prefill", metavar="P-Q", help="only the splits of P to Q prefill engines")
    o = sub.add_parser("hour", help="one policy alone on one hour scenario")
    o.add_argument(
        "scenario", help="one of plan_bench's hour scenarios (conv, synthetic, azure, azure-code, ...)"
    )
    o.add_argument("scale", type=float, help="the rate scale (plan_bench prints a level's)")
    o.add_argument("gpus", type=int)
    o.add_argument("--policy", default="pdcluster")
    o.add_argument("--startup", type=float, default=60.0, help="engine start-up (s), pod created to Ready")
    o.add_argument("--decisions", action="store_true", help="also print the policy's decisions")
    o.add_argument("--spans", type=float, metavar="S", help="also print each S seconds' figures")
    a = parser.parse_args(argv)
    if a.what == "hours":
        hours(set(a.scenarios.split(",")), a.policies.split(","), a.tolerance)
    elif a.what == "schedule":
        targets = [float(x) for x in a.attains.split(",")]
        scheduled(a.scenario, a.factor, a.gpus, targets, a.window, a.startup, a.seed, a.jobs)
    elif a.what == "level":
        level(a.scenario, a.engines, a.start, a.jobs)
    elif a.what == "fleets":
        low, _, high = (a.prefill or "").partition("-")
        only = range(int(low), int(high or low) + 1) if a.prefill else None
        fleets(a.scenario, a.factor, a.gpus, a.engines, a.attains, a.jobs, only)
    elif a.what == "hour":
        one_hour(a.scenario, a.scale, a.gpus, a.policy, a.startup, a.decisions, a.spans)
    else:
        window = tuple(float(h) for h in a.decisions.split(",")) if a.decisions else None
        seeds = tuple(int(x) for x in a.seeds.split(","))
        one_day(
            a.scenario,
            a.factor,
            a.gpus,
            a.policy,
            a.startup,
            a.tolerance,
            window,
            a.by_hour,
            seeds,
            a.prior_day,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
