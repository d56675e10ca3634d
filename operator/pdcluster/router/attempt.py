"""One client request across its attempts (`Job`), and one attempt (`Attempt`): its
prefill and decode exchanges, or one engine's. An attempt that fails where another engine
may succeed raises `Retry`; the job routes again (routing.py), avoiding the engines that
failed it, at most `max_attempts` times in all; a stream that broke off mid-answer goes
on from another decode (resume.py). Relaying the answer is relay.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pdcluster.router import openai
from pdcluster.router.config import RouterConfig
from pdcluster.router.engines import EngineClient
from pdcluster.router.failures import JSON, Refused, Retry, error
from pdcluster.router.handoff import Handoff, discard
from pdcluster.router.http_messages import Request, Response, Stream
from pdcluster.router.membership import Pool, Upstream
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.policy import Admission
from pdcluster.router.protocol import MooncakeProtocol
from pdcluster.router.relay import relay_body, relay_stream
from pdcluster.router.resume import TokenTrail, resumable
from pdcluster.router.routing import Route
from pdcluster.router.upstream import Response as UpstreamResponse
from pdcluster.router.upstream import UpstreamError

if TYPE_CHECKING:
    from pdcluster.router.tracing import RequestTrace, Span

log = logging.getLogger(__name__)
T = TypeVar("T")

# When a request does not bound its output, assume this many tokens for decode load.
DEFAULT_OUTPUT_TOKENS = 256
# An engine refusing the router's credentials is the deployment's fault, not the client's.
_NOT_THE_CLIENTS = (401, 403)
# Request and transfer ids need only be unique: a generator seeded from os.urandom
# costs no system call per id.
ids = random.Random()


@dataclass(frozen=True)
class Services:
    """What attempts use of the router."""

    config: RouterConfig
    engines: EngineClient
    protocol: MooncakeProtocol
    metrics: RouterMetrics
    admission: Admission | None
    pool: Pool


# Another route for a job, avoiding the engines tried: (route or None, prompt tokens).
Reroute = Callable[[dict[str, Any], bool, set[str]], Awaitable[tuple[Route | None, int]]]


class Lease:
    """The load an attempt puts on its engines' counters (what the policies weigh):
    prompt tokens not yet prefilled on the prefilling engine, KV tokens on decode. A
    colocated engine is weighed as a prefill is, so that the policy and admission compare
    it with prefill ranks. Each part is given back once."""

    __slots__ = ("_prefill_open", "admission", "kv_tokens", "prompt_tokens", "route")

    def __init__(self, route: Route, prompt_tokens: int, output_tokens: int, admission: Admission | None):
        self.route = route
        self.prompt_tokens = prompt_tokens
        self.admission = admission
        self.kv_tokens = prompt_tokens if route.colocated else prompt_tokens + output_tokens
        first = route.prefill or (route.decode if route.colocated else None)
        if first is not None and admission is not None:
            admission.started(first.id, time.monotonic(), first.inflight_requests == 0)
        if route.prefill is not None:
            route.prefill.inflight_requests += 1
            route.prefill.inflight_tokens += prompt_tokens
        route.decode.inflight_requests += 1
        route.decode.inflight_tokens += self.kv_tokens
        self._prefill_open = route.prefill is not None

    def first_token(self) -> None:
        """A colocated engine's prompt is prefilled once its first token streams."""
        if not self.route.colocated or not self.kv_tokens:
            return
        self.route.decode.inflight_tokens -= self.kv_tokens
        self.kv_tokens = 0
        if self.admission is not None:
            self.admission.completed(self.route.decode.id, self.prompt_tokens, time.monotonic())

    def prefill_done(self, ok: bool = False) -> None:
        prefill = self.route.prefill
        if not self._prefill_open or prefill is None:
            return
        self._prefill_open = False
        prefill.inflight_requests -= 1
        prefill.inflight_tokens -= self.prompt_tokens
        if ok and self.admission is not None:
            self.admission.completed(prefill.id, self.prompt_tokens, time.monotonic())

    def release(self) -> None:
        self.prefill_done()
        self.route.decode.inflight_requests -= 1
        self.route.decode.inflight_tokens -= self.kv_tokens


