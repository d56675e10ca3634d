"""Prompt hits in the Mooncake store: the keys vLLM writes, the prefix an engine would
load, and lookups against an engine and a master that answer from memory."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import orjson
import pytest

from pdcluster.router.store_hits import QUERY_KEYS, StoreIndex
from pdcluster.router.upstream import Origin, UpstreamError
from pdcluster.vllm.hashing import block_keys, loadable_tokens

# vLLM 0.32's own key for tokens 100..139 in blocks of 16 (PoolKey over hash_block_tokens,
# sha256, no PYTHONHASHSEED), read off a running engine's store connector.
VLLM_KEYS = [
    "Qwen2.5-0.5B-Instruct@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"
    "605fd9e311c0890137f4c7df65be59449fb378632eecf434d1ecdf87c874fd55",
    "Qwen2.5-0.5B-Instruct@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"
    "f1a08810157991d5280c49952540afc2feab260cd65a24bb2e94951059393917",
]
ENGINE = "http://127.0.0.1:8200"
MASTER = "http://127.0.0.1:9003"
BLOCK = 16


def test_the_keys_are_the_ones_vllm_writes() -> None:
    tokens = list(range(100, 140))  # two full blocks; the last 8 tokens are never stored
    assert block_keys(tokens, BLOCK, "Qwen2.5-0.5B-Instruct", None) == VLLM_KEYS
    # The chain: a prompt's keys start with its prefix's keys; the seed changes them all.
    assert block_keys(tokens[:16], BLOCK, "Qwen2.5-0.5B-Instruct", None) == VLLM_KEYS[:1]
    seeded = block_keys(tokens, BLOCK, "Qwen2.5-0.5B-Instruct", "0")
    assert not set(seeded) & set(VLLM_KEYS)
    assert block_keys(tokens[:15], BLOCK, "m", None) == []


@pytest.mark.parametrize(
    ("stored", "prompt", "loadable"),
    [
        ([True, True, True], 50, 48),
        ([True, False, True], 50, 16),  # the run stops at the first missing block
        ([False, True], 40, 0),
        ([True, True], 32, 16),  # the whole prompt stored: its last block is computed
        ([], 10, 0),
    ],
)
def test_an_engine_loads_the_leading_run_of_stored_blocks(
    stored: list[bool], prompt: int, loadable: int
) -> None:
    assert loadable_tokens(stored, BLOCK, prompt) == loadable


@dataclass
class Answer:
    status: int
    body: bytes

    async def read(self) -> bytes:
        return self.body

    def close(self) -> None:
        pass


@dataclass
class Fake:
    """An engine (/v1/models, /metrics, /tokenize) and a master (/batch_query_keys) in memory."""

    tokens: list[int]
    stored: set[str] = field(default_factory=set)
    hash_algo: str = "sha256"
    master_up: bool = True
    master_delay_s: float = 0.0
    leader: str | None = None  # HA: MASTER is a standby and this master leads
    calls: list[tuple[str, str, bytes]] = field(default_factory=list)

    async def request(
        self, origin: Origin, method: bytes, path: bytes, headers: bytes, body: bytes
    ) -> Answer:
        where = f"http://{origin.host}:{origin.port}"
        self.calls.append((where, path.decode(), body))
        route = path.decode().split("?")[0]
        if where == MASTER and self.leader:
            if route == "/leader":
                host = self.leader.removeprefix("http://").rsplit(":", 1)[0]
                return Answer(200, orjson.dumps({"present": True, "leader_address": f"{host}:50051"}))
            return Answer(503, b'{"success":false,"error_message":"service plane is not active"}')
        if where == (self.leader or MASTER):
            if not self.master_up:
                raise UpstreamError("cannot connect to 127.0.0.1:9003")
            await asyncio.sleep(self.master_delay_s)
            keys = path.decode().split("keys=", 1)[1].split(",")
            data = {
                k: {"ok": k in self.stored, "error": None if k in self.stored else "OBJECT_NOT_FOUND"}
                for k in keys
            }
            return Answer(200, orjson.dumps({"success": True, "data": data}))
        if route == "/v1/models":
            return Answer(200, orjson.dumps({"data": [{"id": "tiny", "root": "/models/tiny-llama"}]}))
        if route == "/metrics":
            info = f'vllm:cache_config_info{{block_size="{BLOCK}",engine="0",prefix_caching_hash_algo="{self.hash_algo}"}} 1.0'
            return Answer(200, f"# TYPE vllm:cache_config_info gauge\n{info}\n".encode())
        if route == "/tokenize":
            return Answer(200, orjson.dumps({"tokens": self.tokens, "count": len(self.tokens)}))
        return Answer(404, b"{}")

    def store_blocks(self, n: int) -> None:
        self.stored |= set(block_keys(self.tokens, BLOCK, "tiny-llama", "0")[:n])


def index(fake: Fake, max_computed: int = 20, timeout_s: float = 1.0) -> StoreIndex:
    return StoreIndex(fake, MASTER, hash_seed="0", max_computed_tokens=max_computed, timeout_s=timeout_s)  # type: ignore[arg-type]


BODY = {"model": "tiny", "prompt": "a system prompt and a question", "max_tokens": 8}


@pytest.mark.parametrize(
    ("stored_blocks", "outcome", "stored_tokens"),
    [(4, "hit", 64), (2, "partial", 32), (0, "miss", 0)],
    ids=["hit", "partial hit over the threshold", "miss"],
)
async def test_a_lookup_says_how_much_decode_would_load(
    stored_blocks: int, outcome: str, stored_tokens: int
) -> None:
    fake = Fake(tokens=list(range(70)))  # 4 full blocks and 6 tokens
    fake.store_blocks(stored_blocks)
    lookup = await index(fake).lookup(ENGINE, BODY, chat=False, estimate=70)
    assert (lookup.outcome, lookup.prompt_tokens, lookup.stored_tokens) == (outcome, 70, stored_tokens)
    query = next(path for where, path, _ in fake.calls if where == MASTER)
    assert "@tp_rank:0@" in query and "%40" not in query  # the master takes keys unescaped


async def test_the_engine_tokenizes_what_the_request_will_be() -> None:
    fake = Fake(tokens=list(range(40)))
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": False,
        "top_p": 0.5,
    }
    await index(fake).lookup(ENGINE, chat, chat=True, estimate=40)
    (body,) = [orjson.loads(b) for _, path, b in fake.calls if path == "/tokenize"]
    assert body == {"model": "tiny", "messages": chat["messages"], "add_generation_prompt": False}
    # Token ids in the request need no tokenizer.
    fake.calls.clear()
    await index(fake).lookup(ENGINE, {"model": "tiny", "prompt": list(range(40))}, chat=False, estimate=40)
    assert not [path for _, path, _ in fake.calls if path == "/tokenize"]


@pytest.mark.parametrize("fault", ["master down", "master slow", "xxhash engine", "cache_salt"])
async def test_a_store_that_cannot_answer_is_no_hit(fault: str) -> None:
    fake = Fake(tokens=list(range(70)))
    fake.store_blocks(4)
    body = dict(BODY)
    if fault == "master down":
        fake.master_up = False
    elif fault == "master slow":
        fake.master_delay_s = 0.5
    elif fault == "xxhash engine":
        fake.hash_algo = "xxhash"
    else:
        body["cache_salt"] = "tenant-a"
    lookup = await index(fake, timeout_s=0.1).lookup(ENGINE, body, chat=False, estimate=70)
    assert lookup.outcome in ("error", "unsupported") and lookup.stored_tokens == 0, lookup


async def test_a_prompt_under_a_block_costs_no_lookup_once_the_block_is_known() -> None:
    fake = Fake(tokens=list(range(70)))
    store = index(fake)
    await store.lookup(ENGINE, BODY, chat=False, estimate=70)
    fake.calls.clear()
    assert (await store.lookup(ENGINE, BODY, chat=False, estimate=4)).outcome == "short"
    assert fake.calls == []
    store.forget(ENGINE)  # a new engine behind the URL: its facts are read again
    await store.lookup(ENGINE, BODY, chat=False, estimate=70)
    assert [path for _, path, _ in fake.calls][:2] == ["/v1/models", "/metrics"]


async def test_a_standby_master_points_the_router_at_the_leader() -> None:
    fake = Fake(tokens=list(range(70)), leader="http://127.0.0.9:9003")
    fake.store_blocks(4)
    store = index(fake)
    assert (await store.lookup(ENGINE, BODY, chat=False, estimate=70)).outcome == "hit"
    fake.calls.clear()
    assert (await store.lookup(ENGINE, BODY, chat=False, estimate=70)).outcome == "hit"
    assert [where for where, path, _ in fake.calls if "batch_query_keys" in path] == [fake.leader]
    # The leader dies: that lookup misses, and the next one asks the Service again.
    fake.master_up = False
    assert (await store.lookup(ENGINE, BODY, chat=False, estimate=70)).outcome == "error"
    fake.master_up, fake.leader = True, "http://127.0.0.10:9003"
    fake.calls.clear()
    assert (await store.lookup(ENGINE, BODY, chat=False, estimate=70)).outcome == "hit"
    assert [where for where, path, _ in fake.calls if where != ENGINE] == [MASTER, MASTER, fake.leader]


async def test_long_prompts_ask_in_chunks_and_stop_at_the_first_missing_block() -> None:
    fake = Fake(tokens=list(range(BLOCK * 400)))
    fake.store_blocks(200)
    lookup = await index(fake, max_computed=BLOCK * 400).lookup(
        ENGINE, BODY, chat=False, estimate=BLOCK * 400
    )
    assert (lookup.outcome, lookup.stored_tokens) == ("hit", 200 * BLOCK)
    queries = [path for where, path, _ in fake.calls if where == MASTER]
    assert [q.count(",") + 1 for q in queries] == [QUERY_KEYS, QUERY_KEYS]  # not the other 144 keys
