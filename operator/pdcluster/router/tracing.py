"""OpenTelemetry traces of the router's requests (`--otlp-traces-endpoint`), off by default.

Each request is a trace: a root SERVER span `router <path>` (continuing the client's W3C
`traceparent` when it sent one, and following its sampled flag) and, per attempt, the
spans of its stages:
- `admission`: from arrival to dispatch (policy, exact block hashes, store lookup, SLO);
- `prefill`: the prefill engine's exchange;
- `kv_handoff`: from prefill's answer to decode's first byte (decode loading the KV);
- `decode`: the decode (or colocated) engine's exchange, from dispatch to its end;
- `stream`: from decode's first byte to the last one relayed to the client.
The `prefill` and `decode` spans travel to their engines as `traceparent` headers, so
vLLM (`--otlp-traces-endpoint`, vllm/tracing/otel.py) makes its own request spans their
children.

Spans are sent as OTLP/HTTP JSON (opentelemetry-proto's JSON mapping: hex ids, int64 as
strings), in batches from the event loop, with the headers and resource that
otlp_config.py reads (the SDK's OTEL_* variables); a batch the collector cannot take now
(429, 502, 503, 504, no answer) is retried with backoff within the export timeout, as
the OTLP specification asks. Not the OpenTelemetry SDK: its span objects,
context and batch thread cost more router CPU than the relay itself (3x the CPU of a
short request in benchmarks/router_bench.py); a span here is a slotted object until its
batch is written in one pass.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from pdcluster.observability import ROUTER_TRACE_DROP_REASONS
from pdcluster.router.otlp_config import DEFAULT_TIMEOUT_S, SERVICE

log = logging.getLogger(__name__)

SCOPE = "pdcluster.router"
SERVER, CLIENT = 2, 3  # SpanKind in opentelemetry-proto trace.proto
STATUS_ERROR = 2
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ids = random.Random()  # ids need to be unique, not secret (the SDK uses random too)


def parent_of(header: str | None) -> tuple[int, int, bool] | None:
    """(trace id, span id, sampled) of a W3C `traceparent` header (version 00), or None."""
    match = _TRACEPARENT.fullmatch((header or "").strip().lower())
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, bool(int(match[3], 16) & 1)


class Span:
    __slots__ = ("attributes", "end_ns", "error", "kind", "name", "parent_id", "span_id", "start_ns")

    def __init__(self, name: str, kind: int, parent_id: int, start_ns: int, attributes: dict[str, Any]):
        self.name = name
        self.kind = kind
        self.span_id = _ids.getrandbits(64) or 1
        self.parent_id = parent_id
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes = attributes
        self.error = False

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value


class RequestTrace:
    """The spans of one client request; times are `time.time_ns()`. Unsampled, it still
    has ids (engines are told not to sample) but keeps no span."""

    __slots__ = ("done", "root", "sampled", "trace_id", "tracing")

    def __init__(self, tracing: Tracing, trace_id: int, parent_id: int, sampled: bool, path: str):
        self.tracing = tracing
        self.trace_id = trace_id
        self.sampled = sampled
        self.root = Span(f"router {path}", SERVER, parent_id, time.time_ns(), {})
        self.done: list[Span] = []

    def span(self, name: str, start_ns: int | None = None, **attributes: Any) -> Span:
        """A child of the root; it is sent once it has ended (`end`)."""
        return Span(name, CLIENT, self.root.span_id, start_ns or time.time_ns(), attributes)

    def end_span(self, span: Span, end_ns: int | None = None) -> None:
        span.end_ns = end_ns or time.time_ns()
        if self.sampled:
            self.done.append(span)

    def header(self, span: Span) -> bytes:
        """The `traceparent` header line that makes an engine's spans children of `span`."""
        # The sampled flag alone: the flags of W3C Trace Context level 1, which vLLM reads.
        return b"traceparent: 00-%032x-%016x-%02x\r\n" % (self.trace_id, span.span_id, self.sampled)

    def stage(self, name: str, start_ns: int, end_ns: int | None = None, **attributes: Any) -> None:
        """A span whose start and end are known already."""
        if self.sampled:
            span = Span(name, CLIENT, self.root.span_id, start_ns, attributes)
            span.end_ns = end_ns or time.time_ns()
            self.done.append(span)

    def end(self, status: int, **attributes: Any) -> None:
        root = self.root
        root.attributes["http.response.status_code"] = status
        root.attributes.update(attributes)
        root.error = status >= 500
        self.end_span(root)
        if self.sampled:
            self.tracing.export(self.trace_id, self.done)


