"""Precise against approximate prefix-aware routing in the fleet simulator: the prefix-cache
hit ratio and TTFT each gets on the same fleet and trace.

    .venv/bin/python benchmarks/precise_routing.py [--gpus 8] [--split 4:4] [--json results.json]

The Mooncake conversation trace at its own rate on a static split of simulated H200s
(Llama-3.1-8B profile; each prefill engine's prefix cache is an LRU of its KV capacity,
945k tokens, in the trace's 512-token blocks), with three routers that differ only in
what they know of those caches:
- least-loaded: nothing;
- prefix-aware: its own guess, an LRU of what it sent to each engine (65,536 blocks per
  engine, the router's default), which does not see evictions;
- precise-prefix: the engines' KV events, delivered without delay (what each cache
  stores and evicts), with the guess only for an engine before its first batch.
Every other setting is the same, and none of them starts from a measured answer.

Columns: prompt tokens served from an engine's cache over all prompt tokens (hit ratio),
the same over the trace's reusable tokens (leading blocks an earlier prompt had), prefill
GPU-seconds, and TTFT p50 and p90.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdcluster import perf
from pdcluster.sim import plan
from pdcluster.sim.plan_config import PlanConfig
from pdcluster.sim.plan_policies import PolicyChoice
from pdcluster.sim.scoring import SLO
from pdcluster.sim.tiered_store import reusable_fraction

ROUTERS = ("least-loaded", "prefix-aware", "precise-prefix")
TRACE = "mooncake_conversation_trace.jsonl"


def traces_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "shared" / "traces"


def run(gpus: int, split: tuple[int, int], router: str) -> dict:
    config = PlanConfig(
        gpus=gpus,
        slo=SLO(500.0, 25.0, plus_prefill=True),
        trace=str(traces_dir() / TRACE),
        rate_scale=1.0,
        router=router,
        policies=(PolicyChoice.static(*split),),
    )
    evaluation = plan.evaluate(config)
    trace, result = evaluation.setup.trace, next(iter(evaluation.results.values()))
    prompt = sum(trace.input_tokens)
    reusable = reusable_fraction(trace.blocks, trace.block_tokens, trace.input_tokens)
    ttfts = [t for t, done in zip(result.ttft_s, result.finished, strict=True) if done]
    return {
        "router": router,
        "hit_ratio": round(result.reused_tokens / prompt, 4),
        "of_reusable": round(result.reused_tokens / prompt / reusable, 4) if reusable else None,
        "prefill_gpu_seconds": round(result.prefill_gpu_seconds, 1),
        "ttft_p50_ms": round(perf.percentile(ttfts, 50) * 1000.0, 1),
        "ttft_p90_ms": round(perf.percentile(ttfts, 90) * 1000.0, 1),
        "finished": sum(result.finished),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--split", default="4:4")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not (traces_dir() / TRACE).exists():
        sys.exit(f"no trace at {traces_dir() / TRACE}")
    prefill, decode = args.split.split(":")
    rows = [run(args.gpus, (int(prefill), int(decode)), router) for router in ROUTERS]
    print(f"{TRACE}, {args.gpus} GPUs split {args.split} (prefill:decode)")
    print(
        f"{'router':<16}{'hit ratio':>10}{'of reusable':>13}{'prefill GPU-s':>15}{'TTFT p50':>10}{'TTFT p90':>10}"
    )
    for r in rows:
        print(
            f"{r['router']:<16}{r['hit_ratio']:>10.1%}{r['of_reusable']:>13.1%}{r['prefill_gpu_seconds']:>15.1f}"
            f"{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p90_ms']:>8.0f}ms"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
