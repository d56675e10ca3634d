"""The router's HTTP front: OpenAI-compatible endpoints in front of prefill/decode pools
and pools of colocated engines.

Per request: validate, pick a prefill rank or a colocated engine (policy; the two are
weighed alike: prompt tokens not yet prefilled), for a prefill a decode instance (least
loaded, of the prefill's engine revision, not in a pair whose KV hand-off failed its
probe), apply SLO admission, then send the prefill and the decode request at once
(protocol.py) and relay decode's answer; a colocated engine gets the request as the
client sent it. With the Mooncake store on, a prompt whose stored prefix
leaves decode little to compute goes to decode alone (store.py); every other prompt, and
any lookup that fails, takes the prefill -> decode path.

An attempt that fails on an engine (no connection, 5xx, a prefill past its timeout) is
made again on engines not tried for this request, at most `max_attempts` times, the last
one by decode alone when no prefill is left; a stream whose decode dies mid-answer goes
on from another decode engine (resume.py). Streams are relayed as the engine wrote them,
less the token ids the router asked for to resume them; the router counts SSE events in
them for its metrics (one `data:` event per token, as vLLM streams without speculative
decoding).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
import re
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import orjson
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdcluster.constants import ROLE_COLOCATED
from pdcluster.router import openai
from pdcluster.router.http import Request, Response, Stream
from pdcluster.router.kvevents import block_id
from pdcluster.router.membership import Pool, Upstream
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.policy import Admission, ExactBlocks, LeastLoaded, Policy, PreciseCache, PrefixAware
from pdcluster.router.probe import KvProber
from pdcluster.router.prompt import block_hashes, count_tokens, prompt_of
from pdcluster.router.protocol import MooncakeProtocol
from pdcluster.router.resume import TokenTrail, as_chat, fix_usage, resumable
from pdcluster.router.store import EngineTokens, Lookup, LookupFailed, StoreIndex
from pdcluster.router.upstream import Response as UpstreamResponse
from pdcluster.router.upstream import UpstreamError, UpstreamPool
from pdcluster.vllm.hashing import engine_block_hashes

if TYPE_CHECKING:
    from pdcluster.router.tracing import RequestTrace, Span, Tracing

log = logging.getLogger(__name__)
T = TypeVar("T")

# When a request does not bound its output, assume this many tokens for decode load.
DEFAULT_OUTPUT_TOKENS = 256
MAX_BODY_BYTES = 64 * 1024 * 1024
# Request and transfer ids need only be unique: a generator seeded from os.urandom
# costs no system call per id.
_ids = random.Random()
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_SSE_HEADERS = [("Content-Type", "text/event-stream; charset=utf-8"), ("Cache-Control", "no-cache")]
_JSON = "application/json"
# An engine refusing the router's credentials is the deployment's fault, not the client's.
_NOT_THE_CLIENTS = (401, 403)


@dataclass
class RouterConfig:
    model: str | None = None
    request_timeout_s: float = 600.0
    api_key: str | None = None
    engine_api_key: str | None = None  # sent to engines started with --api-key
    max_attempts: int = 3  # per request, across prefill and decode engines
    prefill_timeout_s: float = 120.0
    resume_streams: bool = True
    hash_seed: str | None = None  # the engines' PYTHONHASHSEED, which seeds vLLM's block hashes
    exact_timeout_s: float = 0.1  # what hashing a prompt as the engines do may add to a request


def _error(
    status: int, message: str, param: str | None = None, headers: list[tuple[str, str]] | None = None
) -> Response:
    return Response(status, openai.error_body(status, message, param), _JSON, headers)


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
        # A prompt's token ids and its engines' block facts: for the store's lookups and
        # for the precise policy's exact block hashes.
        self.engine_tokens = (
            store.engines
            if store is not None
            else EngineTokens(UpstreamPool(), _engine_auth(config))
            if policy.needs_exact_blocks
            else None
        )
        self.pool = pool
        self.session = session  # for the odd non-generate call (/v1/models)
        self.upstream = UpstreamPool()
        self.policy = policy
        self.decode_policy = LeastLoaded()
        self.admission = admission
        self.prober: KvProber | None = None  # set by the service when hand-offs are verified
        self.tracing: Tracing | None = None  # set by the service with --otlp-traces-endpoint
        self.protocol = MooncakeProtocol()
        self.metrics = RouterMetrics(self._load_snapshot)
        self.draining = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._bearer = f"Bearer {config.api_key}".encode() if config.api_key else None
        self._engine_key_header = (
            {"Authorization": f"Bearer {config.engine_api_key}"} if config.engine_api_key else {}
        )
        self._engine_auth = _engine_auth(config)
        self._routes: dict[str, dict[str, Any]] = {
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/models": {"GET": self.models},
            "/health": {"GET": self.health},
            "/ready": {"GET": self.ready},
            "/metrics": {"GET": self.prometheus},
            "/backends": {"GET": self.backends},
        }

    def engine_headers(self, headers: list[tuple[str, str]]) -> bytes:
        return _header_lines(headers) + self._engine_auth

    def _load_snapshot(self) -> tuple[list[Upstream], dict[str, int]]:
        pool = self.pool
        return pool.all_upstreams(), {
            "prefill": len(pool.prefill),
            "decode": len(pool.decode),
            ROLE_COLOCATED: len(pool.colocated),
        }

    def forget(self, backend_id: str) -> None:
        """A backend left (or restarted): drop what was known about it."""
        self.policy.forget(backend_id)
        if self.store is not None:
            self.store.forget(backend_id)
        if self.admission is not None:
            self.admission.forget(backend_id)
        for role in ("prefill", "decode", ROLE_COLOCATED):
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
            return Response(503, b"no ready prefill and decode backends, nor colocated engines")
        return Response(body=b"ready")

    async def prometheus(self, request: Request) -> Response:
        return Response(body=generate_latest(self.metrics.registry), content_type=CONTENT_TYPE_LATEST)

    async def backends(self, request: Request) -> Response:
        view = self.pool.describe()
        if isinstance(self.policy, PreciseCache):
            index = self.policy.index
            for role in ("prefill", ROLE_COLOCATED):
                for backend in view[role]:
                    backend["kv_events"] = {
                        "live": index.live(backend["id"]),
                        "blocks": index.blocks(backend["id"]),
                    }
        return Response(body=orjson.dumps(view), content_type=_JSON)

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return _error(401, "invalid or missing API key")
        for upstream in [*self.pool.decode, *self.pool.colocated]:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.session.get(
                    f"{upstream.url}/v1/models",
                    headers=self._engine_key_header,
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as resp:
                    if resp.status == 200:
                        return Response(body=await resp.read(), content_type=_JSON)
        if self.config.model:
            data = [
                {"id": self.config.model, "object": "model", "owned_by": "vllm", "root": self.config.model}
            ]
            return Response(body=orjson.dumps({"object": "list", "data": data}), content_type=_JSON)
        return _error(503, "no decode or colocated engine answered")

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
        if self.tracing is None:
            return await self._serve(request, path, chat, None)
        trace = self.tracing.request(path, request.headers.get("traceparent"))
        status = 499  # the client left (or the request was cancelled) before an answer
        try:
            answer = await self._serve(request, path, chat, trace)
            status = answer.status if isinstance(answer, Response) else 200
            return answer
        finally:
            trace.end(status)

    async def _serve(
        self, request: Request, path: str, chat: bool, trace: RequestTrace | None
    ) -> Response | Stream:
        started = time.monotonic()
        arrived_ns = time.time_ns() if trace is not None else 0
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
        prefills = self._usable(self.pool.routable(self.pool.prefill, started))
        decodes = self._usable(self.pool.routable(self.pool.decode, started))
        # Only engines of one revision exchange KV (rollout.py): a prefill needs a partner.
        revisions = {d.revision for d in decodes}
        candidates = [p for p in prefills if p.revision in revisions] + self.pool.routable(
            self.pool.colocated, started
        )
        exact, tokens = await self._exact_blocks(body, chat, candidates)
        if tokens is not None:
            prompt_tokens = len(tokens)
        first = self.policy.pick(candidates, prompt_tokens, hashes, exact)
        if first is not None and isinstance(self.policy, PrefixAware):
            self._count_cached(first, prompt_tokens, hashes, exact)
        if first is not None and first.role == ROLE_COLOCATED:
            prefill, decode = first, first  # colocated: one engine does both
        else:
            prefill = first
            if prefill is not None:
                decodes = self._partners(prefill, decodes)
            decode = self.decode_policy.pick(decodes, prompt_tokens)
        if prefill is None or decode is None:
            return self._reject(
                "no_backend", 503, "no ready prefill and decode backends, nor colocated engines"
            )
        lookup = None if decode is prefill else await self._look_up(decode, body, chat, prompt_tokens, tokens)
        if lookup is not None and lookup.outcome == "hit":
            # Decode loads the stored prefix and computes the rest: no prefill, so no
            # prefill queue to predict either.
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
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.inflight += 1
        self.idle.clear()
        job = _Job(self, request, path, chat, body, request_id, started)
        if trace is not None:
            job.trace = trace
            trace.root.set_attribute("pdcluster.request_id", request_id)
            trace.stage(
                "admission",
                arrived_ns,
                **{
                    "pdcluster.prompt_tokens": prompt_tokens,
                    "pdcluster.store": lookup.outcome if lookup else "",
                },
            )
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                return await job.run(None if prefill is decode else prefill, decode, prompt_tokens)
        except TimeoutError:
            self.metrics.requests["timeout"].inc()
            if job.response is not None:  # mid-stream: the status is sent already
                with contextlib.suppress(ConnectionError):
                    await job.response.write(
                        b"data: " + openai.error_body(504, "request timed out") + b"\n\ndata: [DONE]\n\n"
                    )
                    await job.response.write_eof()
                return job.response
            return _error(504, f"no answer within {self.config.request_timeout_s:g} s")
        except asyncio.CancelledError:
            self.metrics.requests["cancelled"].inc()
            raise
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()

    async def _route_again(
        self, body: dict[str, Any], chat: bool, avoid: set[str]
    ) -> tuple[Upstream | None, Upstream | None, int]:
        """(prefill, decode, prompt tokens) for another attempt, avoiding the engines that
        failed this request: a prefill and a decode, else a colocated engine (as decode,
        with no prefill), else decode alone, which computes the prompt itself."""
        now = time.monotonic()
        prompt = prompt_of(body, chat)
        tokens = count_tokens(prompt)
        hashes = block_hashes(prompt) if self.policy.needs_block_hashes else ()
        decodes = [u for u in self._usable(self.pool.routable(self.pool.decode, now)) if u.id not in avoid]
        decode = self.decode_policy.pick(decodes, tokens)
        engine = self.policy.pick(
            [u for u in self.pool.routable(self.pool.colocated, now) if u.id not in avoid], tokens, hashes
        )
        if engine is not None and (decode is None or not self.pool.prefill):
            self.policy.record(engine.id, hashes)
            return None, engine, tokens
        if decode is None:
            return None, None, tokens
        lookup = await self._look_up(decode, body, chat, tokens)
        if lookup is not None and lookup.outcome == "hit":
            return None, decode, lookup.prompt_tokens
        prefills = [
            p
            for p in self._usable(self.pool.routable(self.pool.prefill, now))
            if p.id not in avoid and p.revision == decode.revision
            and (self.prober is None or not self.prober.broken(p, decode))
        ]  # fmt: skip
        prefill = self.policy.pick(prefills, tokens, hashes)
        if prefill is None and engine is not None:
            self.policy.record(engine.id, hashes)
            return None, engine, tokens
        if prefill is not None:
            self.policy.record(prefill.id, hashes)
        return prefill, decode, tokens

    def _partners(self, prefill: Upstream, decodes: list[Upstream]) -> list[Upstream]:
        """Decode engines that can take this prefill's KV: its revision, and not a pair
        whose hand-off failed (unless every such pair has)."""
        same = [d for d in decodes if d.revision == prefill.revision]
        if self.prober is None:
            return same
        return [d for d in same if not self.prober.broken(prefill, d)] or same

    def _usable(self, upstreams: list[Upstream]) -> list[Upstream]:
        return upstreams if self.prober is None else self.prober.usable(upstreams)

    async def _exact_blocks(
        self, body: dict[str, Any], chat: bool, candidates: list[Upstream]
    ) -> tuple[ExactBlocks | None, list[int] | None]:
        """For the precise policy: the prompt's blocks as its engines hash them, and its
        token ids, from a candidate engine's /tokenize (none for a token-id prompt) within
        `exact_timeout_s`; (None, None) otherwise, and the policy guesses."""
        if self.engine_tokens is None or not self.policy.needs_exact_blocks or not candidates:
            return None, None
        outcomes = self.metrics.exact_blocks
        if "cache_salt" in body:  # it changes the engines' hashes
            outcomes["unsupported"].inc()
            return None, None
        # An engine whose facts are known costs one call (or none), a new one three.
        url = next((c.url for c in candidates if self.engine_tokens.known(c.url)), candidates[0].url)
        try:
            async with asyncio.timeout(self.config.exact_timeout_s):
                facts = await self.engine_tokens.facts_of(url)
                if facts is None:
                    outcomes["unsupported"].inc()
                    return None, None
                tokens = await self.engine_tokens.tokens(url, body, chat)
        except (UpstreamError, LookupFailed, TimeoutError, orjson.JSONDecodeError, KeyError, IndexError,
                TypeError, ValueError) as e:  # fmt: skip
            log.debug("no exact block hashes: %r", e)
            outcomes["error"].inc()
            return None, None
        outcomes["ok"].inc()
        digests = engine_block_hashes(tokens, facts.block_size, self.config.hash_seed)
        return ExactBlocks(facts.block_size, [block_id(d) for d in digests]), tokens

    def _count_cached(
        self, backend: Upstream, prompt_tokens: int, hashes: Any, exact: ExactBlocks | None
    ) -> None:
        policy = self.policy
        assert isinstance(policy, PrefixAware)
        cached = prompt_tokens - policy.uncached(backend.id, prompt_tokens, hashes, exact)
        precise = isinstance(policy, PreciseCache) and exact is not None and policy.index.live(backend.id)
        self.metrics.cached_prompt_tokens["events" if precise else "guess"].inc(cached)

    async def _look_up(
        self,
        decode: Upstream,
        body: dict[str, Any],
        chat: bool,
        estimate: int,
        tokens: list[int] | None = None,
    ) -> Lookup | None:
        if self.store is None:
            return None
        began = time.monotonic()
        lookup = await self.store.lookup(decode.url, body, chat, estimate, tokens)
        self.metrics.store_lookup_time.observe(time.monotonic() - began)
        self.metrics.store_lookups[lookup.outcome].inc()
        if lookup.outcome == "error":
            log.debug("store lookup failed: %s", lookup.reason)
        elif lookup.outcome == "hit":
            self.metrics.prefill_bypassed.inc()
            self.metrics.store_prefix_tokens.inc(lookup.stored_tokens)
        return lookup


class _Retry(Exception):
    """An attempt failed where another engine may succeed."""

    def __init__(self, role: str, upstream: Upstream, reason: str, mid_stream: bool = False):
        super().__init__(reason)
        self.role = role
        self.upstream = upstream
        self.reason = reason
        self.mid_stream = mid_stream


class _Refused(Exception):
    """An engine refused the request itself (e.g. too long for max_model_len): that is
    the client's answer, on any engine."""

    def __init__(self, response: Response):
        self.response = response


