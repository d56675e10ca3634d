"""The colocated pool's control law (control/pool.py) against static colocated fleets,
in the colocated fleet simulator (sim/colocated.py), without hindsight for the law.

    .venv/bin/python benchmarks/colocated_autoscaling.py [--replicate 6] [--max-engines 12]
    .venv/bin/python benchmarks/colocated_autoscaling.py --day azure-code-weekday --factor 0.047 --max-engines 5

The workload is the Azure conversation trace (2023; short prompts, where colocated
serving fits), its first 30 minutes with other users' copies added (`--replicate`,
`Trace.replicated`) and three times that load from minute 10 to 15 (`Trace.burst`), on
simulated H200s (Llama-3.1-8B profile), one engine per GPU, chunked prefill at vLLM's
default budget, a prefix-aware router, 60 s engine start-up. A request meets the SLO
with TTFT <= 500 ms and mean ITL <= 25 ms; attainment is the share that does.

- static k: k engines throughout, for every k up to `--max-engines` (the best of them is
  chosen in hindsight);
- pool law: the operator's law with a 15 s interval and a 60 s window, starting from 1
  engine (not from any static fleet's answer), bounded by `--max-engines`; once with its
  default step and cooldown (2 engines, 60 s), once with 8 engines and 15 s.

It prints each one's attainment and GPU-hours, and for the law the smallest static fleet
that attains as much (static at equal attainment) and the GPU-hours it saves against it.

`--day` runs a day scenario of sim/day.py instead (what plan_bench's day tables run for
the prefill:decode law, at the same rate factor and GPU budget): the first two hours are
warm-up, unscored and uncounted, the same for every fleet; the law runs with the
operator's defaults (30 s interval, 120 s window, maxStep 2, 60 s cooldown), from 1 engine,
and the static fleets' sizes are bisected for the smallest that attains as much
(`--no-static`: the law and its plan alone; a static fleet has no law, so its rows from
an earlier run stand).
"""

from __future__ import annotations

import argparse
import math
import time

from pdcluster import perf
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.sim import day, schedule, scoring
from pdcluster.sim.colocated import ColocatedConfig, simulate_colocated
from pdcluster.sim.fleet import Result
from pdcluster.sim.trace import Trace, load_trace

AZURE = "AzureLLMInferenceTrace_conv_2023.csv"
TTFT_S, ITL_S = 0.5, 0.025


def workload(replicate: float) -> Trace:
    base = load_trace(perf.traces_dir() / AZURE).window(0, 1800)
    return base.replicated(replicate, seed=1).burst(600, 300, 3.0)


def attainment(result: Result, trace: Trace) -> float:
    good = sum(
        done and t <= TTFT_S and (out <= 1 or i <= ITL_S)
        for done, t, i, out in zip(
            result.finished, result.ttft_s, result.itl_s, trace.output_tokens, strict=True
        )
    )
    return good / len(trace)


def law(max_engines: int, max_step: int, cooldown_s: int, fast: bool = True) -> PDClusterSpec:
    """The pool law's spec; `fast`: a 15 s interval and 60 s window (else the defaults)."""
    timing = {"intervalSeconds": 15, "windowSeconds": 60} if fast else {}
    return PDClusterSpec.model_validate(
        {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "mode": "colocated",
            "colocated": {"replicas": 1, "minReplicas": 1, "maxReplicas": max_engines},
            "autoscaling": {
                "enabled": True,
                "slo": {"ttftMs": int(TTFT_S * 1000), "itlMs": int(ITL_S * 1000), "quantile": "p90"},
                **timing,
                "maxStep": max_step,
                "cooldownSeconds": cooldown_s,
            },
        }
    )


def planned(trace: Trace, profile: perf.Profile, max_engines: int, window_s: float, attains: float) -> None:
    """B's bound: the day sized in hindsight window by window (sim/schedule.py), each
    window's requests alone on static pools of 1 to max_engines engines, the fewest
    engine-windows whose good requests reach `attains` of the scored day."""
    started = time.process_time()
    count = math.ceil(trace.arrival_s[-1] / window_s + 1e-9)
    every = [
        schedule.colocated_options(
            trace, profile, w * window_s, window_s, max_engines, TTFT_S, ITL_S * 1000.0
        )
        for w in range(count)
    ]
    made = schedule.plan_of(every, day.WARMUP_S, window_s, attains)
    scored = made.splits[math.ceil(day.WARMUP_S / window_s) :]
    hours = sum(p for p, _ in scored) * window_s / 3600.0
    print(
        f"| plan in hindsight, {window_s:g} s windows, for {attains:.2%} | {made.attainment:.2%} | {hours:.2f} | "
        f"{made.good / hours:,.0f} | {time.process_time() - started:.1f} |",
        flush=True,
    )
    print("    engines per window: " + " ".join(str(p) for p, _ in made.splits))


