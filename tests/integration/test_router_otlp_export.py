"""The router's traces, received by a real OpenTelemetry Collector (OTLP/HTTP) on
loopback: one trace per request, the client's traceparent continued, a span per stage,
and each engine told its parent span in the traceparent it gets."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from loopback import CONSUMER, PRODUCER, engine_url, prefill_url, router, simulator
from test_router_pd import WaitUntil, post, recorded

from localcluster.otelcol import Collector, Span

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


async def spans_of(
    collector: Collector, trace_id: str, names: set[str], wait_until: WaitUntil
) -> dict[str, Span]:
    """The trace's spans by name, once the collector has all of `names`."""

    def complete() -> dict[str, Span] | None:
        got = {s.name: s for s in collector.spans() if s.trace_id == trace_id}
        return got if names <= got.keys() else None

    return await wait_until(complete, interval=0.1, message=f"spans {sorted(names)} exported")


async def test_a_pd_stream_is_one_trace_with_a_span_per_stage(tmp_path: Path, wait_until: WaitUntil) -> None:
    with Collector(tmp_path) as collector:
        async with (
            aiohttp.ClientSession() as http,
            simulator("--kv-transfer-config", PRODUCER, "--sim-record", "10") as prefill,
            simulator("--kv-transfer-config", CONSUMER, "--sim-record", "10") as decode,
            router(
                "--prefill", prefill_url(prefill), "--decode", engine_url(decode), "--kv-probe-interval", "0",
                "--otlp-traces-endpoint", f"{collector.http_endpoint}/v1/traces",
            ) as service,
        ):  # fmt: skip
            url = f"http://127.0.0.1:{service.args.port}/v1/completions"
            body = {"model": "sim-model", "prompt": "tell me", "max_tokens": 4, "stream": True}
            status, _, _ = await post(http, url, body, traceparent=CLIENT)
            assert status == 200
            stages = {"router /v1/completions", "admission", "prefill", "kv_handoff", "decode", "stream"}
            spans = await spans_of(collector, CLIENT_TRACE, stages, wait_until)
            sent = {"prefill": await recorded(http, prefill), "decode": await recorded(http, decode)}
    root = spans["router /v1/completions"]
    assert root.parent_span_id == "00f067aa0ba902b7"  # the client's span
    assert root.service_name == "pdcluster-router" and root.attributes["http.response.status_code"] == 200
    assert all(spans[s].parent_span_id == root.span_id for s in stages - {root.name})
    assert spans["stream"].attributes["pdcluster.tokens"] == 4
    # Each engine's request names its own span as the parent of what the engine traces.
    for role in ("prefill", "decode"):
        [request] = sent[role]
        assert request["headers"]["traceparent"] == f"00-{CLIENT_TRACE}-{spans[role].span_id}-01"


async def test_requests_are_traced_at_the_sample_ratio_and_rejections_too(
    tmp_path: Path, wait_until: WaitUntil
) -> None:
    with Collector(tmp_path) as collector:
        async with (
            aiohttp.ClientSession() as http,
            simulator("--sim-record", "10") as engine,
            router(
                "--colocated", engine_url(engine), "--kv-probe-interval", "0", "--model", "sim-model",
                "--otlp-traces-endpoint", f"{collector.http_endpoint}/v1/traces", "--trace-sample-ratio", "0",
            ) as service,
        ):  # fmt: skip
            url = f"http://127.0.0.1:{service.args.port}/v1/completions"
            body = {"model": "sim-model", "prompt": "hi", "max_tokens": 2}
            assert (await post(http, url, body))[0] == 200  # not sampled: no spans
            assert (await post(http, url, {"model": "other", "prompt": "hi"}, traceparent=CLIENT))[0] == 404
            spans = await spans_of(collector, CLIENT_TRACE, {"router /v1/completions"}, wait_until)
            [untraced] = await recorded(http, engine)
    # A refused request is traced (the client sampled it); a request the ratio left out is not.
    assert spans["router /v1/completions"].attributes["http.response.status_code"] == 404
    assert {s.trace_id for s in collector.spans()} == {CLIENT_TRACE}
    assert untraced["headers"]["traceparent"].endswith("-00")  # the engine is told not to sample
