"""`pdctl plan --compare-colocated`: the best colocated fleet (one engine per GPU, chunked
prefill) against the best prefill:decode split (sim/crossover.py), on a trace or on a
sweep of prompt length and load."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from pdcluster import perf
from pdcluster.sim import crossover
from pdcluster.sim.plan import Say, Setup, find_rate_scale, fleet_config, quiet
from pdcluster.sim.plan_config import ColocatedSweep, PlanConfig
from pdcluster.sim.trace import TraceError, load_trace


@dataclass(frozen=True)
class ColocatedComparison:
    setting: crossover.SweepConditions
    points: list[crossover.Point]
    report: dict
    # The sweep's goodput at 90% attainment per prompt length, for each mean-ITL target;
    # None on a trace.
    by_itl: dict[float, crossover.Capacities] | None


def compare_colocated(config: PlanConfig, sweep: ColocatedSweep, say: Say = quiet) -> ColocatedComparison:
    profile = perf.load(config.profile)
    if config.gpus // profile.gpus < 2:
        raise TraceError(f"--gpus {config.gpus} holds fewer than two engines of {profile.name}")
    setting = crossover.SweepConditions(
        profile.name, config.gpus, config.slo, config.link_gbps, config.router, sweep.step_fixed
    )
    if config.trace:
        return _on_trace(config, setting, profile, say)
    return _on_sweep(config, sweep, setting, say)


def _on_trace(
    config: PlanConfig, setting: crossover.SweepConditions, profile: perf.Profile, say: Say
) -> ColocatedComparison:
    """At the given rate scale, or where static-best attains about `static_attains`."""
    base = load_trace(config.trace, config.trace_format, seed=config.seed)
    scale = config.rate_scale
    if scale is None:

        def make_setup(scale: float) -> Setup:
            return Setup(base.scaled(scale), profile, config.slo, fleet_config(config, profile), config.knobs)

        scale = find_rate_scale(make_setup, config.jobs, say, config.static_attains)
    points = crossover.compare(setting, [(0, scale, base.scaled(scale))], config.jobs, say)
    report = {"points": [p.row() for p in points], "recommended_mode": crossover.recommend(points[0])}
    return ColocatedComparison(setting, points, report, None)


def _on_sweep(
    config: PlanConfig, sweep: ColocatedSweep, setting: crossover.SweepConditions, say: Say
) -> ColocatedComparison:
    workload = crossover.Workload(sweep.output_tokens, sweep.requests, sweep.span_s, config.seed)
    cases = crossover.sweep_cases(setting, sweep.lengths, sweep.loads, workload)
    points = crossover.compare(setting, cases, config.jobs, say)
    by_itl = {}
    for itl in sorted({config.slo.itl_ms, *sweep.itl_targets}):
        say(f"searching each prompt length's goodput at 90% attainment, ITL target {itl:g} ms ...")
        at = replace(setting, slo=replace(config.slo, itl_ms=itl))
        by_itl[itl] = crossover.capacities(at, sweep.lengths, workload, config.jobs)
    caps = by_itl[config.slo.itl_ms]
    report = {
        "points": [p.row() for p in points],
        "goodput_per_gpu_at_90": caps,
        "goodput_per_gpu_at_90_by_itl_target": {f"{k:g}": v for k, v in by_itl.items()},
        "crossover_length": [
            {"between": [shorter, longer], "winner_from_there": winner}
            for shorter, longer, winner in crossover.length_crossovers(caps)
        ],
    }
    return ColocatedComparison(setting, points, report, by_itl)


def print_comparison(comparison: ColocatedComparison, as_json: bool) -> None:
    if as_json:
        print(json.dumps(comparison.report, indent=2))
        return
    crossover.print_table(comparison.points)
    if comparison.by_itl is None:
        print(f"\nspec.mode: {comparison.report['recommended_mode']}")
        return
    for itl, found in comparison.by_itl.items():
        print(f"\nmean ITL target {itl:g} ms:", end="")
        crossover.print_capacities(found)


def plot_title(comparison: ColocatedComparison, sweep: ColocatedSweep) -> str:
    setting, slo = comparison.setting, comparison.setting.slo
    return (
        f"{setting.profile}, {setting.gpus} GPUs, {sweep.output_tokens} output tokens, SLO: TTFT "
        f"{'isolated prefill + ' if slo.plus_prefill else ''}{slo.ttft_ms:g} ms, mean ITL {slo.itl_ms:g} ms; "
        f"fixed part of a prompt step: the {setting.step_fixed} intercept"
    )
