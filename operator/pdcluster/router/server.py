"""The router's HTTP front: OpenAI-compatible endpoints in front of prefill/decode pools
and pools of colocated engines.

Per request: authorise and validate (here), route (routing.py: a prefill rank and its
decode partner, or a colocated engine), look the prompt up in the Mooncake store when it
is on (a prompt whose stored prefix leaves decode little to compute goes to decode
alone, store_hits.py), apply SLO admission, then run the request (attempt.py: the hand-off of
handoff.py, retries on engines not tried, streams resumed on another decode) and relay
decode's answer (relay.py). Retries route with the same function. A request with `n` > 1
or several prompts runs as one such request per prompt and choice, merged (fanout.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdcluster.router import openai
from pdcluster.router.attempt import Job, Services, ids
from pdcluster.router.failures import JSON, error
from pdcluster.router.fanout import FanOut
from pdcluster.router.fanout_merge import Flow, fan_out_size, split
from pdcluster.router.http_messages import Request, Response, Stream
from pdcluster.router.kvevents import block_id
from pdcluster.router.membership import Upstream
from pdcluster.router.policy import Admission, ExactBlocks, LeastLoaded, Policy
from pdcluster.router.probe import KvProber
from pdcluster.router.prompt import block_hashes, count_tokens, prompt_of
from pdcluster.router.routing import Engines, Prompt, Route, route
from pdcluster.router.store_hits import EngineTokens, Lookup, LookupFailed, Outcome, StoreIndex
from pdcluster.router.upstream import UpstreamError, UpstreamPool
from pdcluster.vllm.hashing import engine_block_hashes

if TYPE_CHECKING:
    from pdcluster.router.tracing import RequestTrace, Tracing

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_NO_BACKEND = "no ready prefill and decode backends, nor colocated engines"


@dataclass(frozen=True)
class _Planned:
    """A first attempt's route, once looked up and admitted."""

    route: Route
    prompt_tokens: int
    lookup: Lookup | None