def one_day(
    name: str, factor: float, max_engines: int, plan_window_s: float | None = None, statics: bool = True
) -> None:
    """The pool law over a day scenario, and the smallest static colocated fleet (of up to
    max_engines) that attains as much, bisected (attainment grows with engines; a day of a
    large fleet makes every size a long run); scored after the warm-up (sim/scoring.py,
    as plan_bench scores its day runs). Without `statics`, the law (and its plan) alone."""
    profile = perf.load("h200-llama3.1-8b")
    trace = day.day_source(name, perf.traces_dir()).make(factor)
    targets = [TTFT_S] * len(trace)

    def scored(result: Result) -> scoring.Score:
        return scoring.score(result, trace, targets, ITL_S * 1000.0, day.WARMUP_S)

    def row(label: str, s: scoring.Score, cpu_s: float) -> None:
        print(
            f"| {label} | {s.attainment:.2%} | {s.gpu_hours:.2f} | {s.good / s.gpu_hours:,.0f} | {cpu_s:.1f} |",
            flush=True,
        )

    print(f"{name} x{factor}: {len(trace)} requests, colocated, up to {max_engines} engines")
    print(
        "\n| fleet | attainment | GPU-hours | good requests per GPU-hour | CPU s |\n|---|---:|---:|---:|---:|"
    )
    config = ColocatedConfig(engines=1, autoscaling=law(max_engines, 2, 60, fast=False), startup_s=60.0)
    started = time.process_time()
    law_score = scored(simulate_colocated(trace, profile, config))
    row("pool law from 1 engine, defaults", law_score, time.process_time() - started)
    if plan_window_s:
        planned(trace, profile, max_engines, plan_window_s, law_score.attainment)
    if not statics:
        print(f"\npool law: {law_score.decisions} scaling decisions")
        return
    runs: dict[int, scoring.Score] = {}

    def static(k: int) -> scoring.Score:
        if k not in runs:
            started = time.process_time()
            runs[k] = scored(simulate_colocated(trace, profile, ColocatedConfig(engines=k)))
            row(f"static {k}", runs[k], time.process_time() - started)
        return runs[k]

    low, high = 1, max_engines
    while low < high:
        middle = (low + high) // 2
        if static(middle).attainment >= law_score.attainment:
            high = middle
        else:
            low = middle + 1
    equal = static(low) if static(low).attainment >= law_score.attainment else None
    print(
        f"\npool law: {law_score.decisions} scaling decisions; "
        + (
            f"no static fleet of up to {max_engines} engines attains as much"
            if equal is None
            else f"static at equal attainment: static {low} ({equal.attainment:.2%}, {equal.gpu_hours:.2f} "
            f"GPU-hours), the law uses {law_score.gpu_hours / equal.gpu_hours:.0%} of its GPU-hours (target A: 75%)"
        )
    )


LAWS = (("defaults: maxStep 2, cooldown 60 s", 2, 60), ("maxStep 8, cooldown 15 s", 8, 15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicate", type=float, default=6.0, help="users' copies of the trace's load")
    parser.add_argument("--max-engines", type=int, default=12)
    parser.add_argument("--day", choices=day.DAY_SCENARIOS, help="a day scenario instead of the burst")
    parser.add_argument("--factor", type=float, help="--day: the rate factor (plan_bench prints a level's)")
    parser.add_argument(
        "--plan-window",
        type=float,
        help="--day: also the plan in hindsight with windows of this many seconds (B), at the law's attainment",
    )
    parser.add_argument(
        "--no-static",
        action="store_true",
        help="--day: the law (and its plan) alone; a static fleet has no law, so its rows from an earlier run stand",
    )
    args = parser.parse_args()
    if args.day:
        if args.factor is None:
            parser.error("--day needs --factor")
        one_day(args.day, args.factor, args.max_engines, args.plan_window, statics=not args.no_static)
        return
    trace = workload(args.replicate)
    profile = perf.load("h200-llama3.1-8b")
    print(
        f"{len(trace)} requests over {trace.span_s / 60:.0f} min, mean prompt "
        f"{sum(trace.input_tokens) / len(trace):.0f} tokens, mean output {sum(trace.output_tokens) / len(trace):.0f}"
    )
    rows: list[tuple[str, float, float]] = []
    for k in range(1, args.max_engines + 1):
        r = simulate_colocated(trace, profile, ColocatedConfig(engines=k))
        rows.append((f"static {k}", attainment(r, trace), r.gpu_seconds / 3600.0))
    laws = []
    for label, step, cooldown in LAWS:
        config = ColocatedConfig(engines=1, autoscaling=law(args.max_engines, step, cooldown), startup_s=60.0)
        dynamic = simulate_colocated(trace, profile, config)
        if not math.isfinite(dynamic.gpu_seconds):
            raise SystemExit("the simulation did not finish")
        laws.append((f"pool law from 1 engine, {label}", dynamic))
    print("\n| fleet | attainment | GPU-hours |\n|---|---:|---:|")
    for name, a, h in rows:
        print(f"| {name} | {100 * a:.1f}% | {h:.2f} |")
    for name, dynamic in laws:
        print(f"| {name} | {100 * attainment(dynamic, trace):.1f}% | {dynamic.gpu_seconds / 3600.0:.2f} |")
    print()
    for name, dynamic in laws:
        got, hours = attainment(dynamic, trace), dynamic.gpu_seconds / 3600.0
        peak = max(row[3] for row in dynamic.timeline)
        equal = next(((n, a, h) for n, a, h in rows if a >= got), None)
        versus = (
            f"no static fleet of up to {args.max_engines} engines attains as much"
            if equal is None
            else f"static at equal attainment: {equal[0]} ({100 * equal[1]:.1f}%, {equal[2]:.2f} GPU-hours), "
            f"the law uses {hours / equal[2]:.2f}x its GPU-hours"
        )
        print(f"{name}: {len(dynamic.decisions)} scaling decisions, peak {peak} engines; {versus}")
    enough = next(((n, a, h) for n, a, h in rows if a >= 0.9), None)
    if enough is not None:
        print(
            f"smallest static fleet attaining 90% (in hindsight): {enough[0]} ({100 * enough[1]:.1f}%, {enough[2]:.2f} GPU-hours)"
        )


if __name__ == "__main__":
    main()
