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
strings), in batches from the event loop. Not the OpenTelemetry SDK: its span objects,
context and batch thread cost more router CPU than the relay itself (3x the CPU of a
short request in benchmarks/router_bench.py); a span here is a slotted object until its
batch is written in one pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

log = logging.getLogger(__name__)

SERVICE = "pdcluster-router"
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
    has passed, then go in one POST; at most `max_queued_spans` wait (more are dropped and
    counted, as the SDK's BatchSpanProcessor does), and a failed POST is logged and dropped.
    """

    def __init__(
        self,
        endpoint: str,
        sample_ratio: float = 1.0,
        *,
        batch_spans: int = 512,
        interval_s: float = 1.0,
        max_queued_spans: int = 8192,
        sink: Callable[[bytes], None] | None = None,
    ):
        self.endpoint = endpoint
        # TraceIdRatioBased: sampled when the trace id's low 64 bits fall below the bound.
        self.bound = round(min(max(sample_ratio, 0.0), 1.0) * (1 << 64))
        self.batch_spans = batch_spans
        self.interval_s = interval_s
        self.max_queued_spans = max_queued_spans
        self.sink = sink  # tests: receives each encoded batch instead of the endpoint
        self.queued: list[tuple[int, list[Span]]] = []
        self.queued_spans = 0
        self.dropped_spans = 0
        self.sent_spans = 0
        self._full = asyncio.Event()
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
        if self.queued_spans + len(spans) > self.max_queued_spans:
            self.dropped_spans += len(spans)
            return
        self.queued.append((trace_id, spans))
        self.queued_spans += len(spans)
        if self.queued_spans >= self.batch_spans:
            self._full.set()

    def take(self) -> bytes | None:
        """The queued spans as one OTLP JSON request body (None when there are none)."""
        if not self.queued:
            return None
        queued, self.queued, self.queued_spans = self.queued, [], 0
        return encode(queued)

    def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.interval_s):
                    await self._full.wait()
            except TimeoutError:
                pass
            self._full.clear()
            await self.flush()

    async def flush(self) -> None:
        dropped, self.dropped_spans = self.dropped_spans, 0
        if dropped:
            log.warning("tracing: dropped %d spans, more than %d were waiting", dropped, self.max_queued_spans)
        body = self.take()
        if body is None:
            return
        if self.sink is not None:
            self.sink(body)
            return
        assert self._session is not None, "start() first"
        try:
            async with self._session.post(
                self.endpoint, data=body, headers={"Content-Type": "application/json"}
            ) as response:
                if response.status != 200:
                    log.warning("tracing: %s answered %d: %s", self.endpoint, response.status,
                                (await response.text())[:200])  # fmt: skip
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("tracing: cannot send spans to %s: %s", self.endpoint, e or type(e).__name__)

    async def close(self) -> None:
        """Stops batching and sends what is left."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()
        if self._session is not None:
            await self._session.close()


def encode(traces: list[tuple[int, list[Span]]]) -> bytes:
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
    return _REQUEST % b",".join(spans)


_SPAN = (
    b'{"traceId":"%s","spanId":"%016x"%s,"name":%s,"kind":%d,'
    b'"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":[%s]%s}'
)
_REQUEST = (
    b'{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"'
    + SERVICE.encode()
    + b'"}}]},"scopeSpans":[{"scope":{"name":"'
    + SCOPE.encode()
    + b'"},"spans":[%s]}]}]}'
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
