"""The router's traces, received by a real OpenTelemetry Collector (OTLP/HTTP) on
loopback: one trace per request, the client's traceparent continued, a span per stage,
and each engine told its parent span in the traceparent it gets. Then the export against
a collector that is overloaded (503, Retry-After), one behind auth (a header required)
and none at all: a stub receiver on loopback answers as each case needs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from loopback import CONSUMER, PRODUCER, engine_url, free_port, prefill_url, router, simulator
from test_router_pd import WaitUntil, post, recorded

from localcluster.otelcol import Collector, Span
from pdcluster.router.main import RouterService

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


@dataclass
class Attempt:
    """One POST the stub received, and how it answered."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class StubCollector:
    """An OTLP/HTTP receiver that answers each POST with `answer(request headers)`:
    (status, response headers)."""

    answer: Callable[[dict[str, str]], tuple[int, dict[str, str]]]
    attempts: list[Attempt] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        status, response_headers = self.answer(headers)
        async with self.changed:
            self.attempts.append(Attempt(status, headers, await request.read()))
            self.changed.notify_all()
        return web.Response(status=status, headers=response_headers, body=b"{}")

    async def wait_for(self, done: Callable[[list[Attempt]], bool]) -> list[Attempt]:
        async with asyncio.timeout(15), self.changed:
            await self.changed.wait_for(lambda: done(self.attempts))
        return self.attempts

    def spans(self) -> list[dict[str, Any]]:
        """The spans of the batches it took (2xx)."""
        return [
            {**span, "resource": {a["key"]: a["value"]["stringValue"] for a in rs["resource"]["attributes"]}}
            for a in self.attempts if a.status == 200
            for rs in orjson.loads(a.body)["resourceSpans"]
            for ss in rs["scopeSpans"]
            for span in ss["spans"]
        ]  # fmt: skip


@asynccontextmanager
async def stub_collector(answer: Callable[[dict[str, str]], tuple[int, dict[str, str]]]) -> AsyncIterator[StubCollector]:
    stub = StubCollector(answer)
    app = web.Application()
    app.router.add_post("/v1/traces", stub.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stub.url = f"http://127.0.0.1:{port}"
    try:
        yield stub
    finally:
        await runner.cleanup()


@asynccontextmanager
async def traced_router(*argv: str) -> AsyncIterator[tuple[RouterService, str]]:
    """A router in front of one simulator, and its completions URL."""
    async with simulator() as engine, router(
        "--colocated", engine_url(engine), "--kv-probe-interval", "0", "--model", "sim-model", *argv
    ) as service:  # fmt: skip
        yield service, f"http://127.0.0.1:{service.args.port}/v1/completions"


def dropped(service: RouterService, reason: str) -> float | None:
    assert service.router is not None
    sample = "pdcluster_router_trace_spans_dropped_total"
    return service.router.metrics.registry.get_sample_value(sample, {"reason": reason})


def span_count(body: bytes) -> int:
    return sum(len(ss["spans"]) for rs in orjson.loads(body)["resourceSpans"] for ss in rs["scopeSpans"])


BODY = {"model": "sim-model", "prompt": "hi", "max_tokens": 2}


async def test_an_overloaded_collector_gets_the_batch_again_after_its_retry_after() -> None:
    answers = iter([(503, {"Retry-After": "1"})])
    async with stub_collector(lambda headers: next(answers, (200, {}))) as stub:
        async with aiohttp.ClientSession() as http, traced_router("--otlp-traces-endpoint", f"{stub.url}/v1/traces") as (
            service, url,
        ):  # fmt: skip
            assert (await post(http, url, BODY, traceparent=CLIENT))[0] == 200
            attempts = await stub.wait_for(lambda attempts: any(a.status == 200 for a in attempts))
            assert [a.status for a in attempts] == [503, 200]
            assert attempts[0].body == attempts[1].body  # the same batch, sent again
            assert {s["traceId"] for s in stub.spans()} == {CLIENT_TRACE}
        assert all(dropped(service, reason) == 0 for reason in ("queue_full", "refused", "unreachable"))


def requires_token(headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    return (200, {}) if headers.get("authorization") == "Bearer s3cret" else (401, {})


async def test_a_collector_behind_auth_takes_spans_with_the_configured_header(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with stub_collector(requires_token) as stub, aiohttp.ClientSession() as http:
        async with traced_router("--otlp-traces-endpoint", f"{stub.url}/v1/traces") as (without, url):
            assert (await post(http, url, BODY, traceparent=CLIENT))[0] == 200
            await stub.wait_for(lambda attempts: len(attempts) == 1)
        # Refused is final: not retried, and counted once the router has stopped.
        [refused] = stub.attempts
        assert refused.status == 401 and dropped(without, "refused") == span_count(refused.body)
        # As the operator renders it from tracing.headersSecret, the endpoint as the SDK reads it.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "authorization=Bearer%20s3cret")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", stub.url)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "router-under-test")
        async with traced_router() as (with_header, url):
            assert (await post(http, url, BODY, traceparent=CLIENT))[0] == 200
            await stub.wait_for(lambda attempts: len(attempts) == 2)
    assert stub.attempts[1].status == 200 and stub.attempts[1].headers["authorization"] == "Bearer s3cret"
    assert {s["resource"]["service.name"] for s in stub.spans()} == {"router-under-test"}
    assert dropped(with_header, "refused") == 0


async def test_spans_nobody_takes_within_the_export_timeout_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "200")  # shorter than the first backoff
    nobody = f"http://127.0.0.1:{free_port()}/v1/traces"  # connections refused
    async with aiohttp.ClientSession() as http, traced_router("--otlp-traces-endpoint", nobody) as (service, url):
        assert (await post(http, url, BODY, traceparent=CLIENT))[0] == 200
    assert dropped(service, "unreachable") == 3  # the request's root, admission and decode spans
