"""Which prefix of a prompt the Mooncake store holds, exactly, so that a prompt whose
prefix is stored goes straight to a decode engine and skips prefill.

vLLM's MooncakeStoreConnector keys a block, in its default layout (both roles at one TP
size), as `{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{block hash hex}` for rank 0
(store/data.py: KeyMetadata and PoolKey). `model` is the last path component of the
engine's model (store/worker.py), which /v1/models reports as `root`. The block hash
is vLLM's prefix-cache hash: sha256 of the pickled (parent hash, block token ids, extra
keys), chained from sha256(pickle(PYTHONHASHSEED, or "vllm-none-hash" without one))
(v1/core/kv_cache_utils.py: hash_block_tokens, init_none_hash; utils/hashing.py:
sha256). Only full blocks are stored, and an engine loads the leading run of stored
blocks, at most all but the prompt's last token (store/worker.py: the lookup recomputes
the last block when all of it is stored).

Per request the router asks the decode engine for the prompt's token ids (/tokenize:
the same tokenizer and chat template as the request will get), hashes them, and asks
the master which keys exist (GET /batch_query_keys on its HTTP port; it wants `@` and
`:` unescaped). Both calls share one deadline; anything unexpected is a miss, and a
miss is the ordinary prefill -> decode path. Under HA the master URL is a Service over
all masters: a standby answers 503 and names the leader at /leader, which the router
then asks directly until it stops answering.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from pdcluster.router.upstream import Origin, UpstreamError, UpstreamPool
from pdcluster.vllm.hashing import SUPPORTED_HASH, block_keys, loadable_tokens

log = logging.getLogger(__name__)

_SAFE_KEY = re.compile(r"[A-Za-z0-9._\-@:]+")  # what the master takes unescaped in a query
# Fields of a completion or chat request that change its prompt's tokens (vLLM's
# TokenizeCompletionRequest / TokenizeChatRequest take the same names).
_COMPLETION_FIELDS = ("add_special_tokens",)
_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
)
_JSON_HEADERS = b"Content-Type: application/json\r\n"
QUERY_KEYS = 128  # keys per master query: about 14 KB of URL


@dataclass(frozen=True)
class EngineFacts:
    """What a decode engine's keys are made of."""

    model: str  # basename of the engine's model
    block_size: int
    hash_algo: str


class Outcome(StrEnum):
    """A lookup's outcome, also the router's metric label."""

    hit = "hit"  # decode loads the prefix and computes at most max_computed_tokens
    partial = "partial"  # stored, but too little of the prompt to skip prefill
    miss = "miss"
    short = "short"  # under one block: nothing can be stored
    error = "error"
    unsupported = "unsupported"


@dataclass(frozen=True)
class Lookup:
    outcome: Outcome
    prompt_tokens: int = 0  # exact, from the engine's tokenizer (0: unknown)
    stored_tokens: int = 0  # what decode would load from the store
    reason: str = ""


class LookupFailed(Exception):
    pass


