"""The simulator's OpenAI-compatible HTTP server, shaped like vLLM 0.32.0's (the version
the real-engine tests run, tests/e2e/test_vllm.py, which holds the shapes to it; 0.33
speaks the same protocol).

Responses follow vllm/entrypoints/openai/{completion,chat_completion}/serving.py: ids
`cmpl-<X-Request-Id or random>` / `chatcmpl-...`, usage, finish_reason, streamed chunks
ending in `data: [DONE]`, errors as {"error": {...}}; their bodies are in responses.py.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
import zlib
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdcluster.enginesim.cli import SimConfig
from pdcluster.enginesim.engine import EngineCore, RemotePrefill, Seq
from pdcluster.enginesim.prefix import PrefixCache
from pdcluster.enginesim.responses import (
    DONE,
    FILLER_WORDS,
    GENERATED_ID,
    GenerateRequest,
    closing_events,
    completion_body,
    stream_frames,
    token_events,
)
from pdcluster.enginesim.store_connector import PrefixStore
from pdcluster.router import openai
from pdcluster.router.prompt import count_tokens, prompt_of, token_ids
from pdcluster.vllm.version import VLLM_VERSION

log = logging.getLogger(__name__)


def _json(status: int, payload: Any) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.Response(
        status=status, body=openai.error_body(status, message, param), content_type="application/json"
    )


class _OutputLengths(NamedTuple):
    max_tokens: int
    min_tokens: int


@dataclass(slots=True)
class _Admitted:
    """An admitted request and what to do with its prompt's blocks once it ran."""

    req: GenerateRequest
    store_tokens: list[int] | None  # the prompt's ids when the store connector saves it after prefill
    cache: PrefixCache | None  # the engine's prefix cache, None when the KV is handed over
    hashes: list[bytes]  # the prompt's block hashes in that cache
    ids: list[int]