class Tracing:
    """Makes request traces and sends their spans to an OTLP/HTTP endpoint.

    Finished traces wait in memory until `batch_spans` of them are there or `interval_s`
    has passed, then go in one POST, retried as `send_with_retries` does. At most `max_queued_spans`
    wait: past that the oldest are dropped (newer spans say more about a collector that is
    back), and every dropped span is reported to `on_drop` with its reason.
    """

    def __init__(
        self,
        endpoint: str,
        sample_ratio: float = 1.0,
        *,
        headers: Mapping[str, str] | None = None,
        resource: Mapping[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        batch_spans: int = 512,
        interval_s: float = 1.0,
        max_queued_spans: int = 8192,
        backoff: Backoff | None = None,
        on_drop: Callable[[str, int], None] = lambda reason, spans: None,
        sink: Callable[[bytes], None] | None = None,
    ):
        self.endpoint = endpoint
        # TraceIdRatioBased: sampled when the trace id's low 64 bits fall below the bound.
        self.bound = round(min(max(sample_ratio, 0.0), 1.0) * (1 << 64))
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.request_template = _request_template(resource or {"service.name": SERVICE})
        self.timeout_s = timeout_s
        self.batch_spans = batch_spans
        self.interval_s = interval_s
        self.max_queued_spans = max_queued_spans
        self.backoff = backoff or Backoff()
        self.on_drop = on_drop
        self.sink = sink  # tests: receives each encoded batch instead of the endpoint
        self.queued: collections.deque[tuple[int, list[Span]]] = collections.deque()
        self.queued_spans = 0
        self._unlogged_drops = 0  # queue_full drops since the last warning
        self._full = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def request(self, path: str, header: str | None) -> RequestTrace:
        parent = parent_of(header)
        if parent is not None:
            trace_id, parent_id, sampled = parent
        else:
            trace_id, parent_id = _ids.getrandbits(128) or 1, 0
            sampled = (trace_id & 0xFFFFFFFFFFFFFFFF) < self.bound
        return RequestTrace(self, trace_id, parent_id, sampled, path)

    def export(self, trace_id: int, spans: list[Span]) -> None:
        self.queued.append((trace_id, spans))
        self.queued_spans += len(spans)
        while self.queued_spans > self.max_queued_spans:
            _, oldest = self.queued.popleft()
            self.queued_spans -= len(oldest)
            self._unlogged_drops += len(oldest)
            self.on_drop(DROP_QUEUE_FULL, len(oldest))
        if self.queued_spans >= self.batch_spans:
            self._full.set()

    def take(self) -> tuple[bytes, int] | None:
        """The oldest queued traces, `batch_spans` spans or a little more (a trace is not
        split), as one OTLP JSON request body, and their span count; None when none wait."""
        if not self.queued:
            return None
        batch, spans = [], 0
        while self.queued and spans < self.batch_spans:
            trace = self.queued.popleft()
            batch.append(trace)
            spans += len(trace[1])
        self.queued_spans -= spans
        return encode(batch, self.request_template), spans

    def start(self) -> None:
        self._session = aiohttp.ClientSession()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while not self._closing:
            try:
                async with asyncio.timeout(self.interval_s):
                    await self._full.wait()
            except TimeoutError:
                pass
            self._full.clear()
            await self.flush()

    async def flush(self) -> bool:
        """Sends the queued spans batch by batch; stops at a batch the collector did not
        take (the rest wait for the next round). True when all were sent."""
        if self._unlogged_drops:
            log.warning(
                "tracing: dropped the %d oldest spans, more than %d were waiting",
                self._unlogged_drops, self.max_queued_spans,
            )  # fmt: skip
            self._unlogged_drops = 0
        while (batch := self.take()) is not None:
            body, spans = batch
            if self.sink is not None:
                self.sink(body)
                continue
            if not await self._send(body, spans):
                return False
        return True

    async def _send(self, body: bytes, spans: int) -> bool:
        assert self._session is not None, "start() first"
        session = self._session

        async def post(timeout_s: float) -> Answer:
            try:
                timeout = aiohttp.ClientTimeout(total=timeout_s)
                async with session.post(self.endpoint, data=body, headers=self.headers, timeout=timeout) as response:
                    if 200 <= response.status < 300:
                        return Answer(response.status)
                    return Answer(
                        response.status,
                        retry_after_s=retry_after(response.headers.get("Retry-After")),
                        error=(await response.read())[:200].decode(errors="replace"),
                    )
            except (aiohttp.ClientError, TimeoutError) as e:
                return Answer(None, error=str(e) or type(e).__name__)

        answer = await send_with_retries(post, self.timeout_s, self.backoff)
        if answer.delivered:
            return True
        reason = DROP_REFUSED if answer.status is not None and not answer.retryable else DROP_UNREACHABLE
        log.warning(
            "tracing: dropped %d spans, %s %s: %s", spans, self.endpoint,
            f"answered {answer.status}" if answer.status is not None else "did not answer", answer.error,
        )  # fmt: skip
        self.on_drop(reason, spans)
        return False

    async def close(self) -> None:
        """Stops batching and sends what is left: a batch being sent finishes (within the
        export timeout), and what the collector does not take then is dropped."""
        self._closing = True
        self._full.set()
        if self._task is not None:
            await self._task
        if not await self.flush() and self.queued_spans:
            self.on_drop(DROP_UNREACHABLE, self.queued_spans)
            self.queued.clear()
            self.queued_spans = 0
        if self._session is not None:
            await self._session.close()


# Why spans were dropped: the `reason` of observability.ROUTER_TRACE_SPANS_DROPPED.
DROP_QUEUE_FULL, DROP_REFUSED, DROP_UNREACHABLE = ROUTER_TRACE_DROP_REASONS
# The answers OTLP/HTTP says to retry; any other error is final.
# https://opentelemetry.io/docs/specs/otlp/#failures-1 and #otlphttp-throttling
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class Answer:
    """How one POST of a batch went."""

    status: int | None  # None: no answer (refused, reset, timed out)
    retry_after_s: float | None = None  # the collector's Retry-After
    error: str = ""

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status in RETRYABLE_STATUSES


@dataclass(frozen=True)
class Backoff:
    """The waits between the attempts of one export: exponential from `first_s`, at most
    `max_s`, each drawn within +-`jitter` of that so that routers behind one collector
    do not retry in step. A Retry-After replaces the drawn wait."""

    first_s: float = 1.0
    factor: float = 2.0
    max_s: float = 8.0
    jitter: float = 0.2

    def delay(self, retry: int, draw: Callable[[float, float], float] = random.uniform) -> float:
        """The wait before retry number `retry` (0: the first retry)."""
        base = min(self.first_s * self.factor**retry, self.max_s)
        return base * draw(1 - self.jitter, 1 + self.jitter) if self.jitter else base


def retry_after(value: str | None) -> float | None:
    """A Retry-After header's delay in seconds; None for an absent or an HTTP-date one
    (collectors send seconds; a date falls back to the backoff)."""
    try:
        seconds = float(value or "")
    except ValueError:
        return None
    return seconds if seconds >= 0 and math.isfinite(seconds) else None


async def send_with_retries(
    post: Callable[[float], Awaitable[Answer]],
    timeout_s: float,
    backoff: Backoff,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> Answer:
    """Posts (`post(seconds left)`) until an answer is final or the next attempt would
    begin past `timeout_s`, the OTLP exporter's bound on one export, retries included;
    returns the last answer."""
    deadline = clock() + timeout_s
    time_left = timeout_s
    retry = 0
    while True:
        answer = await post(time_left)
        if answer.delivered or not answer.retryable:
            return answer
        wait = answer.retry_after_s if answer.retry_after_s is not None else backoff.delay(retry)
        if clock() + wait >= deadline:
            return answer
        await sleep(wait)
        time_left = deadline - clock()
        if time_left <= 0:  # a sleep that overran; a zero timeout would mean none to aiohttp
            return answer
        retry += 1


def encode(traces: list[tuple[int, list[Span]]], request_template: bytes) -> bytes:
    """An OTLP ExportTraceServiceRequest in its JSON mapping, written span by span (a
    dict per span and one orjson pass cost three times as much)."""
    spans = []
    for trace_id, trace_spans in traces:
        hex_id = b"%032x" % trace_id
        for s in trace_spans:
            spans.append(
                _SPAN
                % (
                    hex_id,
                    s.span_id,
                    b',"parentSpanId":"%016x"' % s.parent_id if s.parent_id else b"",
                    _NAMES.get(s.name) or _name(s.name),
                    s.kind,
                    s.start_ns,
                    s.end_ns,
                    b",".join([_attribute(k, v) for k, v in s.attributes.items()]),
                    b',"status":{"code":%d}' % STATUS_ERROR if s.error else b"",
                )
            )
    return request_template % b",".join(spans)


_SPAN = (
    b'{"traceId":"%s","spanId":"%016x"%s,"name":%s,"kind":%d,'
    b'"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":[%s]%s}'
)


def _request_template(resource: Mapping[str, str]) -> bytes:
    """The request around the spans (`%s`), with the resource's attributes."""
    attributes = b",".join(
        b'{"key":%s,"value":{"stringValue":%s}}' % (orjson.dumps(key), orjson.dumps(value))
        for key, value in resource.items()
    )
    return (
        b'{"resourceSpans":[{"resource":{"attributes":[%s]},"scopeSpans":[{"scope":{"name":"%s"},'
        b'"spans":[%%s]}]}]}' % (attributes, SCOPE.encode())
    )


def _attribute(key: str, v: Any) -> bytes:
    prefix = _KEYS.get(key)
    if prefix is None:  # keys are the code's own few names
        prefix = _KEYS[key] = b'{"key":%s,"value":' % orjson.dumps(key)
    kind = type(v)
    if kind is int:
        return prefix + b'{"intValue":"%d"}}' % v
    if kind is bool:
        return prefix + (b'{"boolValue":true}}' if v else b'{"boolValue":false}}')
    if kind is float:
        return prefix + b'{"doubleValue":%s}}' % orjson.dumps(v)
    return prefix + b'{"stringValue":%s}}' % orjson.dumps(str(v))



def _name(name: str) -> bytes:
    encoded = orjson.dumps(name)
    if len(_NAMES) < 64:  # span names are the code's stages and the router's paths
        _NAMES[name] = encoded
    return encoded


_KEYS: dict[str, bytes] = {}
_NAMES: dict[str, bytes] = {}
