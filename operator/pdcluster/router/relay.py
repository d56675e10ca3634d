"""Relaying decode's answer to the client: a body as it came, a stream as the engine
wrote it, less the token ids the router asked for to resume it (resume.py). The router
counts SSE events in a stream for its metrics: one `data:` event per token, as vLLM
streams without speculative decoding."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import orjson

from pdcluster.router import openai
from pdcluster.router.failures import JSON, Retry
from pdcluster.router.http_messages import Response, Stream
from pdcluster.router.resume import as_chat, fix_usage
from pdcluster.router.upstream import Response as UpstreamResponse
from pdcluster.router.upstream import UpstreamError

if TYPE_CHECKING:
    from pdcluster.router.attempt import Attempt

SSE_HEADERS = [("Content-Type", "text/event-stream; charset=utf-8"), ("Cache-Control", "no-cache")]


async def relay_body(attempt: Attempt, upstream: UpstreamResponse) -> Response:
    job = attempt.job
    payload = await upstream.read()
    metrics = attempt.services.metrics
    # An answer without usage still goes to the client as it is.
    with contextlib.suppress(orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        metrics.generation_tokens.inc(orjson.loads(payload)["usage"]["completion_tokens"])
    metrics.e2e.observe(time.monotonic() - job.started)
    metrics.requests["ok"].inc()
    attempt.decode.succeeded()
    if attempt.prefill_cached is not None:
        payload = openai.report_cached_tokens(payload, attempt.prefill_cached)
    return Response(body=payload, content_type=JSON)


async def relay_stream(attempt: Attempt, upstream: UpstreamResponse) -> Stream:
    job = attempt.job
    if job.response is None:
        job.response = job.request.stream(200, SSE_HEADERS)
    response = job.response
    try:
        await attempt.unless_kv_lost(upstream.first_bytes())
    except UpstreamError:
        pass  # the loop below reads the same error
    except Retry as lost:
        lost.mid_stream = job.sent  # nothing of this attempt was sent
        raise
    counter = _EventCounter(attempt)
    async for chunk in upstream.iter_chunks():
        chunk = _for_client(attempt, chunk)
        counter.count(chunk)
        try:
            await response.write(chunk)
        except ConnectionResetError:  # the client left; closing upstream aborts decode
            attempt.services.metrics.requests["cancelled"].inc()
            return response
    if not counter.done and job.trail is not None:
        # Ended without [DONE]: an engine that died between two chunks.
        raise attempt.failed(attempt.decode, "the stream ended early", mid_stream=True)
    await response.write_eof()
    _count_finished(attempt, counter.failed)
    return response


def _for_client(attempt: Attempt, chunk: bytes) -> bytes:
    """The engine's events as the client is to see them."""
    job = attempt.job
    if job.trail is not None:
        chunk = job.trail.relay(chunk, continuation=job.resumed_tokens > 0)
        if job.resumed_tokens:
            chunk = fix_usage(chunk, job.resumed_tokens)
            if job.chat:
                chunk = as_chat(chunk)
    if attempt.prefill_cached is not None:
        chunk = openai.report_cached_tokens_in_events(chunk, attempt.prefill_cached)
    return chunk


class _EventCounter:
    """Tokens, TTFT and ITL from the events of one attempt's stream."""

    __slots__ = ("attempt", "done", "failed")

    def __init__(self, attempt: Attempt):
        self.attempt = attempt
        self.done = False
        self.failed = False

    def count(self, chunk: bytes) -> None:
        events = chunk.count(b"data: ")
        if not events:
            return
        job = self.attempt.job
        # Not tokens: the chat role chunk, the usage chunk, [DONE], errors.
        ends = chunk.count(b"data: [DONE]")
        tokens = events - chunk.count(b'{"role":') - chunk.count(b'"choices":[]') - ends
        self.done = self.done or ends > 0
        self.failed = self.failed or b'"error"' in chunk
        if tokens > 0:
            self._tokens(tokens, time.monotonic())
        job.sent = True

    def _tokens(self, n: int, now: float) -> None:
        attempt, job = self.attempt, self.attempt.job
        metrics = attempt.services.metrics
        attempt.lease.first_token()
        if job.tokens == 0:
            job.first_token_at = now
            metrics.ttft.observe(now - job.started)
            if attempt.prefilled_at is not None:
                metrics.prefill.observe(attempt.prefilled_at - job.started)
                metrics.after_prefill.observe(now - attempt.prefilled_at)
            beyond = _ttft_beyond_prefill(attempt, now - job.started)
            if beyond is not None:
                metrics.ttft_beyond_prefill.observe(beyond)
            gaps, gap = n - 1, 0.0
        else:
            gaps, gap = n, (now - job.last_token_at) / n
        metrics.itl.observe(gap, gaps)
        job.tokens += n
        job.last_token_at = now


def _ttft_beyond_prefill(attempt: Attempt, ttft_s: float) -> float | None:
    """The TTFT less the prompt's own prefill compute (docs/metrics.md): a prompt served
    from the store, or short enough for decode to prefill, counts whole; None where the
    prefill engine did not say (engines without per-request metrics) and on a colocated
    engine, which says only when the stream ends."""
    if attempt.prefill is not None:
        own = attempt.prefill_compute_s
        return None if own is None else max(ttft_s - own, 0.0)
    return None if attempt.decode.role == "colocated" else ttft_s


def _count_finished(attempt: Attempt, failed: bool) -> None:
    job, metrics = attempt.job, attempt.services.metrics
    metrics.generation_tokens.inc(job.tokens)
    if failed:
        metrics.upstream_errors.labels("decode", attempt.decode.id).inc()
        metrics.requests["upstream_error"].inc()
    else:
        attempt.decode.succeeded()
        metrics.e2e.observe(time.monotonic() - job.started)
        metrics.requests["ok"].inc()
        if job.tokens > 1:
            metrics.tpot.observe((job.last_token_at - job.first_token_at) / (job.tokens - 1))
