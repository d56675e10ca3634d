"""The Mooncake store in the fleet simulator: what each size serves and saves, on the
same fleet with and without it.

    .venv/bin/python benchmarks/store_bench.py [--gpus 8] [--split 4:4] [--json results.json]

Each run is `pdctl plan --store-gib` (pdcluster.sim.plan_store.store_curve) on one static split
of simulated H200s (Llama-3.1-8B profile: 128 KiB of KV per token, so a 512-token block
is 64 MiB), at the trace's own rate, for the Mooncake conversation and synthetic traces
(512-token hash_ids), with the prefix-aware router (which already keeps a conversation
on one prefill engine's own cache) and the least-loaded one (which does not). Rows: no
store, DRAM tiers of several sizes, and a small DRAM tier with an SSD tier behind it.
The policy under test is the store; the fleet and its split are the same in every row,
so nothing starts from an answer.

Columns: the share of prompt tokens loaded from the store; tokens not computed (an
engine's own cache or the store) over the trace's reusable tokens (leading blocks an
earlier prompt had); requests that skipped prefill; prefill GPU-seconds and their saving
against the no-store row, also over the reusable share; TTFT p50 and p90.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdcluster.sim import plan_store
from pdcluster.sim.plan_config import PlanConfig, StoreSweep
from pdcluster.sim.plan_policies import PolicyChoice
from pdcluster.sim.scoring import SLO

TRACES = {"conversation": "mooncake_conversation_trace.jsonl", "synthetic": "mooncake_synthetic_trace.jsonl"}
DRAM_GIB = (512.0, 2048.0, 8192.0)
TIERED = ((512.0,), 8192.0)  # DRAM GiB, SSD GiB


def traces_dir() -> Path:
    here = Path(__file__).resolve().parents[1]
    return here.parent / "shared" / "traces"


def curve(
    trace: str, gpus: int, split: tuple[int, int], router: str, dram: tuple[float, ...], ssd: float = 0.0
) -> dict:
    config = PlanConfig(
        gpus=gpus,
        slo=SLO(500.0, 25.0, plus_prefill=True),
        trace=str(traces_dir() / TRACES[trace]),
        rate_scale=1.0,
        router=router,
        policies=(PolicyChoice.static(*split),),
        store=StoreSweep(dram, ssd_gib=ssd),
    )
    return plan_store.store_sweep_curve(config)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--split", default="4:4")
    parser.add_argument("--json", help="also write every figure here")
    args = parser.parse_args()
    prefill, decode = args.split.split(":")
    split = (int(prefill), int(decode))
    results = []
    print("| trace | router | DRAM GiB | SSD GiB | from store | reused / reusable | bypassed | prefill GPU-s "
          "| saved | saved / reusable | TTFT p50 | TTFT p90 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for trace in TRACES:
        for router in ("prefix-aware", "least-loaded"):
            runs = [curve(trace, args.gpus, split, router, DRAM_GIB)]
            runs.append(curve(trace, args.gpus, split, router, *TIERED))
            for i, c in enumerate(runs):
                results.append({"router": router, **c})
                for r in c["rows"][1:] if i else c["rows"]:
                    ssd = c["ssd_gib"] if r["dram_gib"] else 0
                    print(
                        f"| {trace} ({c['reusable']:.1%} reusable) | {router} | {r['dram_gib']:g} | {ssd:g} "
                        f"| {r['served_from_store']:.1%} | {r['reused_of_reusable']:.0%} | {r['bypassed']:.1%} "
                        f"| {r['prefill_gpu_seconds']:.0f} | {r['prefill_saved']:.1%} "
                        f"| {r['saved_of_reusable']:.0%} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p90_ms']:.0f} ms |"
                    )
            sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
