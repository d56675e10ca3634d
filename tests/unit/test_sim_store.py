"""The Mooncake store in the fleet simulator: tiers, what a prompt finds, and the effect
on a simulated fleet against the same fleet without it."""

from __future__ import annotations

import random

import pytest

from pdcluster import perf
from pdcluster.sim.fleet import FleetConfig, simulate
from pdcluster.sim.policies import Static
from pdcluster.sim.tiered_store import Found, StoreConfig, TieredStore, reusable_fraction
from pdcluster.sim.trace import Trace


def test_a_prompt_finds_the_leading_run_and_hits_refresh_it() -> None:
    store = TieredStore(StoreConfig(dram_blocks=3))
    store.write((1, 2, 3))
    assert store.find((1, 2, 9, 3)) == Found(2, 0)  # the run stops at the first missing block
    store.write((4,))  # evicts the least recently used: 3 (1 and 2 were just hit)
    assert store.find((3,)) == Found(0, 0)
    assert store.find((1, 2, 4)) == Found(3, 0)


def test_dram_evicts_to_ssd_and_a_hit_promotes() -> None:
    store = TieredStore(StoreConfig(dram_blocks=2, ssd_blocks=2))
    store.write((1, 2, 3, 4))  # 1 and 2 went to SSD
    assert list(store.ssd) == [1, 2]
    assert store.find((1, 2)) == Found(2, 2)  # both from SSD, now back in DRAM
    assert list(store.dram) == [1, 2] and list(store.ssd) == [3, 4]
    store.write((5, 6, 7))  # SSD keeps its two most recent
    assert len(store.ssd) == 2 and 7 in store.dram


def test_ssd_blocks_load_slower() -> None:
    store = TieredStore(StoreConfig(dram_blocks=4, dram_gbps=200.0, ssd_gbps=25.0))
    block = 512 * 131072  # a 512-token block of an 8B model
    assert store.load_s(Found(2, 2), block) == pytest.approx(8 * store.load_s(Found(2, 0), block))


def test_the_reusable_share_counts_leading_runs_seen_before() -> None:
    blocks = [(1, 2), (1, 2, 3), (4, 2)]
    # 1024 tokens, then 1536 of which the first 1024 were seen, then 1024 of which none lead.
    assert reusable_fraction(blocks, 512, [1024, 1536, 1024]) == pytest.approx(1024 / 3584)
    # The last token is always computed: a prompt seen whole reuses all but its last block.
    assert reusable_fraction([(1, 2), (1, 2)], 512, [1024, 1024]) == pytest.approx(512 / 2048)


def _shared_prefix_trace(n: int = 300, rate: float = 4.0) -> Trace:
    """Requests sharing one of four long system prompts (12 blocks of 512) and a private
    question (two blocks)."""
    rng = random.Random(7)
    t, arrival, inputs, outputs, blocks = 0.0, [], [], [], []
    for i in range(n):
        t += rng.expovariate(rate)
        system = rng.randrange(4)
        arrival.append(t)
        inputs.append(14 * 512 - 100)
        outputs.append(64)
        blocks.append((*(system * 100 + k for k in range(12)), 10_000 + 2 * i, 10_001 + 2 * i))
    return Trace("shared-prefix", arrival, inputs, outputs, blocks)


def test_a_store_takes_prefill_work_and_ttft_off_the_same_fleet() -> None:
    trace = _shared_prefix_trace()
    profile = perf.load()
    fleet = FleetConfig(gpus=4, router="least-loaded")  # no engine-local prefix routing
    without = simulate(trace, profile, Static(2, 2), fleet)
    store = StoreConfig(dram_blocks=1000, max_computed_tokens=None)  # prefill loads, never bypassed
    loaded = simulate(trace, profile, Static(2, 2), FleetConfig(gpus=4, router="least-loaded", store=store))
    assert loaded.bypassed == 0 and loaded.store_tokens > 0
    assert loaded.prefill_gpu_seconds < without.prefill_gpu_seconds
    bypass = StoreConfig(dram_blocks=1000, max_computed_tokens=2048)
    skipped = simulate(trace, profile, Static(2, 2), FleetConfig(gpus=4, router="least-loaded", store=bypass))
    # After the first request of each system prompt, every request skips prefill.
    assert skipped.bypassed >= len(trace) - 8
    assert skipped.prefill_gpu_seconds < loaded.prefill_gpu_seconds
    assert all(skipped.finished) and all(without.finished)
    median = sorted(skipped.ttft_s)[len(trace) // 2]
    assert median < sorted(without.ttft_s)[len(trace) // 2]


def test_a_store_too_small_for_one_prompt_serves_nothing() -> None:
    trace = _shared_prefix_trace(n=60)
    tiny = StoreConfig(dram_blocks=1, max_computed_tokens=512)
    result = simulate(trace, perf.load(), Static(1, 1), FleetConfig(gpus=2, store=tiny))
    assert result.bypassed == 0
