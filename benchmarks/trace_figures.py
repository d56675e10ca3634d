#!/usr/bin/env python3
"""The figures behind pdcluster.sim.synthetic, measured on the public traces
(../shared/traces or $PDCLUSTER_TRACES), beside the same figures of the generated traces.

    .venv/bin/python benchmarks/trace_figures.py
"""

from __future__ import annotations

import numpy as np

from pdcluster import perf
from pdcluster.sim import synthetic
from pdcluster.sim.trace import Trace, load_trace

SOURCES = {
    "mooncake_conversation_trace.jsonl": synthetic.MOONCAKE_CONVERSATION,
    "AzureLLMInferenceTrace_conv_2023.csv": synthetic.AZURE_CONVERSATION,
}


def figures(trace: Trace) -> dict[str, float]:
    gaps = np.diff(trace.arrival_s)
    out: dict[str, float] = {"rate_rps": len(trace) / trace.span_s, "gap_cv": float(gaps.std() / gaps.mean())}
    for name, values in (("prompt", trace.input_tokens), ("answer", trace.output_tokens)):
        x = np.asarray(values)
        out |= {f"{name}_p50": float(np.median(x)), f"{name}_p90": float(np.percentile(x, 90)),
                f"{name}_mean": float(x.mean())}
    if any(trace.blocks):
        out |= prefix_figures(trace)
    return out


def prefix_figures(trace: Trace) -> dict[str, float]:
    """Continuing requests (more than the first block cached), their reused share, and the
    block reuse with an unbounded cache."""
    seen: set[int] = set()
    continuing, shares, reused, total = 0, [], 0, 0
    for blocks in trace.blocks:
        run = 0
        while run < len(blocks) and blocks[run] in seen:
            run += 1
        if run >= 2:
            continuing += 1
            shares.append(run / len(blocks))
        reused += sum(1 for h in blocks if h in seen)
        total += len(blocks)
        seen.update(blocks)
    return {"continue_share": continuing / len(trace), "reused_share_mean": float(np.mean(shares)),
            "block_reuse": reused / total}


def main() -> None:
    folder = perf.traces_dir()
    for file, shape in SOURCES.items():
        real = figures(load_trace(folder / file))
        generated = figures(synthetic.generate(shape, 3600.0, seed=0))
        print(f"{file} (measured) vs pdcluster.sim.synthetic.{shape.name} (generated, one hour):")
        for key, value in real.items():
            print(f"  {key:18} {value:12.3f} {generated.get(key, float('nan')):12.3f}")


if __name__ == "__main__":
    main()