class Router:
    def __init__(
        self,
        services: Services,
        session: aiohttp.ClientSession,
        policy: Policy,
        *,
        store: StoreIndex | None = None,
        prober: KvProber | None = None,
        tracing: Tracing | None = None,
    ):
        self.services = services
        self.config = config = services.config
        self.pool = services.pool
        self.metrics = services.metrics
        self.session = session  # for the odd non-generate call (/v1/models)
        self.policy = policy
        self.decode_policy = LeastLoaded()
        self.store = store
        # A prompt's token ids and its engines' block facts: for the store's lookups and
        # for the precise policy's exact block hashes.
        self.engine_tokens = (
            store.engines
            if store is not None
            else EngineTokens(UpstreamPool(), services.engines.auth_lines)
            if policy.needs_exact_blocks
            else None
        )
        self.prober = prober
        self.tracing = tracing
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

    @property
    def admission(self) -> Admission | None:
        return self.services.admission

    def forget(self, backend_id: str) -> None:
        """A backend left (or restarted): drop what was known about it."""
        self.policy.forget(backend_id)
        if self.store is not None:
            self.store.forget(backend_id)
        if self.admission is not None:
            self.admission.forget(backend_id)
        self.metrics.forget(backend_id)

    async def handle(self, request: Request) -> Response | Stream:
        """The HTTP server's one handler: route by path and method."""
        routes = self._routes.get(request.path)
        if routes is None:
            return error(404, f"no route {request.path}")
        handler = routes.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            return error(405, f"{request.method} is not allowed on {request.path}")
        return await handler(request)

    # ------------------------------------------------------------------ plain routes
    async def health(self, request: Request) -> Response:
        return Response(body=b"ok")

    async def ready(self, request: Request) -> Response:
        if self.draining:
            return Response(503, b"draining")
        if not self.pool.ready:
            return Response(503, _NO_BACKEND.encode())
        return Response(body=b"ready")

    async def prometheus(self, request: Request) -> Response:
        return Response(body=generate_latest(self.metrics.registry), content_type=CONTENT_TYPE_LATEST)

    async def backends(self, request: Request) -> Response:
        view = self.pool.describe()
        index = self.policy.kv_index
        if index is not None:
            for backend in [*view["prefill"], *view["colocated"]]:
                backend["kv_events"] = {"live": index.live(backend["id"]), "blocks": index.blocks(backend["id"])}
        return Response(body=orjson.dumps(view), content_type=JSON)

    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return error(401, "invalid or missing API key")
        for upstream in [*self.pool.decode, *self.pool.colocated]:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.session.get(
                    f"{upstream.url}/v1/models",
                    headers=self.services.engines.auth,
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as resp:
                    if resp.status == 200:
                        return Response(body=await resp.read(), content_type=JSON)
        if self.config.model:
            data = [
                {"id": self.config.model, "object": "model", "owned_by": "vllm", "root": self.config.model}
            ]
            return Response(body=orjson.dumps({"object": "list", "data": data}), content_type=JSON)
        return error(503, "no decode or colocated engine answered")

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
        return error(status, message, headers=headers)

    def _client_error(self, status: int, message: str, param: str | None = None) -> Response:
        self.metrics.requests["client_error"].inc()
        return error(status, message, param)

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
        body = self._valid_body(request, chat)
        if isinstance(body, Response):
            return body
        if fan_out_size(body, chat) > 1:
            return await self._fan_out(request, path, chat, body, started, trace)
        planned = await self._plan(body, chat, started)
        if isinstance(planned, Response):
            return planned
        request_id = _request_id(request)
        self.metrics.prompt_tokens.inc(planned.prompt_tokens)
        job = Job(self.services, request, path, chat, body, request_id, started, trace)
        if trace is not None:
            trace.root.set_attribute("pdcluster.request_id", request_id)
            lookup = planned.lookup.outcome if planned.lookup is not None else ""
            attributes = {"pdcluster.prompt_tokens": planned.prompt_tokens, "pdcluster.store": lookup}
            trace.stage("admission", arrived_ns, **attributes)
        return await self._run(job, planned)

    def _valid_body(self, request: Request, chat: bool) -> dict[str, Any] | Response:
        """The request's body, or the answer refusing it."""
        if self.draining:
            # Served, then the connection closed: it is a kept-alive one (the Service sends
            # no new connection to a terminating pod), and the client's next request opens
            # one to another router. A 503 here lost it (as Go's Server.Shutdown and nginx
            # finish what arrives on open connections and close them).
            request.keep_alive = False
        if not self._authorized(request):
            return self._reject("unauthorized", 401, "invalid or missing API key")
        body, why = openai.parse_json(request.body)
        if body is None:
            return self._client_error(400, why or "bad request")
        problem = openai.check_request(body, chat)
        if problem:
            return self._client_error(400, *problem)
        model = body.get("model")
        if self.config.model and model is not None and model != self.config.model:
            return self._client_error(404, f"The model `{model}` does not exist.", "model")
        flows = fan_out_size(body, chat)
        if flows > self.config.max_fan_out:
            return self._client_error(
                400,
                f"this request needs {flows} prefill/decode flows (one per prompt and choice: n times the "
                f"prompts); the router takes at most {self.config.max_fan_out} (router.maxFanOut, --max-fan-out)",
                "n",
            )
        body.pop("kv_transfer_params", None)  # only the router decides where KV goes
        return body

    async def _run(self, job: Job, planned: _Planned) -> Response | Stream:
        """The job's attempts, within the request timeout, counted in flight for a drain."""
        with self._in_flight():
            try:
                async with asyncio.timeout(self.config.request_timeout_s):
                    return await job.run(planned.route, planned.prompt_tokens, self._reroute)
            except TimeoutError:
                self.metrics.requests["timeout"].inc()
                if job.response is not None:  # mid-stream: the status is sent already
                    await job.end_stream(504, "request timed out")
                    return job.response
                return error(504, f"no answer within {self.config.request_timeout_s:g} s")
            except asyncio.CancelledError:
                self.metrics.requests["cancelled"].inc()
                raise

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        """A request counted in flight, for a drain to wait on."""
        self.inflight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()

    async def _fan_out(
        self, request: Request, path: str, chat: bool, body: dict[str, Any], started: float,
        trace: RequestTrace | None,
    ) -> Response | Stream:  # fmt: skip
        """`n` > 1 or several prompts: one job per prompt and choice, each routed when it
        starts and retried as a request of its own, their answers merged (fanout.py)."""
        flows = split(body, chat)
        request_id = _request_id(request)
        if trace is not None:
            trace.root.set_attribute("pdcluster.request_id", request_id)
            trace.root.set_attribute("pdcluster.flows", len(flows))
        fan = FanOut(request, flows, ("chatcmpl-" if chat else "cmpl-") + request_id, bool(body.get("stream")))

        def flow_of(k: int, flow: Flow) -> Callable[[], Awaitable[Response | Stream]]:
            async def run() -> Response | Stream:
                planned = await self._plan(flow.body, chat, time.monotonic())
                if isinstance(planned, Response):
                    return planned
                self.metrics.prompt_tokens.inc(planned.prompt_tokens)
                flow_id = f"{request_id}-{flow.index}"  # the engines' request id: one per flow
                job = Job(self.services, fan.sink(k), path, chat, flow.body, flow_id, started, trace)
                fan.started(flow, job, planned.route)
                return await job.run(planned.route, planned.prompt_tokens, self._reroute)

            return run

        jobs = [flow_of(k, flow) for k, flow in enumerate(flows)]
        with self._in_flight():
            try:
                async with asyncio.timeout(self.config.request_timeout_s):
                    return await fan.run(jobs)
            except TimeoutError:
                self.metrics.requests["timeout"].inc()
                return await fan.fail(504, f"no answer within {self.config.request_timeout_s:g} s")
            except asyncio.CancelledError:
                self.metrics.requests["cancelled"].inc()
                raise

    # ------------------------------------------------------------------ routing
    async def _plan(self, body: dict[str, Any], chat: bool, now: float) -> _Planned | Response:
        """The first attempt's route, or the answer refusing the request."""
        text = prompt_of(body, chat)
        hashes = block_hashes(text) if self.policy.needs_block_hashes else ()
        engines = self._engines(now)
        exact, token_ids = await self._exact_blocks(body, chat, [*engines.prefill, *engines.colocated])
        prompt = Prompt(len(token_ids) if token_ids is not None else count_tokens(text), hashes, exact)
        local = self.config.prefill_on_decode_below
        chosen = route(engines, prompt, self.policy, self.decode_policy, self._broken, prefill_on_decode_below=local)
        if chosen is None:
            return self._reject("no_backend", 503, _NO_BACKEND)
        if chosen.prefill is None and not chosen.colocated:
            self.metrics.local_prefills.inc()  # a short prompt: its decode engine prefills it
        else:
            self._count_cached(chosen.engine, prompt)
        chosen, prompt_tokens, lookup = await self._look_up(chosen, body, chat, prompt.tokens, token_ids)
        if chosen.prefill is not None or chosen.colocated:
            admitted = self._admit(chosen.engine, prompt_tokens)
            if admitted is not None:
                return admitted
            self.policy.record(chosen.engine.id, hashes)
        return _Planned(chosen, prompt_tokens, lookup)

    def _admit(self, engine: Upstream, prompt_tokens: int) -> Response | None:
        """SLO admission on the prefilling engine: None, or the 429 refusing the request."""
        if self.admission is None:
            return None
        verdict = self.admission.decide(engine, prompt_tokens)
        if verdict.admitted:
            return None
        message = f"predicted time to first token {verdict.predicted_ttft_ms:.0f} ms exceeds the SLO"
        return self._reject("slo", 429, message, [("Retry-After", str(verdict.retry_after_s))])

    async def _reroute(self, body: dict[str, Any], chat: bool, tried: set[str]) -> tuple[Route | None, int]:
        """Another attempt's route, avoiding the engines that failed this request; decode
        alone, computing the prompt itself, when no prefill or colocated engine is left."""
        text = prompt_of(body, chat)
        prompt = Prompt(count_tokens(text), block_hashes(text) if self.policy.needs_block_hashes else ())
        engines = self._engines(time.monotonic()).without(tried)
        chosen = route(
            engines, prompt, self.policy, self.decode_policy, self._broken, decode_alone=True,
            prefill_on_decode_below=self.config.prefill_on_decode_below,
        )  # fmt: skip
        if chosen is None:
            return None, prompt.tokens
        chosen, prompt_tokens, _ = await self._look_up(chosen, body, chat, prompt.tokens, None)
        if chosen.prefill is not None or chosen.colocated:
            self.policy.record(chosen.engine.id, prompt.hashes)
        return chosen, prompt_tokens

    def _engines(self, now: float) -> Engines:
        pool = self.pool
        return Engines(
            pool.routable(self._usable(pool.prefill), now),
            pool.routable(self._usable(pool.decode), now),
            pool.routable(pool.colocated, now),
        )

    def _usable(self, upstreams: list[Upstream]) -> list[Upstream]:
        return upstreams if self.prober is None else self.prober.usable(upstreams)

    def _broken(self, prefill: Upstream, decode: Upstream) -> bool:
        return self.prober is not None and self.prober.broken(prefill, decode)

    def _count_cached(self, engine: Upstream, prompt: Prompt) -> None:
        cached = self.policy.cached(engine, prompt.tokens, prompt.hashes, prompt.exact)
        if cached is not None:
            self.metrics.cached_prompt_tokens["events" if cached.from_events else "guess"].inc(cached.tokens)

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

    async def _look_up(
        self, chosen: Route, body: dict[str, Any], chat: bool, estimate: int, tokens: list[int] | None
    ) -> tuple[Route, int, Lookup | None]:
        """The route once the store is asked: decode alone when it holds the prompt's
        prefix (no prefill, so no prefill queue to predict either); the prompt's tokens."""
        if self.store is None or chosen.prefill is None:
            return chosen, estimate, None
        began = time.monotonic()
        lookup = await self.store.lookup(chosen.decode.url, body, chat, estimate, tokens)
        self.metrics.store_lookup_time.observe(time.monotonic() - began)
        self.metrics.store_lookups[lookup.outcome].inc()
        if lookup.outcome is Outcome.error:
            log.debug("store lookup failed: %s", lookup.reason)
        if lookup.outcome is not Outcome.hit:
            return chosen, estimate, lookup
        self.metrics.prefill_bypassed.inc()
        self.metrics.store_prefix_tokens.inc(lookup.stored_tokens)
        return Route(None, chosen.decode), lookup.prompt_tokens, lookup


def _request_id(request: Request) -> str:
    """The client's X-Request-Id when it is a sane one, else a new id."""
    header_id = request.headers.get("x-request-id")
    return header_id if header_id and _REQUEST_ID.fullmatch(header_id) else f"{ids.getrandbits(128):032x}"
