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
static-best without a store) with a Mooncake store of each DRAM size (sim/store.py):
how much of the prompts the store serves, the prefill GPU-seconds it saves against the
trace's reusable share, and the TTFT it buys.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

from pdcluster import observability as obs
from pdcluster import perf
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.control import models
from pdcluster.router.policy import POLICIES
from pdcluster.sim import crossover, longload
from pdcluster.sim.dynamo import Dynamo, DynamoLoad
from pdcluster.sim.fleet import FleetConfig, Result, simulate
from pdcluster.sim.llmd import LLMD
from pdcluster.sim.oracle import Oracle
from pdcluster.sim.policies import PDCluster, Static
from pdcluster.sim.scoring import SLO, Score, band, score
from pdcluster.sim.store import StoreConfig, reusable_fraction
from pdcluster.sim.trace import Trace, TraceError, load_trace

DEFAULT_POLICIES = ("static-best", "dynamo", "pdcluster")


# ------------------------------------------------------------------------- setup
@dataclass(frozen=True)
class Setup:
    trace: Trace  # already scaled
    profile: perf.Profile
    slo: SLO
    fleet: FleetConfig
    args: argparse.Namespace

    @property
    def targets_s(self) -> list[float]:
        return self.slo.ttft_targets_s(self.trace, self.profile)

    @property
    def engines(self) -> int:
        """Engines the cluster's GPUs hold (an engine takes the profile's GPUs)."""
        return self.fleet.gpus // self.fleet.gpus_per_engine


def spec_for(setup: Setup, start: tuple[int, int], prior: bool = False) -> PDClusterSpec:
    a = setup.args
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
                "intervalSeconds": a.interval,
                "windowSeconds": a.window,
                "scaleUpStabilizationSeconds": a.scale_up_stabilization,
                "scaleDownStabilizationSeconds": a.scale_down_stabilization,
                "cooldownSeconds": a.cooldown,
                "maxStep": a.max_step,
                "tolerancePercent": a.tolerance,
            },
        }
    )


def size_for(
    profile: perf.Profile, slo: SLO, rate: float, lengths: list[int], outputs: list[int], engines: int
) -> tuple[int, int]:
    """The split the capacity models give for a load (no observations), within `engines`."""
    isl = sum(lengths) / len(lengths)
    osl = sum(outputs) / len(outputs)
    # The prompt-length histogram vLLM would export of this load (the convex prefill cost).
    bounds = obs.vllm_request_token_buckets(1 << 20)
    counts = [0] * (len(bounds) + 1)
    for n in lengths:
        counts[bisect.bisect_left(bounds, n)] += 1
    histogram = tuple(zip((*map(float, bounds), math.inf), map(float, counts), strict=True))
    prefill = models.calibrate_prefill(
        profile,
        rate=rate,
        input_tokens=isl,
        hit_ratio=0.0,
        quantile=0.9,
        engines=0,
        observed_ttft_ms=None,
        observed_wait_ms=None,
        lengths=histogram,
        own_prefill=not slo.plus_prefill,
    )
    ttft = slo.ttft_ms
    bound = prefill.fixed_ms + max(ttft - prefill.fixed_ms, 0.2 * ttft)
    limit = engines - 1
    busy = models.PREFILL_MAX_BUSY
    p = models.fewest_engines(prefill.ttft_ms, bound, limit, lambda k: prefill.load() <= busy * k) or limit
    decode = models.calibrate_decode(
        profile, rate=rate, input_tokens=isl, output_tokens=osl, engines=0, observed_itl_ms=None
    )
    d = models.fewest_engines(
        decode.itl_ms, slo.itl_ms, limit, lambda k: decode.kv_usage(k) <= models.KV_LIMIT
    )
    d = d or limit
    if p + d > engines:
        p = min(max(round(engines * p / (p + d)), 1), engines - 1)
        d = engines - p
    return p, d


def model_split(setup: Setup) -> tuple[int, int]:
    """The split the capacity models give for the trace's mean load (no observations)."""
    tr = setup.trace
    rate = len(tr) / max(tr.span_s, 1e-9)
    return size_for(setup.profile, setup.slo, rate, tr.input_tokens, tr.output_tokens, setup.engines)


