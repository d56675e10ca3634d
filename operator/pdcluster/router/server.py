"""The router's HTTP front: OpenAI-compatible endpoints in front of prefill/decode pools.

Per request: validate, pick a prefill rank (policy) and a decode instance (least
loaded), apply SLO admission, then send the prefill and the decode request at once
(protocol.py) and relay decode's answer. With the Mooncake store on, a prompt whose
stored prefix leaves decode little to compute goes to decode alone (store.py); every
other prompt, and any lookup that fails, takes the prefill -> decode path. Streams are
passed through byte for byte; the router only counts SSE events in them for its
metrics (one `data:` event per token, as vLLM streams without speculative decoding).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdcluster.router import openai
from pdcluster.router.http import Request, Response, Stream
from pdcluster.router.membership import Pool, Upstream
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.policy import Admission, LeastLoaded, Policy
from pdcluster.router.prompt import block_hashes, count_tokens, prompt_of
from pdcluster.router.protocol import MooncakeProtocol
from pdcluster.router.store import Lookup, StoreIndex
from pdcluster.router.upstream import Response as UpstreamResponse
from pdcluster.router.upstream import UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

# When a request does not bound its output, assume this many tokens for decode load.
DEFAULT_OUTPUT_TOKENS = 256
COOLDOWN_S = 2.0
MAX_BODY_BYTES = 64 * 1024 * 1024
# Request and transfer ids need only be unique: a generator seeded from os.urandom
# costs no system call per id.
_ids = random.Random()
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_SSE_HEADERS = [("Content-Type", "text/event-stream; charset=utf-8"), ("Cache-Control", "no-cache")]
_JSON = "application/json"


@dataclass
class RouterConfig:
    model: str | None = None
    request_timeout_s: float = 600.0
    api_key: str | None = None


def _error(
    status: int, message: str, param: str | None = None, headers: list[tuple[str, str]] | None = None
) -> Response:
    return Response(status, openai.error_body(status, message, param), _JSON, headers)


class _UpstreamFailed(Exception):
    def __init__(self, role: str, upstream: Upstream, response: Response):
        self.role = role
        self.upstream = upstream
        self.response = response


class Router:
    def __init__(
        self,
        config: RouterConfig,
        pool: Pool,
        session: aiohttp.ClientSession,
        policy: Policy,
        admission: Admission | None,
        store: StoreIndex | None = None,
    ):
        self.config = config
        self.store = store
        self.pool = pool
        self.session = session  # for the odd non-generate call (/v1/models)
        self.upstream = UpstreamPool()
        self.policy = policy
        self.decode_policy = LeastLoaded()
        self.admission = admission
        self.protocol = MooncakeProtocol()
        self.metrics = RouterMetrics(self._load_snapshot)
        self.draining = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._bearer = f"Bearer {config.api_key}".encode() if config.api_key else None
        self._routes: dict[str, dict[str, Any]] = {
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/models": {"GET": self.models},
            "/health": {"GET": self.health},
            "/ready": {"GET": self.ready},
            "/metrics": {"GET": self.prometheus},
            "/backends": {"GET": self.backends},
        }

    def _load_snapshot(self) -> tuple[list[Upstream], dict[str, int]]:
        return self.pool.all_upstreams(), {"prefill": len(self.pool.prefill), "decode": len(self.pool.decode)}

    def forget(self, backend_id: str) -> None:
        """A backend left (or restarted): drop what was known about it."""
        self.policy.forget(backend_id)
        if self.store is not None:
            self.store.forget(backend_id)
        if self.admission is not None:
            self.admission.forget(backend_id)
        for role in ("prefill", "decode"):
            with contextlib.suppress(KeyError):
                self.metrics.upstream_errors.remove(role, backend_id)

    async def handle(self, request: Request) -> Response | Stream:
        """The HTTP server's one handler: route by path and method."""
        routes = self._routes.get(request.path)
        if routes is None:
            return _error(404, f"no route {request.path}")
        handler = routes.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            return _error(405, f"{request.method} is not allowed on {request.path}")
        return await handler(request)

    # ------------------------------------------------------------------ plain routes
    async def health(self, request: Request) -> Response:
        return Response(body=b"ok")

    async def ready(self, request: Request) -> Response:
        if self.draining:
            return Response(503, b"draining")
        if not self.pool.ready:
            return Response(503, b"no ready prefill and decode backends")
        return Response(body=b"ready")

    async def prometheus(self, request: Request) -> Response:
        return Response(body=generate_latest(self.metrics.registry), content_type=CONTENT_TYPE_LATEST)

    async def backends(self, request: Request) -> Response:
        return Response(body=orjson.dumps(self.pool.describe()), content_type=_JSON)

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error(401, "invalid or missing API key")
        for upstream in self.pool.decode:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.session.get(
                    f"{upstream.url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)
                ) as resp:
                    if resp.status == 200:
                        return Response(body=await resp.read(), content_type=_JSON)
        if self.config.model:
            data = [
                {"id": self.config.model, "object": "model", "owned_by": "vllm", "root": self.config.model}
            ]
            return Response(body=orjson.dumps({"object": "list", "data": data}), content_type=_JSON)
        return _error(503, "no decode backend answered")

    # ------------------------------------------------------------------ generate
    async def completions(self, request: Request) -> Response | Stream:
        return await self._generate(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: Request) -> Response | Stream:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    def _authorized(self, request: Request) -> bool:
        if self._bearer is None:
            return True
        return hmac.compare_digest(request.headers.get("authorization", "").encode("latin-1"), self._bearer)

    def _reject(
        self, reason: str, status: int, message: str, headers: list[tuple[str, str]] | None = None
    ) -> Response:
        self.metrics.rejections[reason].inc()
        self.metrics.requests["rejected" if reason != "unauthorized" else "client_error"].inc()
        return _error(status, message, headers=headers)

    def _client_error(self, status: int, message: str, param: str | None = None) -> Response:
        self.metrics.requests["client_error"].inc()
        return _error(status, message, param)

    async def _generate(self, request: Request, path: str, chat: bool) -> Response | Stream:
        started = time.monotonic()
        if self.draining:
            return self._reject("draining", 503, "the router is shutting down")
        if not self._authorized(request):
            return self._reject("unauthorized", 401, "invalid or missing API key")
        if request.too_large:
            return self._client_error(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        body, why = openai.parse_json(request.body)
        if body is None:
            return self._client_error(400, why or "bad request")
        problem = openai.check_request(body, chat)
        if problem:
            return self._client_error(400, *problem)
        model = body.get("model")
        if self.config.model and model is not None and model != self.config.model:
            return self._client_error(404, f"The model `{model}` does not exist.", "model")
        if (body.get("n") or 1) > 1 or (not chat and _is_batch(body["prompt"])):
            return self._client_error(
                400, "n > 1 and batched prompts are not supported with disaggregated prefill"
            )
        # Only the router decides where KV goes.
        body.pop("kv_transfer_params", None)

        prompt = prompt_of(body, chat)
        prompt_tokens = count_tokens(prompt)
        hashes = block_hashes(prompt) if self.policy.needs_block_hashes else ()
        prefill = self.policy.pick(self.pool.routable(self.pool.prefill, started), prompt_tokens, hashes)
        decode = self.decode_policy.pick(self.pool.routable(self.pool.decode, started), prompt_tokens)
        if prefill is None or decode is None:
            return self._reject("no_backend", 503, "no ready prefill and decode backends")
        lookup = await self._look_up(decode, body, chat, prompt_tokens)
        if lookup is not None and lookup.outcome == "hit":
            # Decode loads the stored prefix and computes the rest: no prefill, so no
            # prefill queue to predict either.
            self.metrics.prefill_bypassed.inc()
            self.metrics.store_prefix_tokens.inc(lookup.stored_tokens)
            prefill, prompt_tokens = None, lookup.prompt_tokens
        elif self.admission is not None:
            decision = self.admission.decide(prefill, prompt_tokens)
            if not decision.admitted:
                return self._reject(
                    "slo",
                    429,
                    f"predicted time to first token {decision.predicted_ttft_ms:.0f} ms exceeds the SLO",
                    [("Retry-After", str(decision.retry_after_s))],
                )
        if prefill is not None:
            self.policy.record(prefill.id, hashes)

        header_id = request.headers.get("x-request-id")
        request_id = (
            header_id if header_id and _REQUEST_ID.fullmatch(header_id) else f"{_ids.getrandbits(128):032x}"
        )
        transfer_id = f"xfer-{_ids.getrandbits(128):032x}"
        kv_tokens = prompt_tokens + (openai.max_tokens_of(body, chat) or DEFAULT_OUTPUT_TOKENS)
        self.metrics.prompt_tokens.inc(prompt_tokens)

        if prefill is not None:
            if self.admission is not None:
                self.admission.started(prefill.id, started, prefill.inflight_requests == 0)
            prefill.inflight_requests += 1
            prefill.inflight_tokens += prompt_tokens
        decode.inflight_requests += 1
        decode.inflight_tokens += kv_tokens
        self.inflight += 1
        self.idle.clear()
        flow = _Flow(self, request, path, body, prefill, decode, prompt_tokens, started)
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                return await flow.run(request_id, transfer_id)
        except TimeoutError:
            self.metrics.requests["timeout"].inc()
            if flow.response is not None:  # mid-stream: the status is sent already
                with contextlib.suppress(ConnectionError):
                    await flow.response.write(
                        b"data: " + openai.error_body(504, "request timed out") + b"\n\ndata: [DONE]\n\n"
                    )
                    await flow.response.write_eof()
                return flow.response
            return _error(504, f"no answer within {self.config.request_timeout_s:g} s")
        except asyncio.CancelledError:
            self.metrics.requests["cancelled"].inc()
            raise
        finally:
            flow.prefill_done()
            decode.inflight_requests -= 1
            decode.inflight_tokens -= kv_tokens
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()

    async def _look_up(
        self, decode: Upstream, body: dict[str, Any], chat: bool, estimate: int
    ) -> Lookup | None:
        if self.store is None:
            return None
        began = time.monotonic()
        lookup = await self.store.lookup(decode.url, body, chat, estimate)
        self.metrics.store_lookup_time.observe(time.monotonic() - began)
        self.metrics.store_lookups[lookup.outcome].inc()
        if lookup.outcome == "error":
            log.debug("store lookup failed: %s", lookup.reason)
        return lookup


class _Flow:
    """One client request's prefill and decode exchanges (decode alone when its prompt's
    prefix is stored: `prefill` is None)."""

    __slots__ = (
        "_prefill_open",
        "body",
        "decode",
        "path",
        "prefill",
        "prefilled_at",
        "prompt_tokens",
        "request",
        "response",
        "router",
        "started",
    )  # fmt: skip

    def __init__(
        self,
        router: Router,
        request: Request,
        path: str,
        body: dict[str, Any],
        prefill: Upstream | None,
        decode: Upstream,
        prompt_tokens: int,
        started: float,
    ):
        self.router = router
        self.request = request
        self.path = path
        self.body = body
        self.prefill = prefill
        self.decode = decode
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.response: Stream | None = None
        self.prefilled_at: float | None = None
        self._prefill_open = prefill is not None

    def prefill_done(self, ok: bool = False) -> None:
        if not self._prefill_open or self.prefill is None:
            return
        self._prefill_open = False
        self.prefill.inflight_requests -= 1
        self.prefill.inflight_tokens -= self.prompt_tokens
        admission = self.router.admission
        if ok and admission is not None:
            admission.completed(self.prefill.id, self.prompt_tokens, time.monotonic())

    async def run(self, request_id: str, transfer_id: str) -> Response | Stream:
        router = self.router
        protocol = router.protocol
        if self.prefill is None:
            decode_bytes = orjson.dumps(self.body)  # a plain request: decode's store loads the prefix
        else:
            engine = self.prefill.engine
            assert engine is not None
            prefill_bytes = orjson.dumps(protocol.prefill_body(self.body, transfer_id))
            decode_bytes = orjson.dumps(protocol.decode_body(self.body, transfer_id, engine))
        path = self.path.encode()
        decode_task = asyncio.get_running_loop().create_task(
            router.upstream.request(
                self.decode.origin,
                b"POST",
                path,
                _header_lines(protocol.decode_headers(request_id)),
                decode_bytes,
            )
        )
        try:
            if self.prefill is not None:
                await self._run_prefill(
                    path, prefill_bytes, _header_lines(protocol.prefill_headers(request_id, engine))
                )
            upstream = await self._await_decode(decode_task)
        except _UpstreamFailed as failure:
            _discard(decode_task)
            return self._fail(failure)
        except BaseException:
            _discard(decode_task)
            raise
        try:
            if upstream.status != 200:
                payload = await upstream.read()
                status = upstream.status
                if status >= 500:
                    self._count_upstream_error("decode", self.decode)
                    router.metrics.requests["upstream_error"].inc()
                    # Perhaps the KV could not be found: the prefill may have restarted
                    # under a new engine_id.
                    if self.prefill is not None:
                        router.pool.invalidate(self.prefill)
                else:
                    router.metrics.requests["client_error"].inc()
                return Response(status, payload, _JSON)
            if self.body.get("stream"):
                return await self._relay_stream(upstream)
            return await self._relay_body(upstream)
        except UpstreamError as e:  # decode broke off mid-answer
            self._count_upstream_error("decode", self.decode)
            router.metrics.requests["upstream_error"].inc()
            if self.response is None:
                return _error(502, f"decode backend failed: {e}")
            with contextlib.suppress(ConnectionError):
                await self.response.write(
                    b"data: " + openai.error_body(502, str(e)) + b"\n\ndata: [DONE]\n\n"
                )
                await self.response.write_eof()
            return self.response
        finally:
            upstream.close()  # keeps a finished connection, drops an unfinished one

    async def _run_prefill(self, path: bytes, body: bytes, headers: bytes) -> None:
        router = self.router
        try:
            response = await router.upstream.request(self.prefill.origin, b"POST", path, headers, body)
            try:
                payload = await response.read()
            finally:
                response.close()
        except UpstreamError as e:
            self.prefill.cooldown_until = time.monotonic() + COOLDOWN_S
            router.pool.invalidate(self.prefill)
            raise _UpstreamFailed("prefill", self.prefill, _error(502, f"prefill backend failed: {e}")) from e
        status = response.status
        if status == 200:
            self.prefilled_at = time.monotonic()
            self.prefill_done(ok=True)
            return
        if status < 500:
            # The engine refused the request itself (e.g. too long for max_model_len).
            raise _UpstreamFailed(
                "client",
                self.prefill,
                Response(status, payload, _JSON),
            )
        raise _UpstreamFailed(
            "prefill", self.prefill, _error(502, f"prefill backend failed with HTTP {status}")
        )

    async def _await_decode(self, task: asyncio.Task[UpstreamResponse]) -> UpstreamResponse:
        try:
            return await task
        except UpstreamError as e:
            self.decode.cooldown_until = time.monotonic() + COOLDOWN_S
            raise _UpstreamFailed("decode", self.decode, _error(502, f"decode backend failed: {e}")) from e

    def _fail(self, failure: _UpstreamFailed) -> Response:
        metrics = self.router.metrics
        if failure.role == "client":
            metrics.requests["client_error"].inc()
        else:
            self._count_upstream_error(failure.role, failure.upstream)
            metrics.requests["upstream_error"].inc()
        return failure.response

    def _count_upstream_error(self, role: str, upstream: Upstream) -> None:
        self.router.metrics.upstream_errors.labels(role, upstream.id).inc()

    async def _relay_body(self, upstream: UpstreamResponse) -> Response:
        payload = await upstream.read()
        metrics = self.router.metrics
        with contextlib.suppress(orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            metrics.generation_tokens.inc(orjson.loads(payload)["usage"]["completion_tokens"])
        metrics.e2e.observe(time.monotonic() - self.started)
        metrics.requests["ok"].inc()
        return Response(body=payload, content_type=_JSON)

    async def _relay_stream(self, upstream: UpstreamResponse) -> Stream:
        metrics = self.router.metrics
        response = self.request.stream(200, _SSE_HEADERS)
        self.response = response
        last_token_at = 0.0
        tokens = 0
        failed = False
        async for chunk in upstream.iter_chunks():
            events = chunk.count(b"data: ")
            if events:
                now = time.monotonic()
                # Not tokens: the chat role chunk, the usage chunk, [DONE], errors.
                n = (
                    events
                    - chunk.count(b'{"role":')
                    - chunk.count(b'"choices":[]')
                    - chunk.count(b"data: [DONE]")
                )
                if b'"error"' in chunk:
                    failed = True
                if n > 0:
                    if tokens == 0:
                        metrics.ttft.observe(now - self.started)
                        if self.prefilled_at is not None:
                            metrics.prefill.observe(self.prefilled_at - self.started)
                            metrics.after_prefill.observe(now - self.prefilled_at)
                        gaps, gap = n - 1, 0.0
                    else:
                        gaps, gap = n, (now - last_token_at) / n
                    for _ in range(gaps):
                        metrics.itl.observe(gap)
                    tokens += n
                    last_token_at = now
            try:
                await response.write(chunk)
            except ConnectionResetError:  # the client left; closing upstream aborts decode
                metrics.requests["cancelled"].inc()
                return response
        await response.write_eof()
        metrics.generation_tokens.inc(tokens)
        if failed:
            self._count_upstream_error("decode", self.decode)
            metrics.requests["upstream_error"].inc()
        else:
            metrics.e2e.observe(time.monotonic() - self.started)
            metrics.requests["ok"].inc()
        return response


def _header_lines(headers: list[tuple[str, str]]) -> bytes:
    return "".join(f"{name}: {value}\r\n" for name, value in headers).encode()


def _discard(task: asyncio.Task[UpstreamResponse]) -> None:
    """Abandon a decode request: cancel it, or close its response to abort the engine."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        task.result().close()


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))