class _Job:
    """One client request across its attempts: what the next attempt sends, the stream
    once the client's answer has started, what it has delivered, the failures so far."""

    __slots__ = (
        "body", "chat", "failures", "last_token_at", "original", "path", "request", "request_id",
        "response", "resumed_tokens", "router", "sends_chat", "sent", "started", "tokens", "trace", "trail",
    )  # fmt: skip

    def __init__(
        self,
        router: Router,
        request: Request,
        path: str,
        chat: bool,
        body: dict[str, Any],
        request_id: str,
        started: float,
    ):
        self.router = router
        self.request = request
        self.path = path  # of the next attempt: a chat stream resumes as a completion
        self.chat = chat  # the client's request
        self.sends_chat = chat  # the next attempt's body
        self.original = body
        self.body = body  # a continuation once a stream has been resumed
        self.request_id = request_id
        self.started = started
        self.trail = (
            TokenTrail(client_wants_ids=bool(body.get("return_token_ids")), chat=chat)
            if router.config.resume_streams and resumable(body, chat)
            else None
        )
        self.response: Stream | None = None
        self.sent = False  # any event relayed to the client
        self.tokens = 0
        self.last_token_at = 0.0
        self.resumed_tokens = 0
        self.failures: list[str] = []
        self.trace: RequestTrace | None = None

    async def run(self, prefill: Upstream | None, decode: Upstream, prompt_tokens: int) -> Response | Stream:
        router = self.router
        avoid: set[str] = set()
        while True:
            flow = _Flow(self, prefill, decode, prompt_tokens)
            try:
                return await flow.run(f"xfer-{_ids.getrandbits(128):032x}")
            except _Refused as refused:
                if self.response is None:
                    router.metrics.requests["client_error"].inc()
                    return refused.response
                # A continuation refused: the client's request was fine; say why in the stream.
                self.failures.append(f"resumed request refused: {refused.response.body[:300]!r}")
                router.metrics.resumed["not_resumable"].inc()
                return await self._give_up()
            except _Retry as failure:
                retry = failure
            finally:
                flow.release()
            self.failures.append(retry.reason)
            avoid.add(retry.upstream.id)
            if retry.mid_stream and self.sent:
                continuation = self.trail.continuation(self.original) if self.trail is not None else None
                if continuation is None:
                    router.metrics.resumed["not_resumable"].inc()
                    return await self._give_up()
                assert self.trail is not None
                self.body, self.resumed_tokens = continuation, len(self.trail.generated)
                self.path, self.sends_chat = "/v1/completions", False
            if len(self.failures) >= router.config.max_attempts:
                return await self._give_up()
            prefill, decode_or_none, prompt_tokens = await router._route_again(
                self.body, self.sends_chat, avoid
            )
            if decode_or_none is None:
                return await self._give_up()
            decode = decode_or_none
            router.metrics.retries[retry.role].inc()
            if self.resumed_tokens and retry.mid_stream:
                router.metrics.resumed["resumed"].inc()
            log.info("request %s: %s; attempt %d", self.request_id, retry.reason, len(self.failures) + 1)

    async def _give_up(self) -> Response | Stream:
        metrics = self.router.metrics
        metrics.requests["upstream_error"].inc()
        message = f"every attempt failed ({len(self.failures)}): " + "; ".join(self.failures)
        log.warning("request %s: %s", self.request_id, message)
        if self.response is None:
            return _error(502, message)
        with contextlib.suppress(ConnectionError):
            await self.response.write(b"data: " + openai.error_body(502, message) + b"\n\ndata: [DONE]\n\n")
            await self.response.write_eof()
        return self.response