def make_policy(name: str, setup: Setup, start: tuple[int, int] | None = None):
    if name.startswith("static:"):
        _, p, d = name.split(":")
        return Static(int(p), int(d))
    start = start or model_split(setup)
    if name == "pdcluster":  # as deployed by default: no profile, capacity learned online
        return PDCluster(spec_for(setup, start), None)
    if name == "pdcluster-prior":  # given the simulated engines' own profile as the prior
        return PDCluster(spec_for(setup, start, prior=True), setup.profile, name)
    if name == "oracle":
        return Oracle(
            setup.trace,
            lambda rate, lengths, outputs: size_for(
                setup.profile, setup.slo, rate, lengths, outputs, setup.engines
            ),
            setup.engines,
            setup.fleet.startup_s,
            float(setup.args.interval),
        )
    # The baselines get the engines' true profile where they need one, and the SLO.
    given = {
        "ttft_ms": setup.slo.ttft_ms,
        "itl_ms": setup.slo.itl_ms,
        "gpu_budget": setup.fleet.gpus,
        "start": start,
    }
    dynamo_interval = setup.args.dynamo_interval
    if name == "dynamo-load":  # throughput + load-based, Dynamo's advice for bursty traffic
        return DynamoLoad(setup.profile, **given, interval_s=dynamo_interval)
    if name == "llmd":
        return LLMD(setup.profile, **given, gpus_per_engine=setup.fleet.gpus_per_engine)
    if name in ("dynamo", "dynamo-constant"):
        predictor = "constant" if name == "dynamo-constant" else "arima"
        return Dynamo(setup.profile, **given, interval_s=dynamo_interval, predictor=predictor)
    raise ValueError(f"unknown policy {name!r}")


def _simulate(setup: Setup, start: tuple[int, int] | None, name: str) -> tuple[Score, Result]:
    policy = make_policy(name, setup, start)
    result = simulate(setup.trace, setup.profile, policy, setup.fleet)
    scored = score(result, setup.trace, setup.targets_s, setup.slo.itl_ms)
    if isinstance(policy, Static):
        scored = replace(scored, split=policy.split)
    return scored, result


# A pool worker's setup, given once by its initializer (forked, not pickled per task).
_WORKER_INPUTS: tuple[Setup, tuple[int, int] | None] | None = None


def _init_worker(setup: Setup, start: tuple[int, int] | None) -> None:
    global _WORKER_INPUTS
    _WORKER_INPUTS = (setup, start)


def _simulate_in_worker(name: str) -> tuple[Score, Result]:
    assert _WORKER_INPUTS is not None
    return _simulate(*_WORKER_INPUTS, name)


def run_many(
    setup: Setup, names: list[str], jobs: int, start: tuple[int, int] | None = None
) -> list[tuple[Score, Result]]:
    if jobs <= 1 or len(names) <= 1:  # a pool of none or one is only overhead (and none is an error)
        return [_simulate(setup, start, n) for n in names]
    with ProcessPoolExecutor(
        min(jobs, len(names)),
        mp_context=get_context("fork"),
        initializer=_init_worker,
        initargs=(setup, start),
    ) as pool:
        return list(pool.map(_simulate_in_worker, names))


def static_best(setup: Setup, jobs: int, exhaustive: bool) -> tuple[Score, Result, list[Score]]:
    """The best split in hindsight: every split, or a hill climb from the model's split."""
    n = setup.engines
    splits = [f"static:{p}:{n - p}" for p in range(1, n)]
    if exhaustive:
        runs = run_many(setup, splits, jobs)
    else:
        seen: dict[int, tuple[Score, Result]] = {}
        p = model_split(setup)[0]
        while True:
            todo = [q for q in (p - 1, p, p + 1) if 1 <= q < n and q not in seen]
            for q, run in zip(
                todo, run_many(setup, [f"static:{q}:{n - q}" for q in todo], jobs), strict=True
            ):
                seen[q] = run
            best = max(seen, key=lambda q: (seen[q][0].attainment, -abs(q - p)))
            if best == p:
                break
            p = best
        runs = [seen[q] for q in sorted(seen)]
    best_score, best_result = max(runs, key=lambda r: r[0].attainment)
    p, d = best_score.split
    named = replace(best_score, policy=f"static-best ({p}:{d})")
    return named, best_result, [r[0] for r in runs]


