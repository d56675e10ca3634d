"""`pdctl plan`'s report of an evaluation (sim/plan.py): the figures of each policy and
what to deploy, printed as a table; and a figure of replicas and latency over time."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pdcluster import perf
from pdcluster.sim.fleet import Result
from pdcluster.sim.plan_config import PlanConfig
from pdcluster.sim.plan_policies import PolicyChoice, PolicyKind
from pdcluster.sim.scoring import Score
from pdcluster.sim.trace import Trace

if TYPE_CHECKING:  # the planner builds its report here: no import back at run time
    from pdcluster.sim.plan import Setup


def build_report(
    setup: Setup,
    config: PlanConfig,
    scale: float,
    searched: bool,
    scores: list[Score],
    results: dict[str, Result],
    best: Score | None,
    start: tuple[int, int],
) -> dict:
    trace = setup.trace
    report: dict = {
        "trace": trace.name,
        "requests": len(trace),
        "span_s": round(trace.span_s, 1),
        "rate_scale": round(scale, 3),
        "rate_mode": "curve" if config.rate_curve else config.rate_mode,
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
    report["recommendation"] = recommendation(setup, scale, scores, results, best, start)
    return report


def recommendation(
    setup: Setup,
    scale: float,
    scores: list[Score],
    results: dict[str, Result],
    best: Score | None,
    start: tuple[int, int],
) -> str:
    """What to deploy: static-best's split, and pdcluster's start and what it held."""
    ours_name = PolicyChoice(PolicyKind.PDCLUSTER).name
    ours = next((s for s in scores if s.policy == ours_name), None)
    lines = []
    if best is not None:
        lines.append(
            f"Static: deploy {best.split[0]}:{best.split[1]} (prefill:decode); it meets the SLO for "
            f"{best.attainment:.1%} of requests at {scale:.2f}x the trace's rate."
        )
    if ours is not None:
        ours_result = results[ours_name]
        p, d = time_weighted_split(ours_result.timeline, ours_result.end_s)
        lines.append(
            f"Autoscaled: start at {start[0]}:{start[1]} with autoscaling.gpuBudget {setup.fleet.gpus}; "
            f"pdcluster held {p:.1f}:{d:.1f} on average and met the SLO for {ours.attainment:.1%} "
            f"with {ours.gpu_hours:.2f} GPU-hours"
            + (f" ({ours.gpu_hours / best.gpu_hours:.0%} of static-best's)." if best else ".")
        )
    return " ".join(lines)


def time_weighted_split(timeline: list, end_s: float) -> tuple[float, float]:
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
    width = max(24, *(len(name) + 2 for name in report["policies"]))
    print(
        f"{head[0]:<{width}}"
        + "".join(f"{h:>11}" for h in head[1:])
        + ("  static at equal attainment" if equal else "")
    )
    for name, s in report["policies"].items():
        line = (
            f"{name:<{width}}{s['attainment']:>11.1%}{s['goodput_rps']:>11.2f}{s['gpu_hours']:>11.2f}"
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


def plot(path: str, results: dict[str, Result], setup: Setup) -> int:
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