class Job:
    """One client request across its attempts: what the next attempt sends, the stream
    once the client's answer has started, what it has delivered, the failures so far."""

    __slots__ = (
        "body", "chat", "failures", "first_token_at", "last_token_at", "original", "path", "prefilled", "request",
        "request_id", "response", "resumed_tokens", "sends_chat", "sent", "services", "started", "tokens", "trace",
        "trail",
    )  # fmt: skip

    def __init__(
        self,
        services: Services,
        request: Request,
        path: str,
        chat: bool,
        body: dict[str, Any],
        request_id: str,
        started: float,
        trace: RequestTrace | None = None,
    ):
        self.services = services
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
            if services.config.resume_streams and resumable(body, chat)
            else None
        )
        self.response: Stream | None = None
        self.sent = False  # any event relayed to the client
        self.tokens = 0
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.resumed_tokens = 0
        self.failures: list[str] = []
        self.trace = trace
        self.prefilled: asyncio.Event | None = None  # set once a prefill leg has succeeded (fanout.py)

    async def run(self, route: Route, prompt_tokens: int, reroute: Reroute) -> Response | Stream:
        metrics = self.services.metrics
        tried: set[str] = set()
        while True:
            attempt = Attempt(self, route, prompt_tokens)
            try:
                return await attempt.run(f"xfer-{ids.getrandbits(128):032x}")
            except Refused as refused:
                return await self._refused(refused)
            except Retry as failure:
                retry = failure
            finally:
                attempt.lease.release()
            self.failures.append(retry.reason)
            tried.add(retry.upstream.id)
            if retry.mid_stream and self.sent and not self._resume():
                metrics.resumed["not_resumable"].inc()
                return await self.give_up()
            if len(self.failures) >= self.services.config.max_attempts:
                return await self.give_up()
            next_route, prompt_tokens = await reroute(self.body, self.sends_chat, tried)
            if next_route is None:
                return await self.give_up()
            route = next_route
            metrics.retries[retry.upstream.role].inc()
            if self.resumed_tokens and retry.mid_stream:
                metrics.resumed["resumed"].inc()
            log.info("request %s: %s; attempt %d", self.request_id, retry.reason, len(self.failures) + 1)

    def _resume(self) -> bool:
        """Make the next attempt a continuation of what the client has received."""
        continuation = self.trail.continuation(self.original) if self.trail is not None else None
        if continuation is None:
            return False
        assert self.trail is not None
        self.body, self.resumed_tokens = continuation, len(self.trail.generated)
        self.path, self.sends_chat = "/v1/completions", False
        return True

    async def _refused(self, refused: Refused) -> Response | Stream:
        if self.response is None:
            self.services.metrics.requests["client_error"].inc()
            return refused.response
        # A continuation refused: the client's request was fine; say why in the stream.
        self.failures.append(f"resumed request refused: {refused.response.body[:300]!r}")
        self.services.metrics.resumed["not_resumable"].inc()
        return await self.give_up()

    async def give_up(self) -> Response | Stream:
        self.services.metrics.requests["upstream_error"].inc()
        message = f"every attempt failed ({len(self.failures)}): " + "; ".join(self.failures)
        log.warning("request %s: %s", self.request_id, message)
        if self.response is None:
            return error(502, message)
        await self.end_stream(502, message)
        return self.response

    async def end_stream(self, status: int, message: str) -> None:
        """End a stream already started with an error event: its status is sent."""
        assert self.response is not None
        with contextlib.suppress(ConnectionError):
            await self.response.write(b"data: " + openai.error_body(status, message) + b"\n\ndata: [DONE]\n\n")
            await self.response.write_eof()