def smallest_static(
    setup: Setup, attainment: float, jobs: int, cache: dict[tuple[int, int], Score]
) -> Score | None:
    """The smallest static fleet (fewest engines, the best split of them, in hindsight)
    that attains at least `attainment`; None if the whole budget cannot. Attainment
    grows with engines, so the size is bisected; each size's split is hill-climbed
    from the capacity model's proportion. `cache` keeps every simulated split."""

    def run(splits: list[tuple[int, int]]) -> None:
        todo = [sp for sp in splits if sp not in cache]
        for sp, (sc, _) in zip(
            todo, run_many(setup, [f"static:{p}:{d}" for p, d in todo], jobs), strict=True
        ):
            cache[sp] = sc

    mp, md = model_split(setup)

    def best_of(total: int) -> Score:
        p = min(max(round(total * mp / (mp + md)), 1), total - 1)
        while True:
            around = [(q, total - q) for q in (p - 1, p, p + 1) if 1 <= q < total]
            run(around)
            q = max((sp[0] for sp in around), key=lambda q: (cache[(q, total - q)].attainment, -abs(q - p)))
            if q == p:
                return cache[(p, total - p)]
            p = q

    low, high = 2, setup.engines
    if best_of(high).attainment < attainment:
        return None
    while low < high:
        middle = (low + high) // 2
        if best_of(middle).attainment >= attainment:
            high = middle
        else:
            low = middle + 1
    return best_of(low)


def find_rate_scale(base: Trace, make_setup, jobs: int, log, target: float = 0.9) -> float:
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


# ------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:

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
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival jitter")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel simulations")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", help="write a PNG of replicas and latency over time (needs matplotlib)")
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
    report = _report(setup, scale, searched, scores, results, start)
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


