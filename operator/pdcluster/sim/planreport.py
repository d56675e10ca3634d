"""What `pdctl plan` reports: the policies' scores with a recommendation, the table and
plot of them, and the store's curve (`--store-gib`)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from pdcluster import perf
from pdcluster.sim.fleet import Result, simulate
from pdcluster.sim.plansetup import Setup
from pdcluster.sim.policies import Static
from pdcluster.sim.scoring import Score, score
from pdcluster.sim.store import StoreConfig, reusable_fraction
from pdcluster.sim.trace import Trace


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


def report_for(
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