class OpenAIServer:
    def __init__(
        self, config: SimConfig, cores: list[EngineCore], registry: Any, store: PrefixStore | None = None
    ):
        self.config = config
        self.cores = cores
        self.registry = registry
        self.store = store
        self.created = int(time.time())
        self._producer = config.has_connector and config.role in ("prefill", "both")
        self._consumer = config.has_connector and config.role in ("decode", "both")
        self._warned: set[str] = set()
        self.fingerprint = system_fingerprint(config)
        self.recorded: deque[dict[str, Any]] = deque(maxlen=config.record or None)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        if self.config.record:
            app.router.add_get("/sim/requests", self.requests)
        return app

    async def requests(self, request: web.Request) -> web.Response:
        """The last generate requests as received: path, routing headers, body."""
        return _json(200, list(self.recorded))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": self.config.model,
                "parent": None,
                "max_model_len": self.config.max_model_len,
                "permission": [],
            }
            for name in self.config.served_model_names
        ]
        return _json(200, {"object": "list", "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize (entrypoints/serve/tokenize): the ids a request's prompt becomes."""
        body, why = openai.parse_json(await request.read())
        if body is None:
            return _error(400, why or "bad request")
        chat = "messages" in body
        expected = list if chat else str
        if not isinstance(body.get("messages" if chat else "prompt"), expected):
            return _error(400, "expected a prompt (a string) or messages")
        ids = token_ids(prompt_of(body, chat))
        return _json(
            200,
            {
                "count": len(ids),
                "max_model_len": self.config.max_model_len,
                "tokens": ids,
                "token_strs": None,
            },
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # ------------------------------------------------------------------ generate
    def _authorized(self, request: web.Request) -> bool:
        key = self.config.api_key
        if key is None:
            return True
        return hmac.compare_digest(request.headers.get("Authorization", ""), f"Bearer {key}")

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if not self._authorized(request):
            return _json(401, {"error": "Unauthorized"})
        body, why = openai.parse_json(await request.read())
        if body is None:
            return _error(400, why or "bad request")
        if self.config.record:
            self._record(request, body)
        rejection = self._unservable(body, chat)
        if rejection is not None:
            return rejection
        core = self._core(request)
        if core is None:
            return _error(400, f"X-data-parallel-rank must be in [0, {len(self.cores)})")
        prompt = prompt_of(body, chat)
        prompt_tokens = max(count_tokens(prompt), 1)
        lengths = self._output_lengths(body, chat, prompt_tokens, core)
        if isinstance(lengths, web.Response):
            return lengths
        run = await self._admit(request, body, chat, prompt, prompt_tokens, lengths, core)
        core.submit(run.req.seq)
        try:
            if run.req.seq.streaming:
                return await self._stream(request, run.req)
            return await self._complete(run.req)
        finally:
            core.abort(run.req.seq)  # no-op once finished; frees everything on a disconnect
            if run.store_tokens and run.req.seq.first_token_at:  # prefilled here: its blocks go to the store
                self.store.save(run.store_tokens)  # type: ignore[union-attr]
            if run.cache is not None and run.req.seq.first_token_at:
                run.cache.insert(run.hashes, run.ids)

    def _record(self, request: web.Request, body: dict[str, Any]) -> None:
        headers = {
            k: request.headers[k]
            for k in ("X-Request-Id", "X-data-parallel-rank", "traceparent")
            if k in request.headers
        }
        self.recorded.append(
            {"path": request.path, "headers": headers, "body": body, "received_at": time.time()}
        )

    def _unservable(self, body: dict[str, Any], chat: bool) -> web.Response | None:
        """The error for a request this server does not serve, whatever its length."""
        problem = openai.check_request(body, chat)
        if problem:
            return _error(400, *problem)
        model = body.get("model")
        if model is not None and model not in self.config.served_model_names:
            return _error(404, f"The model `{model}` does not exist.", "model")
        if (body.get("n") or 1) > 1 or (
            not chat and isinstance(body["prompt"], list) and _is_batch(body["prompt"])
        ):
            return _error(400, "the engine simulator serves one prompt and n=1 per request")
        return None

    def _output_lengths(
        self, body: dict[str, Any], chat: bool, prompt_tokens: int, core: EngineCore
    ) -> _OutputLengths | web.Response:
        """The request's output bounds, or the error when they do not fit the context."""
        limit = self.config.max_model_len
        max_tokens = openai.max_tokens_of(body, chat) or max(limit - prompt_tokens, 1)
        if prompt_tokens + max_tokens > limit or prompt_tokens > core.capacity:
            return _error(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion).",
            )
        min_tokens = body.get("min_tokens") or 0
        if min_tokens > max_tokens:  # vLLM's SamplingParams check
            return _error(
                400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
            )
        return _OutputLengths(max_tokens, min_tokens)

    async def _admit(
        self,
        request: web.Request,
        body: dict[str, Any],
        chat: bool,
        prompt: str | list[int],
        prompt_tokens: int,
        lengths: _OutputLengths,
        core: EngineCore,
    ) -> _Admitted:
        """The sequence for a valid request, with what it has cached or is handed."""
        ids = token_ids(prompt)
        # Greedy and deterministic, as a model: the answer depends on the prompt alone, and
        # a prompt that ends in k ids of an answer gets that answer from its token k on.
        answered = 0
        while answered < len(ids) and ids[-1 - answered] >= GENERATED_ID:
            answered += 1
        digest = zlib.crc32(array("q", ids[: len(ids) - answered]).tobytes()) ^ self.config.seed * 0x9E3779B1
        remote, hold = self._kv_params(body.get("kv_transfer_params"))
        # A hand-off brings the whole prompt (MultiConnector asks MooncakeConnector
        # first); without one, the store may hold a prefix.
        store_tokens = token_ids(prompt) if self.store is not None and remote is None else None
        stored = await self.store.load(store_tokens) if self.store is not None and store_tokens else 0
        cache = core.prefix if remote is None else None
        hashes = cache.hashes(ids) if cache is not None else []
        seq = Seq(
            prompt_tokens,
            lengths.max_tokens,
            min_tokens=lengths.min_tokens,
            eos_at=self._eos_at(digest, body, answered),
            remote=remote,
            hold_transfer_id=hold,
            stored=stored,
            cached=cache.cached_tokens(hashes, prompt_tokens) if cache is not None else 0,
        )
        seq.streaming = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage")) or self.config.force_include_usage
        request_id = request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
        req = GenerateRequest(
            chat,
            str(request_id),
            self.config.model_name,
            seq,
            (digest + answered) % len(FILLER_WORDS),
            include_usage,
            ids if body.get("return_token_ids") else None,
        )
        return _Admitted(req, store_tokens, cache, hashes, ids)

    def _core(self, request: web.Request) -> EngineCore | None:
        rank = request.headers.get("X-data-parallel-rank")
        if rank is None:
            return min(self.cores, key=lambda c: c.load)
        try:
            index = int(rank)
        except ValueError:
            return min(self.cores, key=lambda c: c.load)  # vLLM ignores a non-integer rank
        return self.cores[index] if 0 <= index < len(self.cores) else None

    def _warn_once(self, message: str, *args: Any) -> None:
        """vLLM warns on every such request; once is enough for a simulator under load."""
        level = logging.DEBUG if message in self._warned else logging.WARNING
        self._warned.add(message)
        log.log(level, message, *args)

    def _eos_at(self, digest: int, body: dict[str, Any], answered: int = 0) -> int | None:
        mean = self.config.output_mean
        if mean <= 0 or body.get("ignore_eos"):
            return None
        return max(1 + ((digest * 2654435761) >> 7) % (2 * mean - 1) - answered, 1)

    def _kv_params(self, params: dict[str, Any] | None) -> tuple[RemotePrefill | None, str | None]:
        """(where decode pulls KV from, transfer_id prefill keeps KV for)."""
        if not params:
            return None, None
        if self._consumer and params.get("do_remote_prefill"):
            if all(k in params for k in ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")):
                return RemotePrefill(
                    str(params["remote_engine_id"]),
                    str(params["remote_bootstrap_addr"]),
                    str(params["transfer_id"]),
                ), None
            self._warn_once(
                "Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params
            )
        if self._producer and params.get("do_remote_decode"):
            if params.get("transfer_id"):
                return None, str(params["transfer_id"])
            self._warn_once("Missing transfer_id in kv_transfer_params from router!")
        return None, None

    async def _complete(self, req: GenerateRequest) -> web.Response:
        seq = req.seq
        while not seq.finished:
            await seq.wait()
        if seq.finish_reason == "error":
            return _error(500, "Internal server error")
        config = self.config
        return _json(
            200, completion_body(req, self.fingerprint, config.prompt_tokens_details, config.per_request_metrics)
        )

    async def _stream(self, request: web.Request, req: GenerateRequest) -> web.StreamResponse:
        seq = req.seq
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        frames = stream_frames(req, self.fingerprint)
        sent = 0
        while True:
            if seq.generated == sent and not seq.finished:
                await seq.wait()
            generated, finished = seq.generated, seq.finished
            if finished and seq.finish_reason == "error":
                error = openai.error_body(500, "Internal server error")
                await response.write(b"data: " + error + b"\n\n" + DONE)
                break
            out = token_events(req, frames, sent, generated, finished, self.config.stamp_tokens)
            sent = generated
            if finished:
                details, timing = self.config.prompt_tokens_details, self.config.per_request_metrics
                out += closing_events(req, frames, self.fingerprint, details, timing)
            if out:
                await response.write(b"".join(out))
            if finished:
                break
        await response.write_eof()
        return response


def system_fingerprint(config: SimConfig) -> str:
    """As vLLM's default ("full") mode writes it (entrypoints/serve/utils/fingerprint.py):
    version, parallel sizes above 1, and a hash of the engine's configuration."""
    parts = [f"vllm-{VLLM_VERSION}"]
    for prefix, size in (
        ("tp", config.tensor_parallel_size),
        ("pp", config.pipeline_parallel_size),
        ("dp", config.data_parallel_size),
    ):
        if size > 1:
            parts.append(f"{prefix}{size}")
    described = (
        f"{config.model}|{config.max_model_len}|{config.tensor_parallel_size}|{config.pipeline_parallel_size}"
    )
    parts.append(f"{zlib.crc32(described.encode()):08x}")
    return "-".join(parts)


def _is_batch(prompt: list[Any]) -> bool:
    """A list of several prompts (strings or token-id lists), not one token-id prompt."""
    return len(prompt) > 1 and isinstance(prompt[0], (str, list))
