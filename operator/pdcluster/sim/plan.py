"""`pdctl plan`: replay a trace on a simulated fleet under several policies.

Policies: `static:P:D`; `static-best` (every split of the GPUs, the best in hindsight);
`dynamo` (Dynamo's SLA planner, sim/dynamo.py; `dynamo-constant` with its constant
predictor); `pdcluster` (pdcluster.control.decide with a PDCluster whose autoscaling
block matches the flags). Dynamic policies start from the split the capacity model
gives for the trace's mean load, as a user sizing from the same trace would.

A request meets the SLO when its TTFT and its mean ITL are within the targets;
attainment is the share that does, goodput those per second of trace, GPU-hours the
integral of GPUs held (starting and draining engines count).

`--store-gib` replays the trace instead on one static split (`--policy static:P:D`, or
static-best without a store) with a Mooncake store of each DRAM size (sim/store.py):
how much of the prompts the store serves, the prefill GPU-seconds it saves against the
trace's reusable share, and the TTFT it buys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from pdcluster import perf
from pdcluster.router.policy import POLICIES
from pdcluster.sim import crossover, longload
from pdcluster.sim.fleet import FleetConfig, Result
from pdcluster.sim.planreport import plot, print_store_curve, print_table, report_for, store_curve
from pdcluster.sim.plansetup import Setup, make_policy, model_split, size_for
from pdcluster.sim.scoring import SLO, Score, band
from pdcluster.sim.search import find_rate_scale, run_many, smallest_static, static_best
from pdcluster.sim.trace import Trace, TraceError, load_trace

# What callers of `pdctl plan` as a library use, wherever it is defined.
__all__ = [
    "SLO",
    "Setup",
    "add_arguments",
    "evaluate",
    "main",
    "make_policy",
    "print_table",
    "run",
    "run_many",
    "size_for",
    "store_curve",
]

DEFAULT_POLICIES = ("static-best", "dynamo", "pdcluster")


# ------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_workload(parser)
    _add_policies(parser)
    _add_store(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival jitter")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel simulations")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", help="write a PNG of replicas and latency over time (needs matplotlib)")
    _add_crossover(parser)


def _add_workload(parser: argparse.ArgumentParser) -> None:
    """The trace, its rate, the fleet and the SLO."""
    parser.add_argument(
        "--trace", help="Mooncake JSONL or Azure CSV trace (required but with --compare-colocated)"
    )
    parser.add_argument(
        "--format", choices=("mooncake", "azure"), help="trace format (default: from the suffix)"
    )
    parser.add_argument(
        "--profile",
        default=perf.DEFAULT_PROFILE,
        choices=perf.profile_names(),
        metavar="NAME",
        help="latency profile of one engine: " + ", ".join(perf.profile_names()),
    )
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the cluster (the budget)")
    parser.add_argument("--slo-ttft-ms", type=float, required=True, help="TTFT target")
    parser.add_argument("--slo-itl-ms", type=float, required=True, help="mean ITL target per request")
    parser.add_argument(
        "--ttft-plus-prefill",
        action="store_true",
        help="a request's TTFT target is --slo-ttft-ms plus its own isolated prefill time (long prompts)",
    )
    parser.add_argument(
        "--rate-scale", type=float, help="raise the request rate by this factor (default: searched)"
    )
    parser.add_argument(
        "--rate-mode",
        choices=("compress", "replicate"),
        default="compress",
        help="compress: replay the trace faster (time shrinks); replicate: keep the time axis and add "
        "independent copies of the trace's users (load patterns keep their duration)",
    )
    parser.add_argument(
        "--rate-curve",
        help="a t_s,rate_rps CSV (hourly or finer; `pdctl trace curve` writes one): the load over time, "
        "with --trace as the source of request lengths and within-minute burstiness; --rate-scale (or "
        "the search) multiplies the curve",
    )
    parser.add_argument("--startup-s", type=float, default=60.0, help="engine start-up delay")
    parser.add_argument("--link-gbps", type=float, default=200.0, help="P->D KV transfer bandwidth")
    parser.add_argument("--router", choices=POLICIES, default="prefix-aware")


def _add_policies(parser: argparse.ArgumentParser) -> None:
    """The policies compared, where the dynamic ones start, and their settings."""
    parser.add_argument(
        "--policy",
        action="append",
        help="static:P:D, static-best, dynamo, dynamo-constant, dynamo-load (throughput + load-based), llmd "
        "(per-role HPA on queue and KV usage), oracle, pdcluster (no profile: learned online) or "
        "pdcluster-prior (the engines' profile as its prior) (repeatable; default: "
        + ", ".join(DEFAULT_POLICIES)
        + ")",
    )
    parser.add_argument(
        "--start",
        default="neutral",
        help="split the dynamic policies start from: neutral (1:1, the minimum of each role), model (the "
        "capacity model's for the mean load), best (static-best's, chosen in hindsight) or P:D",
    )
    parser.add_argument(
        "--static-attains",
        type=float,
        default=0.9,
        help="the searched rate scale is where the best full-budget static split attains about this share",
    )
    parser.add_argument(
        "--equal-attainment",
        action="store_true",
        help="for each dynamic policy, find the smallest static fleet (any size, any split, in hindsight) "
        "that attains as much (static_at_equal_attainment in --json)",
    )
    parser.add_argument("--interval", type=int, default=30, help="pdcluster: autoscaling.intervalSeconds")
    parser.add_argument("--window", type=int, default=120, help="pdcluster: autoscaling.windowSeconds")
    parser.add_argument("--scale-up-stabilization", type=int, default=0)
    parser.add_argument("--scale-down-stabilization", type=int, default=300)
    parser.add_argument("--cooldown", type=int, default=60)
    parser.add_argument("--max-step", type=int, default=2)
    parser.add_argument("--tolerance", type=int, default=10, help="pdcluster: tolerancePercent")
    parser.add_argument("--dynamo-interval", type=float, default=180.0, help="dynamo: adjustment_interval")


def _add_store(parser: argparse.ArgumentParser) -> None:
    """`--store-gib`: one static split with a Mooncake store of each size instead."""
    parser.add_argument(
        "--store-gib",
        type=_sizes,
        help="comma-separated DRAM sizes of a Mooncake store (GiB): print how much each serves and saves, "
        "on one static split, instead of comparing policies",
    )
    parser.add_argument("--store-ssd-gib", type=float, default=0.0, help="an SSD tier behind the DRAM one")
    parser.add_argument("--store-ssd-gbps", type=float, default=25.0, help="what an engine loads from SSD at")
    parser.add_argument(
        "--store-max-computed-tokens",
        type=int,
        default=512,
        help="the router sends a prompt straight to decode when at most this many tokens are not stored",
    )


def _add_crossover(parser: argparse.ArgumentParser) -> None:
    compare = parser.add_argument_group(
        "disaggregated or colocated (sim/crossover.py)",
        "--compare-colocated: the best colocated fleet (one engine per GPU, chunked prefill) against the "
        "best prefill:decode split, on --trace or, without one, on a sweep of prompt length and load; "
        "--plot draws it, --csv writes its data",
    )
    compare.add_argument("--compare-colocated", action="store_true")
    compare.add_argument(
        "--lengths",
        type=_counts,
        default=crossover.LENGTHS,
        help="prompt lengths of the sweep (comma-separated tokens; default 1k to 128k)",
    )
    compare.add_argument(
        "--loads",
        type=_numbers,
        default=crossover.LOADS,
        help="loads of the sweep: the share of the GPUs' time the prompts alone take (comma-separated)",
    )
    compare.add_argument(
        "--itl-targets",
        type=_numbers,
        help="more mean-ITL targets (ms, comma-separated) to search the sweep's goodput at, one line each "
        "in the plot's ratio panel",
    )
    compare.add_argument("--output-tokens", type=int, default=256, help="output length of the sweep")
    compare.add_argument("--requests", type=int, default=600, help="requests per sweep point, at least")
    compare.add_argument(
        "--span-s", type=float, default=60.0, help="seconds of arrivals per sweep point, at least"
    )
    compare.add_argument(
        "--csv", help="write the plotted data as CSV (and the fixed-load points to <name>-loads.csv)"
    )
    compare.add_argument(
        "--step-fixed",
        choices=("decode", "prefill"),
        default="decode",
        help="engine time of the fixed part of a step carrying prompt tokens, in both architectures: the "
        "profile's decode intercept (the rest of its prefill intercept is each request's latency on its "
        "way in) or its whole prefill intercept",
    )


def evaluate(args: argparse.Namespace, say=lambda _msg: None) -> tuple[dict, dict[str, Result], Setup]:
    """Simulate every requested policy; the report, the raw results and the setup."""
    profile = perf.load(args.profile)
    if args.gpus // profile.gpus < 2:
        raise TraceError(
            f"--gpus {args.gpus} holds {args.gpus // profile.gpus} engine(s) of {profile.gpus} GPU(s); "
            "prefill and decode need one each"
        )
    base = load_trace(args.trace, args.format, seed=args.seed)
    curve = longload.read_rate_curve(args.rate_curve) if args.rate_curve else None
    slo = SLO(args.slo_ttft_ms, args.slo_itl_ms, args.ttft_plus_prefill)
    fleet = _fleet_config(args, profile)

    def make_setup(scale: float) -> Setup:
        if curve is not None:
            trace = longload.curve_over_trace(base, curve.scaled(scale), seed=args.seed)
        elif args.rate_mode == "compress":
            trace = base.scaled(scale)
        else:
            trace = base.replicated(scale, args.seed)
        return Setup(trace, profile, slo, fleet, args)

    searched = args.rate_scale is None
    if searched:
        low, high = band(args.static_attains)
        say(f"searching the rate scale at which static-best attains {low:.1%}-{high:.1%} ...")
    scale = args.rate_scale or find_rate_scale(base, make_setup, args.jobs, say, args.static_attains)
    setup = make_setup(scale)
    names = args.policy or list(DEFAULT_POLICIES)
    scores: list[Score] = []
    results: dict[str, Result] = {}
    simple = [n for n in names if n != "static-best"]
    dynamic = [n for n in simple if not n.startswith("static:")]
    best = None
    if "static-best" in names or (dynamic and args.start == "best"):
        best, result, _ = static_best(setup, args.jobs, exhaustive=True)
        if "static-best" in names:
            scores.append(best)
            results[best.policy] = result
    start = _start(args.start, setup, best)
    for sc, result in run_many(setup, simple, args.jobs, start):
        scores.append(sc)
        results[sc.policy] = result
    report = report_for(setup, scale, searched, scores, results, start)
    if args.equal_attainment:
        cache: dict[tuple[int, int], Score] = {}
        for sc in scores:
            if sc.policy in dynamic:
                match = smallest_static(setup, sc.attainment, args.jobs, cache)
                report["policies"][sc.policy]["static_at_equal_attainment"] = (
                    None
                    if match is None
                    else {"split": f"{match.split[0]}:{match.split[1]}", **match.as_dict()}
                )
    return report, results, setup


def _counts(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers expected") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: whole numbers >= 1 expected")
    return values


def _numbers(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers expected") from None
    if not values or any(not x > 0 for x in values):
        raise argparse.ArgumentTypeError(f"{text!r}: numbers above 0 expected")
    return values


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of sizes in GiB: {text!r}") from None
    if not sizes or any(x <= 0 for x in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be above 0 GiB: {text!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    say = (lambda _msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    if args.compare_colocated:
        if args.rate_curve:
            print(
                "pdctl plan: --rate-curve applies to policies on a trace, not to --compare-colocated",
                file=sys.stderr,
            )
            return 2
        return compare_colocated(args, say)
    if not args.trace:
        print("pdctl plan: --trace is required (or --compare-colocated for the sweep)", file=sys.stderr)
        return 2
    if args.store_gib:
        args.policy = [p for p in args.policy or [] if p.startswith("static:")][:1] or ["static-best"]
    try:
        report, results, setup = evaluate(args, say)
    except (TraceError, OSError) as e:
        print(f"pdctl plan: {e}", file=sys.stderr)
        return 2
    if args.store_gib:
        name = next(iter(report["policies"]))
        p, d = name.removeprefix("static-best (").removeprefix("static:").rstrip(")").split(":")
        curve = store_curve(setup, (int(p), int(d)))
        if args.json:
            print(json.dumps(curve, indent=2))
        else:
            print_store_curve(curve)
        return 0
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    if args.plot:
        return plot(args.plot, results, setup)
    return 0


def compare_colocated(args: argparse.Namespace, say) -> int:
    profile = perf.load(args.profile)
    if args.gpus // profile.gpus < 2:
        print(
            f"pdctl plan: --gpus {args.gpus} holds fewer than two engines of {profile.name}", file=sys.stderr
        )
        return 2
    slo = SLO(args.slo_ttft_ms, args.slo_itl_ms, args.ttft_plus_prefill)
    setting = crossover.Setting(profile.name, args.gpus, slo, args.link_gbps, args.router, args.step_fixed)
    workload = crossover.Workload(args.output_tokens, args.requests, args.span_s, args.seed)
    try:
        cases = _colocated_cases(args, profile, setting, workload, say)
    except (TraceError, OSError) as e:
        print(f"pdctl plan: {e}", file=sys.stderr)
        return 2
    points = crossover.compare(setting, cases, args.jobs, say)
    report: dict = {"points": [p.row() for p in points]}
    by_itl = None  # ITL target -> goodput at 90% per prompt length: the sweep's
    if args.trace:
        report["recommended_mode"] = crossover.recommend(points[0])
    else:
        by_itl = _sweep_goodput(args, setting, workload, say)
        caps = by_itl[args.slo_itl_ms]
        report["goodput_per_gpu_at_90"] = caps
        report["goodput_per_gpu_at_90_by_itl_target"] = {f"{k:g}": v for k, v in by_itl.items()}
        report["crossover_length"] = [
            {"between": [shorter, longer], "winner_from_there": winner}
            for shorter, longer, winner in crossover.length_crossovers(caps)
        ]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        crossover.print_table(points)
        if by_itl is None:
            print(f"\nspec.mode: {report['recommended_mode']}")
        else:
            for itl, found in by_itl.items():
                print(f"\nmean ITL target {itl:g} ms:", end="")
                crossover.print_capacities(found)
    if args.csv:
        for path in crossover.write_csv(args.csv, points, by_itl):
            say(f"wrote {path}")
    if args.plot and by_itl is not None:
        title = (
            f"{profile.name}, {args.gpus} GPUs, {args.output_tokens} output tokens, SLO: TTFT "
            f"{'isolated prefill + ' if slo.plus_prefill else ''}{slo.ttft_ms:g} ms, mean ITL {slo.itl_ms:g} ms; "
            f"fixed part of a prompt step: the {args.step_fixed} intercept"
        )
        return crossover.plot(args.plot, by_itl, args.slo_itl_ms, title)
    return 0


def _colocated_cases(
    args: argparse.Namespace,
    profile: perf.Profile,
    setting: crossover.Setting,
    workload: crossover.Workload,
    say,
) -> list[tuple[int, float, Trace]]:
    """What --compare-colocated compares on: the trace at its rate scale (searched when not
    given), else the sweep of prompt length and load."""
    if not args.trace:
        return crossover.sweep_cases(setting, args.lengths, args.loads, workload)
    base = load_trace(args.trace, args.format, seed=args.seed)
    if args.rate_scale is None:

        def make_setup(scale: float) -> Setup:
            return Setup(base.scaled(scale), profile, setting.slo, _fleet_config(args, profile), args)

        args.rate_scale = find_rate_scale(base, make_setup, args.jobs, say, args.static_attains)
    return [(0, args.rate_scale, base.scaled(args.rate_scale))]


def _sweep_goodput(
    args: argparse.Namespace, setting: crossover.Setting, workload: crossover.Workload, say
) -> dict:
    """Per mean-ITL target: each prompt length's goodput per GPU at 90% attainment."""
    by_itl = {}
    for itl in sorted({args.slo_itl_ms, *(args.itl_targets or [])}):
        say(f"searching each prompt length's goodput at 90% attainment, ITL target {itl:g} ms ...")
        at = replace(setting, slo=replace(setting.slo, itl_ms=itl))
        by_itl[itl] = crossover.capacities(at, args.lengths, workload, args.jobs)
    return by_itl


def _fleet_config(args: argparse.Namespace, profile: perf.Profile) -> FleetConfig:
    return FleetConfig(
        gpus=args.gpus,
        startup_s=args.startup_s,
        link_gbps=args.link_gbps,
        router=args.router,
        gpus_per_engine=profile.gpus,
    )


def _start(spec: str, setup: Setup, best: Score | None) -> tuple[int, int]:
    if spec == "neutral":  # what a cluster applied with minReplicas would start from
        return 1, 1
    if spec == "best" and best is not None:
        return best.split
    if spec in ("best", "model"):
        return model_split(setup)
    p, d = spec.split(":")
    return int(p), int(d)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdctl plan", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
