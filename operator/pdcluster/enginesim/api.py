"""The simulator's OpenAI-compatible HTTP server, shaped like vLLM 0.32.0's (the version
the real-engine tests run, tests/e2e/test_vllm.py, which holds the shapes to it; 0.33
speaks the same protocol).

Responses follow vllm/entrypoints/openai/{completion,chat_completion}/serving.py: ids
`cmpl-<X-Request-Id or random>` / `chatcmpl-...`, usage, finish_reason, streamed chunks
ending in `data: [DONE]`, errors as {"error": {...}}. Generated text is filler drawn
deterministically from the prompt and seed: one word (about 4 characters, so about one
token by the router's count) per token.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
import zlib
from array import array
from collections import deque
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdcluster.enginesim.cli import SimConfig
from pdcluster.enginesim.engine import EngineCore, RemotePrefill, Seq
from pdcluster.enginesim.store_connector import PrefixStore
from pdcluster.router import openai
from pdcluster.router.prompt import count_tokens, prompt_of, token_ids
from pdcluster.vllm.version import VLLM_VERSION

log = logging.getLogger(__name__)

_WORDS = (
    " the", " of", " and", " to", " in", " is", " for", " on", " with", " as", " at", " by",
    " data", " node", " cache", " token", " model", " layer", " batch", " queue", " load",
    " time", " rate", " path", " key", " value", " block", " page", " link", " fast",
)  # fmt: skip
_WORDS_JSON = tuple(orjson.dumps(w) for w in _WORDS)
_DONE = b"data: [DONE]\n\n"
# The id of generated word w is GENERATED_ID + w, above every id of UTF-8 text (whose
# fourth bytes are never 0xFF), so a prompt ending in generated ids continues an answer.
GENERATED_ID = 2**31 - 64


def _json(status: int, payload: Any) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.Response(
        status=status, body=openai.error_body(status, message, param), content_type="application/json"
    )


class _Request:
    """What the server needs of one validated generate request."""

    __slots__ = ("chat", "created", "first_word", "id", "include_usage", "model", "prompt_ids", "seq")

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        seq: Seq,
        first_word: int,
        include_usage: bool,
        prompt_ids: list[int] | None = None,
    ):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.model = model
        self.seq = seq
        self.first_word = first_word
        self.include_usage = include_usage
        self.prompt_ids = prompt_ids  # set when the client asked for token ids

    def words(self, start: int, stop: int) -> list[int]:
        return [(self.first_word + i) % len(_WORDS) for i in range(start, stop)]

    def token_ids(self, start: int, stop: int) -> list[int]:
        return [GENERATED_ID + w for w in self.words(start, stop)]

    def usage(self, details: bool) -> dict[str, Any]:
        """As vLLM's: with --enable-prompt-tokens-details, the prompt tokens it did not
        compute (its prefix cache, or KV loaded through the connector) as cached."""
        prompt, completion = self.seq.prompt_tokens, self.seq.generated
        out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                               "completion_tokens": completion}  # fmt: skip
        if details:
            # vLLM 0.32's PromptTokenUsageInfo (entrypoints/serve/engine/protocol.py), all its fields
            out["prompt_tokens_details"] = {
                "cached_tokens": max(self.seq.stored, self.seq.cached),
                "created_cache_tokens": None,
                "multimodal_tokens": None,
            }
        return out


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
            headers = {
                k: request.headers[k]
                for k in ("X-Request-Id", "X-data-parallel-rank", "traceparent")
                if k in request.headers
            }
            self.recorded.append(
                {"path": request.path, "headers": headers, "body": body, "received_at": time.time()}
            )
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
        core = self._core(request)
        if core is None:
            return _error(400, f"X-data-parallel-rank must be in [0, {len(self.cores)})")
        prompt = prompt_of(body, chat)
        prompt_tokens = max(count_tokens(prompt), 1)
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
        tokens = token_ids(prompt) if self.store is not None and remote is None else None
        stored = await self.store.load(tokens) if self.store is not None and tokens else 0
        cache = core.prefix if remote is None else None
        hashes = cache.hashes(ids) if cache is not None else []
        seq = Seq(
            prompt_tokens,
            max_tokens,
            min_tokens=min_tokens,
            eos_at=self._eos_at(digest, body, answered),
            remote=remote,
            hold_transfer_id=hold,
            stored=stored,
            cached=cache.cached_tokens(hashes, prompt_tokens) if cache is not None else 0,
        )
        stream = bool(body.get("stream"))
        seq.streaming = stream
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage")) or self.config.force_include_usage
        request_id = request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
        req = _Request(
            chat,
            str(request_id),
            self.config.model_name,
            seq,
            (digest + answered) % len(_WORDS),
            include_usage,
            ids if body.get("return_token_ids") else None,
        )
        core.submit(seq)
        try:
            if stream:
                return await self._stream(request, req)
            return await self._complete(req)
        finally:
            core.abort(seq)  # no-op once finished; frees everything on a disconnect
            if tokens and seq.first_token_at:  # prefilled here: its blocks go to the store
                self.store.save(tokens)  # type: ignore[union-attr]
            if cache is not None and seq.first_token_at:
                cache.insert(hashes, ids)

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

    async def _complete(self, req: _Request) -> web.Response:
        seq = req.seq
        while not seq.finished:
            await seq.wait()
        if seq.finish_reason == "error":
            return _error(500, "Internal server error")
        text = "".join(_WORDS[w] for w in req.words(0, seq.generated))
        end = {"logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": None}
        payload: dict[str, Any] = {"id": req.id, "created": req.created, "model": req.model}
        if req.chat:
            message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                       "function_call": None, "reasoning": None}  # fmt: skip
            payload["object"] = "chat.completion"
            payload["choices"] = [{"index": 0, "message": message, **end}]
        else:
            payload["object"] = "text_completion"
            ids = req.prompt_ids is not None
            payload["choices"] = [
                {"index": 0, "text": text, **end, "token_ids": req.token_ids(0, seq.generated) if ids else None,
                 "prompt_logprobs": None, "prompt_token_ids": req.prompt_ids}
            ]  # fmt: skip
        payload |= {
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": {"prompt_tokens_details": None} | req.usage(self.config.prompt_tokens_details),
        }
        if req.chat:
            payload["prompt_logprobs"] = None
        payload["kv_transfer_params"] = None
        return _json(200, payload)

    async def _stream(self, request: web.Request, req: _Request) -> web.StreamResponse:
        seq = req.seq
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if req.chat else "text_completion"
        head = orjson.dumps({"id": req.id, "object": kind, "created": req.created, "model": req.model})[:-1]
        if req.chat:
            open_, close = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":', b"}"
            tail = b',"logprobs":null,"finish_reason":%s%s%s}]%s}\n\n'
        else:
            open_, close = b"data: " + head + b',"choices":[{"index":0,"text":', b""
            tail = b',"logprobs":null,"finish_reason":%s%s,"prompt_token_ids":%s,"token_ids":%s}]%s}\n\n'
        # vLLM sends the prompt's ids with the first event, each token's with it.
        with_ids = req.prompt_ids is not None
        prompt_ids = orjson.dumps(req.prompt_ids) if with_ids else b"null"
        # vLLM names itself in the last event before [DONE].
        fingerprint = b',"system_fingerprint":' + orjson.dumps(self.fingerprint)
        not_final = b',"stop_reason":null' if not req.chat else b""
        no_ids = (b"",) if req.chat else (b"null", b"null")
        sent = 0
        while True:
            if seq.generated == sent and not seq.finished:
                await seq.wait()
            generated, finished = seq.generated, seq.finished
            if finished and seq.finish_reason == "error":
                error = openai.error_body(500, "Internal server error")
                await response.write(b"data: " + error + b"\n\n" + _DONE)
                break
            out = []
            if req.chat and sent == 0 and generated > 0:
                out.append(b"data: " + head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                           b'"logprobs":null,"finish_reason":null}]'
                           + (b',"prompt_token_ids":' + prompt_ids if with_ids else b"") + b"}\n\n")  # fmt: skip
            # Relay-latency probe for benchmarks: when this batch of tokens left the engine.
            stamp = b',"sim_sent_at":%.6f' % time.monotonic() if self.config.stamp_tokens else b""
            running = tail % (b"null", not_final, *no_ids, stamp)
            words = req.words(sent, generated)
            for i, word in enumerate(words):
                last = finished and i == len(words) - 1
                ids = no_ids
                if with_ids and req.chat:
                    ids = (b',"token_ids":[%d]' % (GENERATED_ID + word),)
                elif with_ids:
                    ids = (prompt_ids if sent + i == 0 else b"null", b"[%d]" % (GENERATED_ID + word))
                if last:
                    reason = orjson.dumps(seq.finish_reason)
                    end = tail % (
                        reason,
                        b',"stop_reason":null',
                        *ids,
                        stamp + (b"" if req.include_usage else fingerprint),
                    )
                elif with_ids:
                    end = tail % (b"null", not_final, *ids, stamp)
                else:
                    end = running
                out.append(open_ + _WORDS_JSON[word] + close + end)
            sent = generated
            if finished:
                if req.include_usage:
                    usage = {"id": req.id, "object": kind, "created": req.created, "model": req.model,
                             "choices": [], "usage": req.usage(self.config.prompt_tokens_details), "system_fingerprint": self.fingerprint}  # fmt: skip
                    out.append(b"data: " + orjson.dumps(usage) + b"\n\n")
                out.append(_DONE)
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
