"""The router's spans, read from the OpenTelemetry SDK's in-memory exporter."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.render.engine import engine_args, engine_env
from pdcluster.render.names import Owner
from pdcluster.render.router import router_args
from pdcluster.router.tracing import Tracing, parent_of

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def exported() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def tracing(exported: InMemorySpanExporter, ratio: float = 1.0) -> Tracing:
    return Tracing("http://127.0.0.1:1/v1/traces", ratio, SimpleSpanProcessor(exported))


def test_a_request_is_one_trace_whose_stages_are_children_of_its_root(exported: InMemorySpanExporter) -> None:
    request = tracing(exported).request("/v1/completions", None)
    start = time.time_ns()
    request.stage("admission", start, **{"pdcluster.prompt_tokens": 12})
    prefill = request.span("prefill")
    header = request.header(prefill)
    prefill.end()
    request.end(200)
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert set(spans) == {"router /v1/completions", "admission", "prefill"}
    root = spans["router /v1/completions"]
    assert root.parent is None and root.attributes["http.response.status_code"] == 200
    for child in ("admission", "prefill"):
        assert spans[child].parent.span_id == root.context.span_id
        assert spans[child].context.trace_id == root.context.trace_id
    assert (
        spans["admission"].start_time == start
        and spans["admission"].attributes["pdcluster.prompt_tokens"] == 12
    )
    # The header an engine gets names the prefill span: vLLM's spans become its children.
    c = spans["prefill"].context
    assert header == f"traceparent: 00-{c.trace_id:032x}-{c.span_id:016x}-01\r\n".encode()


def test_a_clients_traceparent_is_continued_and_its_sampling_followed(exported: InMemorySpanExporter) -> None:
    t = tracing(exported)
    t.request("/v1/chat/completions", CLIENT).end(502)
    t.request("/v1/completions", CLIENT[:-2] + "00").end(200)  # the client did not sample it
    [root] = exported.get_finished_spans()
    assert f"{root.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert f"{root.parent.span_id:016x}" == "b7ad6b7169203331"
    assert root.status.status_code.name == "ERROR"


def test_the_sample_ratio_holds_for_requests_without_a_parent(exported: InMemorySpanExporter) -> None:
    t = tracing(exported, ratio=0.0)
    request = t.request("/v1/completions", None)
    request.stage("admission", time.time_ns())
    request.end(200)
    assert exported.get_finished_spans() == ()
    assert request.header(request.root).endswith(b"-00\r\n")  # engines are told not to sample


@pytest.mark.parametrize(
    "header",
    [None, "", "garbage", "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
     "00-00000000000000000000000000000000-b7ad6b7169203331-01", "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"],
)  # fmt: skip
def test_a_bad_traceparent_starts_a_new_trace(header: str | None) -> None:
    assert parent_of(header) is None


def test_tracing_renders_on_the_router_and_the_engines() -> None:
    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "tracing": {"enabled": True, "endpoint": "http://otel:4318", "samplePercent": 25},
        }
    )
    owner = Owner("c", "ns", "uid")
    assert "--otlp-traces-endpoint=http://otel:4318/v1/traces" in router_args(spec, owner)
    assert "--trace-sample-ratio=0.25" in router_args(spec, owner)
    for role in ("prefill", "decode"):
        args = engine_args(spec, role)
        assert args[args.index("--otlp-traces-endpoint") + 1] == "http://otel:4318/v1/traces"
        env = {e["name"]: e.get("value") for e in engine_env(spec, owner, role)}
        assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        assert env["OTEL_RESOURCE_ATTRIBUTES"] == f"pdcluster.cluster=c,pdcluster.role={role}"
    off = PDClusterSpec.model_validate({"model": {"name": "m"}})
    assert not any("otlp" in a for a in router_args(off, owner) + engine_args(off, "prefill"))
