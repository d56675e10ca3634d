"""The simulator's store connector: which prefix it loads, what it writes, and what the
engine then computes. The Mooncake client is an in-memory fake."""

from __future__ import annotations

import asyncio

from test_enginesim_engine import PROFILE, finish, make_core, sample

from pdcluster.enginesim.engine import Seq
from pdcluster.enginesim.store_connector import PrefixStore
from pdcluster.perf import Profile
from pdcluster.vllm.hashing import block_keys

BLOCK = 16


class FakeClient:
    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.evict_on_get: set[str] = set()
        self.up = True

    async def exist(self, keys: list[str]) -> list[int]:
        return [int(k in self.blobs) if self.up else -1 for k in keys]

    async def get_many(self, keys: list[str]) -> list[bytes]:
        for k in self.evict_on_get:
            self.blobs.pop(k, None)
        return [self.blobs.get(k, b"") for k in keys]

    async def put_many(self, keys: list[str], size: int) -> bool:
        self.blobs |= {k: b"\0" * size for k in keys}
        return True


def store(client: FakeClient, role: str, profile: Profile = PROFILE) -> PrefixStore:
    return PrefixStore(
        client,  # type: ignore[arg-type]
        role=role,
        model="org/sim-model",
        block_size=BLOCK,
        hash_seed="0",
        profile=profile,
        gbps=400.0,
        time_scale=1000.0,
    )


async def saved(s: PrefixStore) -> None:
    await asyncio.gather(*s._saving)


async def test_prefill_writes_full_blocks_and_decode_loads_the_leading_run() -> None:
    client = FakeClient()
    prefill, decode = store(client, "kv_both"), store(client, "kv_consumer")
    tokens = list(range(5 * BLOCK + 3))
    prefill.save(tokens)
    await saved(prefill)
    assert set(client.blobs) == set(block_keys(tokens, BLOCK, "sim-model", "0"))  # vLLM's keys, 5 blocks
    assert await decode.load(tokens) == 5 * BLOCK
    # A prompt of whole blocks, all stored: vLLM recomputes its last block (never loads the last token).
    assert await decode.load(tokens[: 5 * BLOCK]) == 4 * BLOCK
    assert await decode.load([7, *tokens[1:]]) == 0  # a different first block: nothing
    decode.save(tokens)  # a consumer writes nothing
    assert not decode._saving


async def test_a_block_evicted_between_lookup_and_load_ends_the_run() -> None:
    client = FakeClient()
    tokens = list(range(4 * BLOCK))
    keys = block_keys(tokens, BLOCK, "sim-model", "0")
    client.blobs = {k: b"x" for k in keys}
    client.evict_on_get = {keys[2]}
    assert await store(client, "kv_consumer").load(tokens) == 2 * BLOCK


async def test_a_master_that_cannot_answer_loads_nothing() -> None:
    client = FakeClient()
    tokens = list(range(4 * BLOCK))
    client.blobs = {k: b"x" for k in block_keys(tokens, BLOCK, "sim-model", "0")}
    client.up = False
    assert await store(client, "kv_both").load(tokens) == 0


async def test_the_engine_computes_only_what_the_store_did_not_hold() -> None:
    core, families = make_core()
    seq = Seq(1000, 2, stored=960)
    core.submit(seq)
    await finish(seq)
    assert sample(families, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 960
    assert sample(families, "vllm:prompt_tokens_by_source_total", source="local_compute") == 40
    assert sample(families, "vllm:prompt_tokens_total") == 1000
    await core.stop()