class Attempt:
    """One attempt on one route: prefill and decode exchanges, or decode alone (the
    prompt's prefix is stored, or no prefill is left), or a colocated engine."""

    __slots__ = (
        "decode", "job", "lease", "prefill", "prefill_cached", "prefill_compute_s", "prefilled_at", "services",
    )  # fmt: skip

    def __init__(self, job: Job, route: Route, prompt_tokens: int):
        self.job = job
        self.services = job.services
        self.prefill = route.prefill
        self.decode = route.decode
        self.prefilled_at: float | None = None
        self.prefill_cached: int | None = None  # the prefill leg's cached prompt tokens, reported to the client
        self.prefill_compute_s: float | None = None  # the prefill engine's own compute for the prompt
        output_tokens = openai.max_tokens_of(job.body, job.sends_chat) or DEFAULT_OUTPUT_TOKENS
        self.lease = Lease(route, prompt_tokens, output_tokens, self.services.admission)

    def failed(self, upstream: Upstream, reason: str, mid_stream: bool = False) -> Retry:
        role = upstream.role
        metrics = self.services.metrics
        metrics.upstream_errors.labels(role, upstream.id).inc()
        if upstream.failed(time.monotonic()):
            metrics.circuit_opens.labels(role, upstream.id).inc()
        return Retry(upstream, f"{role} {upstream.id}: {reason}", mid_stream)

    async def run(self, transfer_id: str) -> Response | Stream:
        trace = self.job.trace
        if trace is None:
            return await self._exchange(transfer_id, None)
        decode = trace.span(
            "decode", **{"pdcluster.engine": self.decode.id, "pdcluster.role": self.decode.role}
        )
        try:
            return await self._exchange(transfer_id, decode)
        except Retry as failure:
            decode.set_attribute("pdcluster.failure", failure.reason)
            raise
        finally:
            trace.end_span(decode)

    async def _exchange(self, transfer_id: str, decode_span: Span | None) -> Response | Stream:
        job = self.job
        handoff = Handoff(self.services.engines, self.services.protocol, job.path.encode(), job.request_id)
        decode_body = job.body if job.trail is None else {**job.body, "return_token_ids": True}
        source = self.prefill.engine if self.prefill is not None else None
        traced = job.trace.header(decode_span) if job.trace is not None and decode_span is not None else b""
        decode_task = handoff.send_decode(self.decode, decode_body, transfer_id, source, traced)
        try:
            prefilled_ns = await self._traced_prefill(handoff, transfer_id) if self.prefill is not None else 0
            upstream = await self._await_decode(decode_task)
        except BaseException:
            discard(decode_task)
            raise
        answered_ns = time.time_ns()
        if job.trace is not None and prefilled_ns:
            job.trace.stage("kv_handoff", prefilled_ns, answered_ns)
        try:
            if upstream.status != 200:
                await self._decode_refused(upstream)
            if not job.body.get("stream"):
                return await relay_body(self, upstream)
            stream = await relay_stream(self, upstream)
            if job.trace is not None:
                job.trace.stage("stream", answered_ns, **{"pdcluster.tokens": job.tokens})
            return stream
        except UpstreamError as e:  # decode broke off mid-answer
            raise self.failed(self.decode, str(e), mid_stream=job.response is not None) from e
        finally:
            upstream.close()  # keeps a finished connection, drops an unfinished one

    async def _decode_refused(self, upstream: UpstreamResponse) -> None:
        payload = await upstream.read()
        if upstream.status < 500 and upstream.status not in _NOT_THE_CLIENTS:
            raise Refused(Response(upstream.status, payload, JSON))
        # Perhaps the KV could not be found: the prefill may have restarted under a new engine_id.
        if self.prefill is not None:
            self.services.pool.invalidate(self.prefill)
        raise self.failed(self.decode, f"HTTP {upstream.status}")

    async def _traced_prefill(self, handoff: Handoff, transfer_id: str) -> int:
        """The prefill leg, in its own span when traced; when it ended (ns), if traced."""
        trace = self.job.trace
        if trace is None:
            await self._run_prefill(handoff, transfer_id, b"")
            return 0
        assert self.prefill is not None
        span = trace.span("prefill", **{"pdcluster.engine": self.prefill.id})
        try:
            await self._run_prefill(handoff, transfer_id, trace.header(span))
        finally:
            trace.end_span(span)
        return time.time_ns()

    async def _run_prefill(self, handoff: Handoff, transfer_id: str, extra_headers: bytes) -> None:
        prefill = self.prefill
        assert prefill is not None
        timeout = self.services.config.prefill_timeout_s
        try:
            async with asyncio.timeout(timeout):
                status, payload = await handoff.send_prefill(prefill, self.job.body, transfer_id, extra_headers)
        except UpstreamError as e:
            self.services.pool.invalidate(prefill)
            raise self.failed(prefill, str(e)) from e
        except TimeoutError as e:
            raise self.failed(prefill, f"no answer within {timeout:g} s") from e
        if status == 200:
            self.prefilled_at = time.monotonic()
            self.prefill_cached = openai.cached_tokens(payload)
            self.prefill_compute_s = openai.prefill_compute_s(payload)
            prefill.succeeded()
            self.lease.prefill_done(ok=True)
            if self.job.prefilled is not None:
                self.job.prefilled.set()
            return
        if status < 500 and status not in _NOT_THE_CLIENTS:
            raise Refused(Response(status, payload, JSON))
        raise self.failed(prefill, f"HTTP {status}")

    async def _await_decode(self, task: asyncio.Task[UpstreamResponse]) -> UpstreamResponse:
        try:
            return await self.unless_kv_lost(task)
        except UpstreamError as e:
            raise self.failed(self.decode, str(e)) from e

    async def unless_kv_lost(self, work: Awaitable[T]) -> T:
        """`work`, unless the prefill holding this request's KV goes away first: a decode
        pulling from a dead prefill waits for it far longer than any client (vLLM's
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
            raise self.failed(self.prefill, "left before decode had its KV")
        return task.result()
