"""`pdctl plan`'s command line: its flags, and what it prints. The flags become a
PlanConfig (sim/plan_config.py); the planner (sim/plan.py) never sees them."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pdcluster import perf
from pdcluster.router.policy import POLICIES
from pdcluster.sim import crossover, plan, plan_colocated, plan_report, plan_store
from pdcluster.sim.plan_config import ColocatedSweep, PlanConfig, PolicyKnobs, Start, StoreSweep
from pdcluster.sim.plan_policies import DEFAULT_POLICIES, parse_policy
from pdcluster.sim.scoring import SLO
from pdcluster.sim.trace import TraceError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_load_arguments(parser)
    _add_fleet_arguments(parser)
    _add_knob_arguments(parser)
    _add_store_and_output_arguments(parser)
    _add_colocated_arguments(parser)


def _add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace, the engines' profile, the SLO and the rate."""
    parser.add_argument(
        "--trace", help="Mooncake JSONL or Azure CSV trace (required but with --compare-colocated)"
    )
    parser.add_argument(
        "--format", choices=("mooncake", "azure"), help="trace format (default: from the suffix)"
    )
    parser.add_argument(
        "--profile",
        default=PlanConfig.profile,
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
        default=PlanConfig.rate_mode,
        help="compress: replay the trace faster (time shrinks); replicate: keep the time axis and add "
        "independent copies of the trace's users (load patterns keep their duration)",
    )
    parser.add_argument(
        "--rate-curve",
        help="a t_s,rate_rps CSV (hourly or finer; `pdctl trace curve` writes one): the load over time, "
        "with --trace as the source of request lengths and within-minute burstiness; --rate-scale (or "
        "the search) multiplies the curve",
    )


def _add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """The fleet, the policies compared and how they start."""
    parser.add_argument("--startup-s", type=float, default=PlanConfig.startup_s, help="engine start-up delay")
    parser.add_argument(
        "--link-gbps", type=float, default=PlanConfig.link_gbps, help="P->D KV transfer bandwidth"
    )
    parser.add_argument("--router", choices=POLICIES, default=PlanConfig.router)
    parser.add_argument(
        "--policy",
        action="append",
        help="static:P:D, static-best, dynamo, dynamo-constant, dynamo-load (throughput + load-based), llmd "
        "(per-role HPA on queue and KV usage), oracle, pdcluster (no profile: learned online) or "
        "pdcluster-prior (the engines' profile as its prior) (repeatable; default: "
        + ", ".join(c.name for c in DEFAULT_POLICIES)
        + ")",
    )
    parser.add_argument(
        "--start",
        default=PlanConfig.start,
        help="split the dynamic policies start from: neutral (1:1, the minimum of each role), model (the "
        "capacity model's for the mean load), best (static-best's, chosen in hindsight) or P:D",
    )
    parser.add_argument(
        "--static-attains",
        type=float,
        default=PlanConfig.static_attains,
        help="the searched rate scale is where the best full-budget static split attains about this share",
    )
    parser.add_argument(
        "--equal-attainment",
        action="store_true",
        help="for each dynamic policy, find the smallest static fleet (any size, any split, in hindsight) "
        "that attains as much (static_at_equal_attainment in --json)",
    )


def _add_knob_arguments(parser: argparse.ArgumentParser) -> None:
    """The dynamic policies' settings."""
    parser.add_argument(
        "--interval", type=int, default=PolicyKnobs.interval_s, help="pdcluster: autoscaling.intervalSeconds"
    )
    parser.add_argument(
        "--window", type=int, default=PolicyKnobs.window_s, help="pdcluster: autoscaling.windowSeconds"
    )
    parser.add_argument("--scale-up-stabilization", type=int, default=PolicyKnobs.scale_up_stabilization_s)
    parser.add_argument(
        "--scale-down-stabilization", type=int, default=PolicyKnobs.scale_down_stabilization_s
    )
    parser.add_argument("--cooldown", type=int, default=PolicyKnobs.cooldown_s)
    parser.add_argument("--max-step", type=int, default=PolicyKnobs.max_step)
    parser.add_argument(
        "--tolerance", type=int, default=PolicyKnobs.tolerance_percent, help="pdcluster: tolerancePercent"
    )
    parser.add_argument(
        "--dynamo-interval",
        type=float,
        default=PolicyKnobs.dynamo_interval_s,
        help="dynamo: adjustment_interval",
    )


def _add_store_and_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store-gib",
        type=_sizes,
        help="comma-separated DRAM sizes of a Mooncake store (GiB): print how much each serves and saves, "
        "on one static split, instead of comparing policies",
    )
    parser.add_argument(
        "--store-ssd-gib", type=float, default=StoreSweep.ssd_gib, help="an SSD tier behind the DRAM one"
    )
    parser.add_argument(
        "--store-ssd-gbps", type=float, default=StoreSweep.ssd_gbps, help="what an engine loads from SSD at"
    )
    parser.add_argument(
        "--store-max-computed-tokens",
        type=int,
        default=StoreSweep.max_computed_tokens,
        help="the router sends a prompt straight to decode when at most this many tokens are not stored",
    )
    parser.add_argument("--seed", type=int, default=PlanConfig.seed, help="seed of the arrival jitter")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel simulations")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", help="write a PNG of replicas and latency over time (needs matplotlib)")