def _cache_config(metrics_text: str) -> dict[str, str]:
    """The labels of vllm:cache_config_info (an info gauge: every CacheConfig field)."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = line[line.index("{") + 1 : line.rindex("}")]
            return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
    return {}


async def _get(upstream: UpstreamPool, origin: Origin, path: str, headers: bytes = b"") -> tuple[int, bytes]:
    response = await upstream.request(origin, b"GET", path.encode(), headers, b"")
    try:
        return response.status, await response.read()
    finally:
        response.close()


class EngineTokens:
    """A prompt's exact token ids and the facts its block hashes need, from the engines
    themselves: /tokenize (the same tokenizer and chat template as the request will get)
    and /v1/models and /metrics (model, block size, hash algorithm), once per engine."""

    def __init__(self, upstream: UpstreamPool, engine_headers: bytes = b""):
        self.upstream = upstream
        self.engine_headers = engine_headers  # an engine API key, for its /v1 routes
        self._facts: dict[str, EngineFacts | None] = {}  # by engine URL; None: cannot be keyed

    def forget(self, url: str) -> None:
        self._facts.pop(url, None)

    def known(self, url: str) -> bool:
        return self._facts.get(url) is not None

    async def facts_of(self, url: str) -> EngineFacts | None:
        if url in self._facts:
            return self._facts[url]
        origin = Origin.parse(url)
        status, models = await _get(self.upstream, origin, "/v1/models", self.engine_headers)
        if status != 200:
            raise LookupFailed(f"{url}/v1/models answered HTTP {status}")
        status, metrics = await _get(self.upstream, origin, "/metrics")
        if status != 200:
            raise LookupFailed(f"{url}/metrics answered HTTP {status}")
        root = str(orjson.loads(models)["data"][0].get("root") or "")
        config = _cache_config(metrics.decode("utf-8", "replace"))
        model = root.rstrip("/").split("/")[-1]
        facts: EngineFacts | None = EngineFacts(
            model, int(config.get("block_size") or 0), config.get("prefix_caching_hash_algo", "")
        )
        if not _SAFE_KEY.fullmatch(model) or facts.block_size <= 0 or facts.hash_algo != SUPPORTED_HASH:
            log.warning("no exact block hashes for %s: not computable (%s)", url, facts)
            facts = None
        self._facts[url] = facts
        return facts

    async def tokens(self, url: str, body: dict[str, Any], chat: bool) -> list[int]:
        if not chat and isinstance(body.get("prompt"), list):
            prompt = body["prompt"]
            ids = prompt[0] if prompt and isinstance(prompt[0], list) else prompt
            if all(isinstance(t, int) for t in ids):
                return list(ids)
        fields = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
        request: dict[str, Any] = {k: body[k] for k in fields if k in body}
        request["model"] = body.get("model")
        if chat:
            request["messages"] = body["messages"]
        else:
            request["prompt"] = body["prompt"]
        response = await self.upstream.request(
            Origin.parse(url), b"POST", b"/tokenize", _JSON_HEADERS, orjson.dumps(request)
        )
        try:
            payload = await response.read()
        finally:
            response.close()
        if response.status != 200:
            raise LookupFailed(f"/tokenize answered HTTP {response.status}")
        return list(orjson.loads(payload)["tokens"])


class StoreIndex:
    """Prompt-hit lookups against one master, for the engines the router routes to."""

    def __init__(
        self,
        upstream: UpstreamPool,
        master_url: str,
        *,
        hash_seed: str | None,
        max_computed_tokens: int,
        timeout_s: float,
        engine_headers: bytes = b"",
        engines: EngineTokens | None = None,
    ):
        self.upstream = upstream
        self.engines = engines if engines is not None else EngineTokens(upstream, engine_headers)
        # Any master: under HA a Service over all of them, where a standby answers 503
        # and names the leader (/leader), whose HTTP port is the same.
        self.master = Origin.parse(master_url)
        self.leader = self.master
        self.hash_seed = hash_seed
        self.max_computed_tokens = max_computed_tokens
        self.timeout_s = timeout_s

    def forget(self, url: str) -> None:
        self.engines.forget(url)

    async def _get(self, origin: Origin, path: str) -> tuple[int, bytes]:
        return await _get(self.upstream, origin, path)

    async def _stored(self, keys: list[str]) -> list[bool]:
        """Which keys the master holds, up to the first it lacks: only the leading run
        loads. In chunks, so a 128k-token prompt's thousands of keys never make one
        huge URL, and a miss early in a long prompt ends the questions."""
        stored: list[bool] = []
        for start in range(0, len(keys), QUERY_KEYS):
            found = await self._query(keys[start : start + QUERY_KEYS])
            stored += found
            if not all(found):
                break
        return stored + [False] * (len(keys) - len(stored))

    async def _query(self, keys: list[str]) -> list[bool]:
        path = "/batch_query_keys?keys=" + ",".join(keys)
        try:
            status, payload = await self._get(self.leader, path)
            if status == 503:  # a standby
                self.leader = await self._find_leader()
                status, payload = await self._get(self.leader, path)
        except UpstreamError:
            self.leader = self.master  # a leader gone: ask the Service again next time
            raise
        if status != 200:
            raise LookupFailed(f"master /batch_query_keys answered HTTP {status}")
        answer = orjson.loads(payload)
        data = answer.get("data") if answer.get("success") else None
        if not isinstance(data, dict):
            raise LookupFailed(f"master /batch_query_keys answered {payload[:200]!r}")
        return [bool((data.get(k) or {}).get("ok")) for k in keys]

    async def _find_leader(self) -> Origin:
        status, payload = await self._get(self.master, "/leader")
        view = orjson.loads(payload) if status == 200 else {}
        if not view.get("present"):
            raise LookupFailed(f"no master leads (/leader answered HTTP {status}: {payload[:200]!r})")
        host = str(view["leader_address"]).rpartition(":")[0]  # its RPC address
        return Origin(host.strip("[]"), self.master.port)

    async def lookup(
        self,
        decode_url: str,
        body: dict[str, Any],
        chat: bool,
        estimate: int,
        tokens: list[int] | None = None,
    ) -> Lookup:
        """How much of this request's prompt decode would load from the store; `estimate`
        is the router's guess of its tokens (a prompt clearly under one block costs no
        call), `tokens` its ids where the router has them already."""
        if "cache_salt" in body:
            return Lookup(Outcome.unsupported, reason="cache_salt changes the block hashes")
        try:
            async with asyncio.timeout(self.timeout_s):
                facts = await self.engines.facts_of(decode_url)
                if facts is None:
                    return Lookup(Outcome.unsupported, reason="the engine's block keys cannot be computed")
                if estimate < facts.block_size // 2:
                    return Lookup(Outcome.short)
                if tokens is None:
                    tokens = await self.engines.tokens(decode_url, body, chat)
                keys = block_keys(tokens, facts.block_size, facts.model, self.hash_seed)
                if not keys:
                    return Lookup(Outcome.short, len(tokens))
                stored = loadable_tokens(await self._stored(keys), facts.block_size, len(tokens))
        except (UpstreamError, LookupFailed, TimeoutError, orjson.JSONDecodeError, KeyError, IndexError,
                TypeError, ValueError) as e:  # fmt: skip
            return Lookup(Outcome.error, reason=repr(e))
        if stored == 0:
            outcome = Outcome.miss
        elif len(tokens) - stored <= self.max_computed_tokens:
            outcome = Outcome.hit
        else:
            outcome = Outcome.partial
        return Lookup(outcome, len(tokens), stored)