class _Flow:
    """One attempt: its prefill and decode exchanges (decode alone when the prompt's
    prefix is stored, or when no prefill is left to try: `prefill` is None), or one
    colocated engine's (`decode` is that engine, `prefill` None)."""

    __slots__ = (
        "_prefill_open", "colocated", "decode", "job", "kv_tokens", "prefill", "prefill_cached", "prefilled_at",
        "prompt_tokens",
    )  # fmt: skip

    def __init__(self, job: _Job, prefill: Upstream | None, decode: Upstream, prompt_tokens: int):
        self.job = job
        self.prefill = prefill
        self.decode = decode
        self.prompt_tokens = prompt_tokens
        self.prefilled_at: float | None = None
        # A colocated engine is weighed as a prefill is (prompt tokens not yet prefilled),
        # so that the policy and admission compare it with prefill ranks.
        self.colocated = decode.role == ROLE_COLOCATED
        self.prefill_cached: int | None = None  # the prefill leg's cached prompt tokens, reported to the client
        self.kv_tokens = (
            prompt_tokens
            if self.colocated
            else prompt_tokens + (openai.max_tokens_of(job.body, job.sends_chat) or DEFAULT_OUTPUT_TOKENS)
        )
        admission = job.router.admission
        first = prefill or (decode if self.colocated else None)
        if first is not None and admission is not None:
            admission.started(first.id, time.monotonic(), first.inflight_requests == 0)
        if prefill is not None:
            prefill.inflight_requests += 1
            prefill.inflight_tokens += prompt_tokens
        decode.inflight_requests += 1
        decode.inflight_tokens += self.kv_tokens
        self._prefill_open = prefill is not None

    def first_token(self) -> None:
        """A colocated engine's prompt is prefilled once its first token streams."""
        if not self.colocated or not self.kv_tokens:
            return
        self.decode.inflight_tokens -= self.kv_tokens
        self.kv_tokens = 0
        admission = self.job.router.admission
        if admission is not None:
            admission.completed(self.decode.id, self.prompt_tokens, time.monotonic())

    def prefill_done(self, ok: bool = False) -> None:
        if not self._prefill_open or self.prefill is None:
            return
        self._prefill_open = False
        self.prefill.inflight_requests -= 1
        self.prefill.inflight_tokens -= self.prompt_tokens
        admission = self.job.router.admission
        if ok and admission is not None:
            admission.completed(self.prefill.id, self.prompt_tokens, time.monotonic())

    def release(self) -> None:
        self.prefill_done()
        self.decode.inflight_requests -= 1
        self.decode.inflight_tokens -= self.kv_tokens

    def _failed(self, upstream: Upstream, reason: str, mid_stream: bool = False) -> _Retry:
        role = upstream.role
        metrics = self.job.router.metrics
        metrics.upstream_errors.labels(role, upstream.id).inc()
        if upstream.failed(time.monotonic()):
            metrics.circuit_opens.labels(role, upstream.id).inc()
        return _Retry(role, upstream, f"{role} {upstream.id}: {reason}", mid_stream)

    async def run(self, transfer_id: str) -> Response | Stream:
        trace = self.job.trace
        if trace is None:
            return await self._exchange(transfer_id, None)
        decode = trace.span(
            "decode", **{"pdcluster.engine": self.decode.id, "pdcluster.role": self.decode.role}
        )
        try:
            return await self._exchange(transfer_id, decode)
        except _Retry as failure:
            decode.set_attribute("pdcluster.failure", failure.reason)
            raise
        finally:
            trace.end_span(decode)

    async def _exchange(self, transfer_id: str, decode_span: Span | None) -> Response | Stream:
        job = self.job
        router = job.router
        trace = job.trace
        protocol = router.protocol
        body = job.body
        decode_body = body if job.trail is None else {**body, "return_token_ids": True}
        if self.prefill is None:
            decode_bytes = orjson.dumps(decode_body)  # plain: decode loads a stored prefix or computes
        else:
            engine = self.prefill.engine
            assert engine is not None
            prefill_bytes = orjson.dumps(protocol.prefill_body(body, transfer_id))
            decode_bytes = orjson.dumps(protocol.decode_body(decode_body, transfer_id, engine))
        path = job.path.encode()
        decode_headers = router.engine_headers(protocol.decode_headers(job.request_id))
        if trace is not None and decode_span is not None:
            decode_headers += trace.header(decode_span)
        decode_task = asyncio.get_running_loop().create_task(
            router.upstream.request(self.decode.origin, b"POST", path, decode_headers, decode_bytes)
        )
        prefilled_ns = 0
        try:
            if self.prefill is not None:
                prefill_headers = router.engine_headers(protocol.prefill_headers(job.request_id, engine))
                prefill_span = None
                if trace is not None:
                    prefill_span = trace.span("prefill", **{"pdcluster.engine": self.prefill.id})
                    prefill_headers += trace.header(prefill_span)
                try:
                    await self._run_prefill(path, prefill_bytes, prefill_headers)
                finally:
                    if trace is not None and prefill_span is not None:
                        trace.end_span(prefill_span)
                        prefilled_ns = time.time_ns()
            upstream = await self._await_decode(decode_task)
        except BaseException:
            _discard(decode_task)
            raise
        if trace is not None:
            answered_ns = time.time_ns()
            if prefilled_ns:
                trace.stage("kv_handoff", prefilled_ns, answered_ns)
        try:
            if upstream.status != 200:
                payload = await upstream.read()
                if upstream.status < 500 and upstream.status not in _NOT_THE_CLIENTS:
                    raise _Refused(Response(upstream.status, payload, _JSON))
                # Perhaps the KV could not be found: the prefill may have restarted
                # under a new engine_id.
                if self.prefill is not None:
                    router.pool.invalidate(self.prefill)
                raise self._failed(self.decode, f"HTTP {upstream.status}")
            if body.get("stream"):
                stream = await self._relay_stream(upstream)
                if trace is not None:
                    trace.stage("stream", answered_ns, **{"pdcluster.tokens": job.tokens})
                return stream
            return await self._relay_body(upstream)
        except UpstreamError as e:  # decode broke off mid-answer
            raise self._failed(self.decode, str(e), mid_stream=job.response is not None) from e
        finally:
            upstream.close()  # keeps a finished connection, drops an unfinished one

    async def _run_prefill(self, path: bytes, body: bytes, headers: bytes) -> None:
        router = self.job.router
        prefill = self.prefill
        assert prefill is not None
        timeout = router.config.prefill_timeout_s
        try:
            async with asyncio.timeout(timeout):
                response = await router.upstream.request(prefill.origin, b"POST", path, headers, body)
                try:
                    payload = await response.read()
                finally:
                    response.close()
        except UpstreamError as e:
            router.pool.invalidate(prefill)
            raise self._failed(prefill, str(e)) from e
        except TimeoutError as e:
            raise self._failed(prefill, f"no answer within {timeout:g} s") from e
        status = response.status
        if status == 200:
            self.prefilled_at = time.monotonic()
            self.prefill_cached = openai.cached_tokens(payload)
            prefill.succeeded()
            self.prefill_done(ok=True)
            return
        if status < 500 and status not in _NOT_THE_CLIENTS:
            raise _Refused(Response(status, payload, _JSON))
        raise self._failed(prefill, f"HTTP {status}")

    async def _await_decode(self, task: asyncio.Task[UpstreamResponse]) -> UpstreamResponse:
        try:
            return await self._unless_kv_lost(task)
        except UpstreamError as e:
            raise self._failed(self.decode, str(e)) from e

    async def _unless_kv_lost(self, work: Awaitable[T]) -> T:
        """`work`, unless the prefill holding this request's KV goes away first: a decode
        pulling from a dead prefill waits for it far longer than any client (vLLM 0.32's
        side channel: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s)."""
        if self.prefill is None:
            return await work
        task = asyncio.ensure_future(work)
        lost = asyncio.ensure_future(self.prefill.gone.wait())
        try:
            await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            lost.cancel()
        if not task.done():
            task.cancel()
            raise self._failed(self.prefill, "left before decode had its KV")
        return task.result()

    async def _relay_body(self, upstream: UpstreamResponse) -> Response:
        job = self.job
        payload = await upstream.read()
        metrics = job.router.metrics
        with contextlib.suppress(orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            metrics.generation_tokens.inc(orjson.loads(payload)["usage"]["completion_tokens"])
        metrics.e2e.observe(time.monotonic() - job.started)
        metrics.requests["ok"].inc()
        self.decode.succeeded()
        if self.prefill_cached is not None:
            payload = openai.report_cached_tokens(payload, self.prefill_cached)
        return Response(body=payload, content_type=_JSON)

    async def _relay_stream(self, upstream: UpstreamResponse) -> Stream:
        job = self.job
        metrics = job.router.metrics
        if job.response is None:
            job.response = job.request.stream(200, _SSE_HEADERS)
        response = job.response
        trail, resumed = job.trail, job.resumed_tokens
        failed = done = False
        try:
            await self._unless_kv_lost(upstream.first_bytes())
        except UpstreamError:
            pass  # the loop below reads the same error
        except _Retry as lost:
            lost.mid_stream = job.sent  # nothing of this attempt was sent
            raise
        async for chunk in upstream.iter_chunks():
            if trail is not None:
                chunk = trail.relay(chunk, continuation=resumed > 0)
                if resumed:
                    chunk = fix_usage(chunk, resumed)
                    if job.chat:
                        chunk = as_chat(chunk)
            if self.prefill_cached is not None:
                chunk = openai.report_cached_tokens_in_events(chunk, self.prefill_cached)
            events = chunk.count(b"data: ")
            if events:
                now = time.monotonic()
                # Not tokens: the chat role chunk, the usage chunk, [DONE], errors.
                ends = chunk.count(b"data: [DONE]")
                n = events - chunk.count(b'{"role":') - chunk.count(b'"choices":[]') - ends
                done = done or ends > 0
                if b'"error"' in chunk:
                    failed = True
                if n > 0:
                    self.first_token()
                    if job.tokens == 0:
                        metrics.ttft.observe(now - job.started)
                        if self.prefilled_at is not None:
                            metrics.prefill.observe(self.prefilled_at - job.started)
                            metrics.after_prefill.observe(now - self.prefilled_at)
                        gaps, gap = n - 1, 0.0
                    else:
                        gaps, gap = n, (now - job.last_token_at) / n
                    metrics.itl.observe(gap, gaps)
                    job.tokens += n
                    job.last_token_at = now
                job.sent = True
            try:
                await response.write(chunk)
            except ConnectionResetError:  # the client left; closing upstream aborts decode
                metrics.requests["cancelled"].inc()
                return response
        if not done and trail is not None:
            # Ended without [DONE]: an engine that died between two chunks.
            raise self._failed(self.decode, "the stream ended early", mid_stream=True)
        await response.write_eof()
        metrics.generation_tokens.inc(job.tokens)
        if failed:
            metrics.upstream_errors.labels("decode", self.decode.id).inc()
            metrics.requests["upstream_error"].inc()
        else:
            self.decode.succeeded()
            metrics.e2e.observe(time.monotonic() - job.started)
            metrics.requests["ok"].inc()
        return response


def _header_lines(headers: list[tuple[str, str]]) -> bytes:
    return "".join(f"{name}: {value}\r\n" for name, value in headers).encode()


def _engine_auth(config: RouterConfig) -> bytes:
    return f"Authorization: Bearer {config.engine_api_key}\r\n".encode() if config.engine_api_key else b""


def _discard(task: asyncio.Task[UpstreamResponse]) -> None:
    """Abandon a decode request: cancel it, or close its response to abort the engine."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        task.result().close()


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))
