"""vLLM's KV events as the router reads them, and the precise-prefix policy on them."""

from __future__ import annotations

import msgpack
import pytest

from pdcluster.router.kvevents import BatchOrder, block_id, decode_batch
from pdcluster.router.policy import Backend, ExactBlocks, KvIndex, PreciseCache, make_policy
from pdcluster.vllm.hashing import block_keys, engine_block_hashes

DIGEST = bytes(range(32))


def stored(*hashes: bytes | int, medium: str | None = "GPU") -> dict:
    # vLLM 0.32's BlockStored as msgspec encodes it: a map tagged "type", every field.
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
            "token_ids": [1] * 16, "block_size": 16, "lora_id": None, "medium": medium, "lora_name": None}  # fmt: skip


def removed(*hashes: bytes | int, medium: str | None = "GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def batch(*events: object) -> bytes:
    return msgpack.packb([1.5, list(events), 0])


def test_a_block_is_named_by_the_low_64_bits_of_its_digest_as_vllm_sends_it_as_an_int() -> None:
    # vllm/v1/core/kv_cache_utils.py maybe_convert_block_hash, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
    as_int = int.from_bytes(DIGEST, "big") & ((1 << 64) - 1)
    assert block_id(DIGEST) == block_id(as_int) == as_int == int.from_bytes(DIGEST[-8:], "big")


def test_tagged_maps_and_the_older_arrays_decode_alike() -> None:
    maps = decode_batch(batch(stored(DIGEST), removed(DIGEST, medium="CPU"), {"type": "AllBlocksCleared"}))
    arrays = decode_batch(
        batch(
            ["BlockStored", [DIGEST], None, [1] * 16, 16, None, "GPU"],
            ["BlockRemoved", [DIGEST], "CPU"],
            ["AllBlocksCleared"],
        )
    )
    assert (
        maps
        == arrays
        == [
            ("BlockStored", [block_id(DIGEST)], "GPU"),
            ("BlockRemoved", [block_id(DIGEST)], "CPU"),
            ("AllBlocksCleared", [], None),
        ]
    )


def test_unknown_kinds_are_skipped_and_garbage_is_refused() -> None:
    assert decode_batch(batch({"type": "SomethingNew", "x": 1}, stored(7))) == [("BlockStored", [7], "GPU")]
    for payload in (b"\xc1", msgpack.packb({"ts": 1}), batch(stored("not bytes")), batch(42)):
        with pytest.raises(ValueError):
            decode_batch(payload)


def test_batch_order_tells_first_next_gap_and_replayed_batches() -> None:
    order = BatchOrder()
    assert [order.see(s) for s in (4, 5, 6)] == ["first", "next", "next"]
    assert order.see(9) == "gap" and order.expected == 7  # the caller fills 7 and 8, or resets
    assert [order.see(s) for s in (7, 8, 9, 3)] == ["next", "next", "next", "old"]
    order.reset()
    assert order.see(0) == "first"


def test_the_index_follows_stores_removals_per_medium_and_clears() -> None:
    index = KvIndex()
    assert not index.live("a")
    index.batch("a", [("BlockStored", [1, 2, 3], "GPU"), ("BlockStored", [2], "CPU")])
    assert index.live("a") and index.blocks("a") == 3
    assert index.matched_blocks("a", [1, 2, 3, 4]) == 3
    # Block 2 leaves the GPU but stays offloaded on CPU; block 1 is gone, so nothing matches.
    index.batch("a", [("BlockRemoved", [1, 2], "GPU")])
    assert index.matched_blocks("a", [2, 3]) == 2 and index.matched_blocks("a", [1, 2]) == 0
    index.batch("a", [("BlockRemoved", [2], "CPU"), ("BlockRemoved", [99], None)])
    assert index.blocks("a") == 1
    index.batch("a", [("AllBlocksCleared", [], None)])
    assert index.blocks("a") == 0 and index.live("a")
    index.reset("a")
    assert not index.live("a")


def test_precise_routes_by_the_events_and_guesses_where_there_are_none() -> None:
    policy = make_policy("precise-prefix", block_tokens=64)
    assert isinstance(policy, PreciseCache) and policy.needs_exact_blocks
    a, b = Backend("a", "prefill"), Backend("b", "prefill")
    exact = ExactBlocks(16, [10, 11, 12, 13])
    # The guess says `a` has this prompt (it was sent there), but a's events say `b` holds it.
    policy.record("a", [1, 2])
    policy.index.batch("a", [])
    policy.index.batch("b", [("BlockStored", [10, 11, 12], "GPU")])
    assert policy.pick([a, b], 128, [1, 2], exact) is b
    assert policy.uncached("b", 128, [1, 2], exact) == 128 - 3 * 16
    # Without exact hashes (the engine's /tokenize did not answer) it is the guess again,
    # as it is for an engine whose events are not live.
    assert policy.pick([a, b], 128, [1, 2], None) is a
    policy.index.reset("a")
    assert policy.uncached("a", 128, [1, 2], exact) == 0
    # An engine that leaves or restarts: both what was guessed and what was heard go.
    policy.forget("b")
    assert not policy.index.live("b") and policy.index.blocks("b") == 0


def test_precise_breaks_a_tie_of_the_events_with_the_guess() -> None:
    policy = PreciseCache(64)
    a, b = Backend("a", "prefill"), Backend("b", "prefill")
    for engine in ("a", "b"):
        policy.index.batch(engine, [])  # live, and neither holds the prompt any more
    policy.record("b", [1, 2])  # but the conversation went to b before
    exact = ExactBlocks(16, [10, 11])
    # Whichever of the two is the least loaded's turn, the conversation keeps to b.
    assert [policy.pick([a, b], 128, [1, 2], exact) for _ in range(4)] == [b] * 4
    # What the events say still comes first.
    policy.index.batch("a", [("BlockStored", [10, 11], "GPU")])
    assert policy.pick([a, b], 128, [1, 2], exact) is a


def test_precise_still_bounds_imbalance() -> None:
    policy = PreciseCache(64, max_imbalance_tokens=100)
    busy, idle = Backend("busy", "prefill", 1, 500), Backend("idle", "prefill")
    for engine in ("busy", "idle"):
        policy.index.batch(engine, [])
    policy.index.batch("busy", [("BlockStored", [1, 2, 3, 4], "GPU")])
    assert policy.pick([busy, idle], 64, (), ExactBlocks(16, [1, 2, 3, 4])) is idle


def test_the_router_hashes_blocks_as_the_store_keys_them() -> None:
    tokens = list(range(40))
    hashes = engine_block_hashes(tokens, 16, "0")
    assert len(hashes) == 2 and all(len(h) == 32 for h in hashes)  # only full blocks
    keys = block_keys(tokens, 16, "model", "0")
    assert [k.rsplit("@", 1)[1] for k in keys] == [h.hex() for h in hashes]
    # The hash of block 2 covers block 1: a changed first token changes both.
    other = engine_block_hashes([99, *tokens[1:]], 16, "0")
    assert other[0] != hashes[0] and other[1] != hashes[1]
    assert engine_block_hashes(tokens, 16, None) != hashes  # the seed matters