def _add_colocated_arguments(parser: argparse.ArgumentParser) -> None:
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
        default=ColocatedSweep.lengths,
        help="prompt lengths of the sweep (comma-separated tokens; default 1k to 128k)",
    )
    compare.add_argument(
        "--loads",
        type=_numbers,
        default=ColocatedSweep.loads,
        help="loads of the sweep: the share of the GPUs' time the prompts alone take (comma-separated)",
    )
    compare.add_argument(
        "--itl-targets",
        type=_numbers,
        help="more mean-ITL targets (ms, comma-separated) to search the sweep's goodput at, one line each "
        "in the plot's ratio panel",
    )
    compare.add_argument(
        "--output-tokens", type=int, default=ColocatedSweep.output_tokens, help="output length of the sweep"
    )
    compare.add_argument(
        "--requests", type=int, default=ColocatedSweep.requests, help="requests per sweep point, at least"
    )
    compare.add_argument(
        "--span-s",
        type=float,
        default=ColocatedSweep.span_s,
        help="seconds of arrivals per sweep point, at least",
    )
    compare.add_argument(
        "--csv", help="write the plotted data as CSV (and the fixed-load points to <name>-loads.csv)"
    )
    compare.add_argument(
        "--step-fixed",
        choices=("decode", "prefill"),
        default=ColocatedSweep.step_fixed,
        help="engine time of the fixed part of a step carrying prompt tokens, in both architectures: the "
        "profile's decode intercept (the rest of its prefill intercept is each request's latency on its "
        "way in) or its whole prefill intercept",
    )


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


def _start(text: str) -> Start:
    if text in ("neutral", "model", "best"):
        return text  # type: ignore[return-value]
    prefill, decode = text.split(":")
    return int(prefill), int(decode)


def plan_config(args: argparse.Namespace) -> PlanConfig:
    return PlanConfig(
        gpus=args.gpus,
        slo=SLO(args.slo_ttft_ms, args.slo_itl_ms, args.ttft_plus_prefill),
        trace=args.trace,
        trace_format=args.format,
        profile=args.profile,
        rate_scale=args.rate_scale,
        rate_mode=args.rate_mode,
        rate_curve=args.rate_curve,
        startup_s=args.startup_s,
        link_gbps=args.link_gbps,
        router=args.router,
        policies=tuple(map(parse_policy, args.policy)) if args.policy else DEFAULT_POLICIES,
        start=_start(args.start),
        static_attains=args.static_attains,
        equal_attainment=args.equal_attainment,
        knobs=PolicyKnobs(
            interval_s=args.interval,
            window_s=args.window,
            scale_up_stabilization_s=args.scale_up_stabilization,
            scale_down_stabilization_s=args.scale_down_stabilization,
            cooldown_s=args.cooldown,
            max_step=args.max_step,
            tolerance_percent=args.tolerance,
            dynamo_interval_s=args.dynamo_interval,
        ),
        store=StoreSweep(
            tuple(args.store_gib), args.store_ssd_gib, args.store_ssd_gbps, args.store_max_computed_tokens
        )
        if args.store_gib
        else None,
        seed=args.seed,
        jobs=args.jobs,
    )


def colocated_sweep(args: argparse.Namespace) -> ColocatedSweep:
    return ColocatedSweep(
        lengths=tuple(args.lengths),
        loads=tuple(args.loads),
        itl_targets=tuple(args.itl_targets or ()),
        output_tokens=args.output_tokens,
        requests=args.requests,
        span_s=args.span_s,
        step_fixed=args.step_fixed,
    )


def run(args: argparse.Namespace) -> int:
    say = (lambda _msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    if args.compare_colocated:
        return _run_colocated(args, say)
    if not args.trace:
        print("pdctl plan: --trace is required (or --compare-colocated for the sweep)", file=sys.stderr)
        return 2
    config = plan_config(args)
    if config.store is not None:
        return _run_store(config, args.json, say)
    try:
        evaluation = plan.evaluate(config, say)
    except (TraceError, OSError) as e:
        return _failed(e)
    if args.json:
        print(json.dumps(evaluation.report, indent=2))
    else:
        plan_report.print_table(evaluation.report)
    if args.plot:
        return plan_report.plot(args.plot, evaluation.results, evaluation.setup)
    return 0


def _failed(error: Exception) -> int:
    """A bad trace or file: its message, without a traceback."""
    print(f"pdctl plan: {error}", file=sys.stderr)
    return 2


def _run_store(config: PlanConfig, as_json: bool, say: plan.Say) -> int:
    try:
        curve = plan_store.store_sweep_curve(config, say)
    except (TraceError, OSError) as e:
        return _failed(e)
    if as_json:
        print(json.dumps(curve, indent=2))
    else:
        plan_store.print_store_curve(curve)
    return 0


def _run_colocated(args: argparse.Namespace, say: plan.Say) -> int:
    if args.rate_curve:
        print(
            "pdctl plan: --rate-curve applies to policies on a trace, not to --compare-colocated",
            file=sys.stderr,
        )
        return 2
    sweep = colocated_sweep(args)
    try:
        comparison = plan_colocated.compare_colocated(plan_config(args), sweep, say)
    except (TraceError, OSError) as e:
        return _failed(e)
    plan_colocated.print_comparison(comparison, args.json)
    if args.csv:
        for path in crossover.write_csv(args.csv, comparison.points, comparison.by_itl):
            say(f"wrote {path}")
    if args.plot and comparison.by_itl is not None:
        title = plan_colocated.plot_title(comparison, sweep)
        return crossover.plot(args.plot, comparison.by_itl, args.slo_itl_ms, title)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdctl plan", description=plan.__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
