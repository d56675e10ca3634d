"""`pdctl plan --store-gib`: the trace on one static split without a store, then with a
Mooncake store of each DRAM size (sim/tiered_store.py)."""

from __future__ import annotations

from dataclasses import replace

from pdcluster import perf
from pdcluster.sim.fleet import simulate
from pdcluster.sim.plan import Say, Setup, evaluate, quiet
from pdcluster.sim.plan_config import PlanConfig, StoreSweep
from pdcluster.sim.plan_policies import PolicyChoice, PolicyKind
from pdcluster.sim.policies import Static
from pdcluster.sim.scoring import score
from pdcluster.sim.tiered_store import StoreConfig, reusable_fraction


def store_sweep_curve(config: PlanConfig, say: Say = quiet) -> dict:
    """`config.store`'s curve on the first static split `config` names, else on static-best's."""
    assert config.store is not None
    static = tuple(c for c in config.policies if c.kind is PolicyKind.STATIC)[:1]
    one_split = replace(config, policies=static or (PolicyChoice(PolicyKind.STATIC_BEST),))
    evaluation = evaluate(one_split, say)
    split = evaluation.scores[0].split  # a static run's score carries its split
    assert split is not None
    return store_curve(evaluation.setup, split, config.store)


def store_curve(setup: Setup, split: tuple[int, int], sweep: StoreSweep) -> dict:
    """The trace on `split` without a store, then with one of each of `sweep`'s sizes."""
    trace, profile = setup.trace, setup.profile
    block_bytes = trace.block_tokens * profile.kv_bytes_per_token
    prompt_tokens = sum(trace.input_tokens)
    reusable = reusable_fraction(trace.blocks, trace.block_tokens, trace.input_tokens)
    rows, base = [], None
    for gib in (0.0, *sweep.dram_gib):
        store = None
        if gib:
            store = StoreConfig(
                dram_blocks=max(int(gib * 2**30 // block_bytes), 1),
                ssd_blocks=int(sweep.ssd_gib * 2**30 // block_bytes),
                dram_gbps=setup.fleet.link_gbps,
                ssd_gbps=sweep.ssd_gbps,
                max_computed_tokens=sweep.max_computed_tokens,
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
        "ssd_gib": sweep.ssd_gib,
        "max_computed_tokens": sweep.max_computed_tokens,
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