def store_curve(setup: Setup, split: tuple[int, int]) -> dict:
    """The trace on `split` without a store, then with one of each `--store-gib` size."""
    args, trace, profile = setup.args, setup.trace, setup.profile
    block_bytes = trace.block_tokens * profile.kv_bytes_per_token
    prompt_tokens = sum(trace.input_tokens)
    reusable = reusable_fraction(trace.blocks, trace.block_tokens, trace.input_tokens)
    rows, base = [], None
    for gib in (0.0, *args.store_gib):
        store = None
        if gib:
            store = StoreConfig(
                dram_blocks=max(int(gib * 2**30 // block_bytes), 1),
                ssd_blocks=int(args.store_ssd_gib * 2**30 // block_bytes),
                dram_gbps=setup.fleet.link_gbps,
                ssd_gbps=args.store_ssd_gbps,
                max_computed_tokens=args.store_max_computed_tokens,
            )
        result = simulate(trace, profile, Static(*split), replace(setup.fleet, store=store))
        sc = score(result, trace, setup.targets_s, setup.slo.itl_ms)
        ttfts = [t for t, done in zip(result.ttft_s, result.finished, strict=True) if done]
        base = base or result
        saved = (
            1.0 - result.prefill_gpu_seconds / base.prefill_gpu_seconds if base.prefill_gpu_seconds else 0.0
        )
        rows.append(
            {
                "dram_gib": gib,
                "served_from_store": round(result.store_tokens / prompt_tokens, 4),
                "reused_of_reusable": round(result.reused_tokens / prompt_tokens / reusable, 4)
                if reusable
                else None,
                "bypassed": round(result.bypassed / len(trace), 4),
                "prefill_gpu_seconds": round(result.prefill_gpu_seconds, 1),
                "prefill_saved": round(saved, 4),
                "saved_of_reusable": round(saved / reusable, 4) if reusable else None,
                "ttft_p50_ms": round(perf.percentile(ttfts, 50) * 1000.0, 1),
                "ttft_p90_ms": round(sc.ttft_p90_ms, 1),
                "attainment": round(sc.attainment, 4),
            }
        )
    return {
        "trace": trace.name,
        "requests": len(trace),
        "split": f"{split[0]}:{split[1]}",
        "reusable": round(reusable, 4),
        "ssd_gib": args.store_ssd_gib,
        "max_computed_tokens": args.store_max_computed_tokens,
        "rows": rows,
    }


def print_store_curve(curve: dict) -> None:
    print(
        f"{curve['trace']}: {curve['requests']} requests on {curve['split']} (prefill:decode); "
        f"{curve['reusable']:.1%} of prompt tokens reusable; SSD tier {curve['ssd_gib']:g} GiB; "
        f"straight to decode within {curve['max_computed_tokens']} computed tokens"
    )
    head = (
        "DRAM GiB", "from store", "reused/reusable", "bypassed", "prefill GPU-s", "saved", "saved/reusable",
        "TTFT p50", "TTFT p90",
    )  # fmt: skip
    print("".join(f"{h:>16}" for h in head))

    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    for r in curve["rows"]:
        print(
            f"{r['dram_gib']:>16g}{r['served_from_store']:>16.1%}{share(r['reused_of_reusable']):>16}"
            f"{r['bypassed']:>16.1%}{r['prefill_gpu_seconds']:>16.0f}{r['prefill_saved']:>16.1%}"
            f"{share(r['saved_of_reusable']):>16}{r['ttft_p50_ms']:>14.0f}ms{r['ttft_p90_ms']:>14.0f}ms"
        )


def run(args: argparse.Namespace) -> int:
    say = (lambda _msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr))
    if args.compare_colocated:
        if args.rate_curve:
            print("pdctl plan: --rate-curve applies to policies on a trace, not to --compare-colocated", file=sys.stderr)
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
        return _plot(args.plot, results, setup)
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
    if args.trace:
        try:
            base = load_trace(args.trace, args.format, seed=args.seed)
            if args.rate_scale is None:

                def make_setup(scale: float) -> Setup:
                    return Setup(base.scaled(scale), profile, slo, _fleet_config(args, profile), args)

                args.rate_scale = find_rate_scale(base, make_setup, args.jobs, say, args.static_attains)
        except (TraceError, OSError) as e:
            print(f"pdctl plan: {e}", file=sys.stderr)
            return 2
        cases = [(0, args.rate_scale, base.scaled(args.rate_scale))]
    else:
        workload = crossover.Workload(args.output_tokens, args.requests, args.span_s, args.seed)
        cases = crossover.sweep_cases(setting, args.lengths, args.loads, workload)
    points = crossover.compare(setting, cases, args.jobs, say)
    report: dict = {"points": [p.row() for p in points]}
    by_itl = None  # ITL target -> goodput at 90% per prompt length: the sweep's
    if args.trace:
        report["recommended_mode"] = crossover.recommend(points[0])
    else:
        by_itl = {}
        for itl in sorted({args.slo_itl_ms, *(args.itl_targets or [])}):
            say(f"searching each prompt length's goodput at 90% attainment, ITL target {itl:g} ms ...")
            at = replace(setting, slo=replace(slo, itl_ms=itl))
            by_itl[itl] = crossover.capacities(at, args.lengths, workload, args.jobs)
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


def _report(
    setup: Setup,
    scale: float,
    searched: bool,
    scores: list[Score],
    results: dict[str, Result],
    start: tuple[int, int],
) -> dict:
    trace = setup.trace
    report: dict = {
        "trace": trace.name,
        "requests": len(trace),
        "span_s": round(trace.span_s, 1),
        "rate_scale": round(scale, 3),
        "rate_mode": "curve" if setup.args.rate_curve else setup.args.rate_mode,
        "rate_scale_searched": searched,
        "profile": setup.profile.name,
        "gpus": setup.fleet.gpus,
        "slo": {
            "ttft_ms": setup.slo.ttft_ms,
            "itl_ms": setup.slo.itl_ms,
            "ttft_plus_prefill": setup.slo.plus_prefill,
        },
        "dynamic_start": f"{start[0]}:{start[1]}",
        "policies": {s.policy: s.as_dict() for s in scores},
    }
    best = next((s for s in scores if s.policy.startswith("static-best")), None)
    ours = next((s for s in scores if s.policy == "pdcluster"), None)
    lines = []
    if best is not None:
        lines.append(
            f"Static: deploy {best.split[0]}:{best.split[1]} (prefill:decode); it meets the SLO for "
            f"{best.attainment:.1%} of requests at {scale:.2f}x the trace's rate."
        )
    if ours is not None:
        timeline = results["pdcluster"].timeline
        p, d = _time_weighted_split(timeline, results["pdcluster"].end_s)
        lines.append(
            f"Autoscaled: start at {start[0]}:{start[1]} with autoscaling.gpuBudget {setup.fleet.gpus}; "
            f"pdcluster held {p:.1f}:{d:.1f} on average and met the SLO for {ours.attainment:.1%} "
            f"with {ours.gpu_hours:.2f} GPU-hours"
            + (f" ({ours.gpu_hours / best.gpu_hours:.0%} of static-best's)." if best else ".")
        )
    report["recommendation"] = " ".join(lines)
    return report


def _time_weighted_split(timeline, end_s: float) -> tuple[float, float]:
    total_p = total_d = 0.0
    for (t, p, d, *_), nxt in zip(timeline, [*timeline[1:], (end_s,)], strict=True):
        total_p += p * (nxt[0] - t)
        total_d += d * (nxt[0] - t)
    span = max(end_s - timeline[0][0], 1e-9)
    return total_p / span, total_d / span


def print_table(report: dict) -> None:
    slo = report["slo"]
    ttft = f"TTFT <= {slo['ttft_ms']:.0f} ms" + (" + isolated prefill" if slo["ttft_plus_prefill"] else "")
    print(
        f"{report['trace']}: {report['requests']} requests over {report['span_s']:.0f} s "
        f"(rate x{report['rate_scale']} by {report['rate_mode']}{', searched' if report['rate_scale_searched'] else ''}), "
        f"{report['gpus']} GPUs, {report['profile']}, SLO {ttft} and mean ITL <= {slo['itl_ms']:.0f} ms"
    )
    head = ("policy", "attain", "goodput/s", "GPU-h", "good/GPU-h", "TTFT p90", "ITL p90", "decisions")
    equal = any("static_at_equal_attainment" in s for s in report["policies"].values())
    print(
        f"{head[0]:<24}"
        + "".join(f"{h:>11}" for h in head[1:])
        + ("  static at equal attainment" if equal else "")
    )
    for name, s in report["policies"].items():
        line = (
            f"{name:<24}{s['attainment']:>11.1%}{s['goodput_rps']:>11.2f}{s['gpu_hours']:>11.2f}"
            f"{s['goodput_per_gpu_hour']:>11.0f}{s['ttft_p90_ms']:>9.0f}ms{s['itl_p90_ms']:>9.1f}ms{s['decisions']:>11}"
        )
        if "static_at_equal_attainment" in s:
            match = s["static_at_equal_attainment"]
            line += (
                "  none within the budget"
                if match is None
                else (
                    f"  {match['split']}: {match['gpu_hours']:.2f} GPU-h ({s['gpu_hours'] / match['gpu_hours']:.0%})"
                )
            )
        print(line)
    print(report["recommendation"])


def _plot(path: str, results: dict[str, Result], setup: Setup) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install 'pdcluster-operator[plot]')", file=sys.stderr)
        return 2
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, result in results.items():
        times = [row[0] for row in result.timeline] + [result.end_s]
        prefill = [row[1] for row in result.timeline]
        decode = [row[2] for row in result.timeline]
        line = top.step(times[:-1], prefill, where="post", label=f"{name} prefill")[0]
        top.step(
            times[:-1], decode, where="post", linestyle="--", color=line.get_color(), label=f"{name} decode"
        )
        bins = _ttft_p90_over_time(result, setup.trace)
        bottom.plot([b[0] for b in bins], [b[1] for b in bins], color=line.get_color(), label=name)
    top.set_ylabel("ready engines")
    top.legend(fontsize=7, ncol=2)
    bottom.set_ylabel("TTFT p90 per 30 s (ms)")
    bottom.set_yscale("log")
    bottom.set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(Path(path), dpi=110)
    return 0


def _ttft_p90_over_time(result: Result, trace: Trace, width: float = 30.0) -> list[tuple[float, float]]:
    buckets: dict[int, list[float]] = {}
    for i, t in enumerate(trace.arrival_s):
        if result.finished[i]:
            buckets.setdefault(int(t // width), []).append(result.ttft_s[i] * 1000.0)
    return [(k * width, perf.percentile(v, 90)) for k, v in sorted(buckets.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdctl plan", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
