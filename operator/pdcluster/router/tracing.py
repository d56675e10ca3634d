"""OpenTelemetry traces of the router's requests (`--otlp-traces-endpoint`), off by default.

Each request is a trace: a root SERVER span `router <path>` (continuing the client's W3C
`traceparent` when it sent one) and, per attempt, the spans of its stages:
- `admission`: from arrival to dispatch (policy, exact block hashes, store lookup, SLO);
- `prefill`: the prefill engine's exchange;
- `kv_handoff`: from prefill's answer to decode's first byte (decode loading the KV);
- `decode`: the decode (or colocated) engine's exchange, from dispatch to its end;
- `stream`: from decode's first byte to the last one relayed to the client.
The `prefill` and `decode` spans travel to their engines as `traceparent` headers, so
vLLM (`--otlp-traces-endpoint`, vllm/tracing/otel.py) makes its own request spans their
children. Spans go over OTLP/HTTP in batches, off the request path (the SDK's
BatchSpanProcessor); with tracing off none of this module's imports happen.
"""

from __future__ import annotations

import re
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags

SERVICE = "pdcluster-router"
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def parent_of(header: str | None) -> Any:
    """The context of a W3C `traceparent` header (version 00), or None."""
    match = _TRACEPARENT.fullmatch((header or "").strip().lower())
    if match is None or int(match[1], 16) == 0 or int(match[2], 16) == 0:
        return None
    remote = SpanContext(int(match[1], 16), int(match[2], 16), True, TraceFlags(int(match[3], 16) & 1))
    return trace.set_span_in_context(NonRecordingSpan(remote))


class Tracing:
    def __init__(self, endpoint: str, sample_ratio: float = 1.0, processor: SpanProcessor | None = None):
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": SERVICE}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        self.provider.add_span_processor(processor or BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("pdcluster.router")

    def request(self, path: str, header: str | None) -> RequestTrace:
        root = self.tracer.start_span(f"router {path}", context=parent_of(header), kind=SpanKind.SERVER)
        return RequestTrace(self.tracer, root)

    def shutdown(self) -> None:
        self.provider.shutdown()


class RequestTrace:
    """The spans of one client request; times are `time.time_ns()`."""

    __slots__ = ("root", "tracer")

    def __init__(self, tracer: trace.Tracer, root: Span):
        self.tracer = tracer
        self.root = root

    def span(self, name: str, start_ns: int | None = None, **attributes: Any) -> Span:
        context = trace.set_span_in_context(self.root)
        return self.tracer.start_span(
            name, context=context, kind=SpanKind.CLIENT, start_time=start_ns, attributes=attributes or None
        )

    @staticmethod
    def header(span: Span) -> bytes:
        """The `traceparent` header line that makes an engine's spans children of `span`."""
        c = span.get_span_context()
        # The sampled flag alone: the flags of W3C Trace Context level 1, which vLLM reads.
        return b"traceparent: 00-%032x-%016x-%02x\r\n" % (c.trace_id, c.span_id, c.trace_flags & 1)

    def stage(self, name: str, start_ns: int, end_ns: int | None = None, **attributes: Any) -> None:
        """A span whose start and end are known already."""
        self.span(name, start_ns, **attributes).end(end_ns or time.time_ns())

    def end(self, status: int, **attributes: Any) -> None:
        self.root.set_attribute("http.response.status_code", status)
        for key, value in attributes.items():
            self.root.set_attribute(key, value)
        if status >= 500:
            self.root.set_status(trace.StatusCode.ERROR)
        self.root.end()
