"""The router's spans, as the OTLP JSON it would send (decoded here)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.render.engine import engine_args, engine_env
from pdcluster.render.names import Owner
from pdcluster.render.router import router_args, router_env
from pdcluster.router.tracing import (
    CLIENT,
    SERVER,
    Answer,
    Backoff,
    Tracing,
    parent_of,
    retry_after,
    send_with_retries,
)

CLIENT_HEADER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def tracing(ratio: float = 1.0, **kwargs: Any) -> Tracing:
    return Tracing("http://127.0.0.1:1/v1/traces", ratio, **kwargs)


def sent(t: Tracing) -> dict[str, dict[str, Any]]:
    """The spans of the batch `t` would send now, by name, attributes as a dict."""
    batch = t.take()
    if batch is None:
        return {}
    [resource] = orjson.loads(batch[0])["resourceSpans"]
    assert resource["resource"]["attributes"] == [
        {"key": "service.name", "value": {"stringValue": "pdcluster-router"}}
    ]
    [scope] = resource["scopeSpans"]
    spans = {}
    for span in scope["spans"]:
        span["attributes"] = {a["key"]: a["value"] for a in span["attributes"]}
        spans[span["name"]] = span
    return spans


def test_a_request_is_one_trace_whose_stages_are_children_of_its_root() -> None:
    t = tracing()
    request = t.request("/v1/completions", None)
    start = time.time_ns()
    request.stage("admission", start, **{"pdcluster.prompt_tokens": 12, "pdcluster.store": "hit"})
    prefill = request.span("prefill", **{"pdcluster.engine": "p-0"})
    header = request.header(prefill)
    request.end_span(prefill)
    assert sent(t) == {}  # nothing leaves before the request ends
    request.end(200)
    spans = sent(t)
    assert set(spans) == {"router /v1/completions", "admission", "prefill"}
    root = spans["router /v1/completions"]
    assert "parentSpanId" not in root and root["kind"] == SERVER and "status" not in root
    assert root["attributes"]["http.response.status_code"] == {"intValue": "200"}
    for child in ("admission", "prefill"):
        assert spans[child]["parentSpanId"] == root["spanId"] and spans[child]["kind"] == CLIENT
        assert spans[child]["traceId"] == root["traceId"] and len(root["traceId"]) == 32
    admission = spans["admission"]
    assert admission["startTimeUnixNano"] == str(start) <= admission["endTimeUnixNano"]
    assert admission["attributes"] == {
        "pdcluster.prompt_tokens": {"intValue": "12"},
        "pdcluster.store": {"stringValue": "hit"},
    }
    # The header an engine gets names the prefill span: vLLM's spans become its children.
    p = spans["prefill"]
    assert header == f"traceparent: 00-{p['traceId']}-{p['spanId']}-01\r\n".encode()
    assert t.take() is None  # sent once


def test_a_clients_traceparent_is_continued_and_its_sampling_followed() -> None:
    t = tracing()
    t.request("/v1/chat/completions", CLIENT_HEADER).end(502)
    unsampled = t.request("/v1/completions", CLIENT_HEADER[:-2] + "00")  # the client did not sample it
    assert unsampled.header(unsampled.root).endswith(b"-00\r\n")  # nor will the engines
    unsampled.end(200)
    [root] = sent(t).values()
    assert root["traceId"] == "0af7651916cd43dd8448eb211c80319c"
    assert root["parentSpanId"] == "b7ad6b7169203331"
    assert root["status"] == {"code": 2}  # ERROR


@pytest.mark.parametrize("ratio", [0.0, 0.25, 1.0])
def test_the_sample_ratio_holds_for_requests_without_a_parent(ratio: float) -> None:
    t = tracing(ratio, max_queued_spans=10**6)
    for _ in range(2000):
        request = t.request("/v1/completions", None)
        request.stage("admission", time.time_ns())
        request.end(200)
    sampled = t.queued_spans / 2 / 2000
    # Which traces are sampled is random, but the count is bounded: 2000 draws at p=0.25
    # stay within 0.25 +- 0.06 with probability 1 - 1e-10.
    assert sampled == ratio if ratio in (0.0, 1.0) else abs(sampled - ratio) < 0.06


def test_a_full_queue_drops_the_oldest_spans_and_counts_them() -> None:
    dropped: Counter[str] = Counter()
    t = tracing(max_queued_spans=5, on_drop=lambda reason, spans: dropped.update({reason: spans}))
    for path in ("/first", "/second", "/third", "/fourth"):
        request = t.request(path, None)
        request.stage("admission", time.time_ns())
        request.end(200)
    assert t.queued_spans == 4 and dropped == {"queue_full": 4}  # two traces of two spans each fit
    assert {"router /third", "router /fourth"} < sent(t).keys()  # the newest


async def test_batches_leave_when_full_and_on_close(wait_until: Callable[..., Awaitable[Any]]) -> None:
    bodies: list[bytes] = []
    t = tracing(batch_spans=4, interval_s=60, sink=bodies.append)
    t.start()
    try:
        for _ in range(2):
            request = t.request("/v1/completions", None)
            request.stage("admission", time.time_ns())
            request.end(200)
        await wait_until(lambda: bodies, interval=0.01, message="the full batch sent")
        request = t.request("/v1/completions", None)
        request.end(200)
    finally:
        await t.close()
    assert [len(orjson.loads(b)["resourceSpans"][0]["scopeSpans"][0]["spans"]) for b in bodies] == [4, 1]


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
    assert "OTEL_EXPORTER_OTLP_TRACES_HEADERS" not in {e["name"] for e in router_env(spec)}
    for role in ("prefill", "decode"):
        args = engine_args(spec, role)
        assert args[args.index("--otlp-traces-endpoint") + 1] == "http://otel:4318/v1/traces"
        env = {e["name"]: e.get("value") for e in engine_env(spec, owner, role)}
        assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        assert env["OTEL_RESOURCE_ATTRIBUTES"] == f"pdcluster.cluster=c,pdcluster.role={role}"
    off = PDClusterSpec.model_validate({"model": {"name": "m"}})
    assert not any("otlp" in a for a in router_args(off, owner) + engine_args(off, "prefill"))


def test_the_headers_secret_reaches_the_router_and_the_engines_from_the_environment() -> None:
    secret = {"name": "collector-auth", "key": "headers"}
    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "tracing": {"enabled": True, "endpoint": "http://otel:4318", "headersSecret": secret},
        }
    )
    owner = Owner("c", "ns", "uid")
    from_secret = {"name": "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "valueFrom": {"secretKeyRef": secret}}
    assert from_secret in router_env(spec)
    for role in ("prefill", "decode"):
        assert from_secret in engine_env(spec, owner, role)
    assert not any("collector-auth" in a for a in router_args(spec, owner))  # a credential stays out of args
    off = spec.model_copy(update={"tracing": spec.tracing.model_copy(update={"enabled": False})})
    assert from_secret not in router_env(off) and from_secret not in engine_env(off, owner, "prefill")


class FakeClock:
    """A monotonic clock that only `sleep` moves, recording every wait."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


class ScriptedCollector:
    """Answers each POST with the next of `answers`, recording the time it was given."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.time_left: list[float] = []

    async def post(self, timeout_s: float) -> Answer:
        self.time_left.append(timeout_s)
        return self.answers.pop(0)


NO_JITTER = Backoff(first_s=1.0, factor=2.0, max_s=8.0, jitter=0.0)


async def test_retries_back_off_exponentially_and_follow_retry_after() -> None:
    clock = FakeClock()
    collector = ScriptedCollector(
        Answer(503, retry_after_s=3.0), Answer(429), Answer(None, error="connection refused"), Answer(200)
    )
    answer = await send_with_retries(collector.post, 10.0, NO_JITTER, clock=clock, sleep=clock.sleep)
    assert answer.delivered
    # Retry-After replaces the first wait; the backoff goes on from there: 2 s, 4 s.
    assert clock.waits == [3.0, 2.0, 4.0]
    assert collector.time_left == [10.0, 7.0, 5.0, 1.0]  # each attempt within what is left


async def test_retries_stop_before_the_export_timeout() -> None:
    clock = FakeClock()
    collector = ScriptedCollector(*[Answer(503)] * 10)
    answer = await send_with_retries(collector.post, 10.0, NO_JITTER, clock=clock, sleep=clock.sleep)
    assert answer.status == 503 and not answer.delivered
    assert clock.waits == [1.0, 2.0, 4.0]  # a wait of 8 s more would end past 10 s
    assert len(collector.time_left) == 4


async def test_a_sleep_that_overruns_the_timeout_ends_the_export() -> None:
    clock = FakeClock()

    async def late_sleep(seconds: float) -> None:
        await clock.sleep(seconds + 20.0)  # a loop too busy to wake on time

    collector = ScriptedCollector(Answer(503), Answer(200))
    answer = await send_with_retries(collector.post, 10.0, NO_JITTER, clock=clock, sleep=late_sleep)
    assert answer.status == 503 and collector.time_left == [10.0]  # no attempt with no time left


async def test_a_retry_after_past_the_timeout_ends_the_export_at_once() -> None:
    clock = FakeClock()
    collector = ScriptedCollector(Answer(429, retry_after_s=30.0), Answer(200))
    answer = await send_with_retries(collector.post, 10.0, NO_JITTER, clock=clock, sleep=clock.sleep)
    assert answer.status == 429 and clock.waits == []


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 500])
async def test_other_errors_are_final(status: int) -> None:
    clock = FakeClock()
    collector = ScriptedCollector(Answer(status), Answer(200))
    answer = await send_with_retries(collector.post, 10.0, NO_JITTER, clock=clock, sleep=clock.sleep)
    assert answer.status == status and not answer.retryable and clock.waits == []


def test_the_backoff_is_capped_and_jittered_within_its_bounds() -> None:
    backoff = Backoff(first_s=1.0, factor=2.0, max_s=8.0, jitter=0.2)
    assert [backoff.delay(n, draw=lambda low, high: 1.0) for n in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.delay(10, draw=lambda low, high: high) == pytest.approx(9.6)
    assert backoff.delay(0, draw=lambda low, high: low) == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("5", 5.0), ("0", 0.0), ("1.5", 1.5), (None, None), ("", None), ("-1", None), ("inf", None),
     ("Wed, 21 Oct 2015 07:28:00 GMT", None)],
)  # fmt: skip
def test_retry_after_in_seconds(header: str | None, seconds: float | None) -> None:
    assert retry_after(header) == seconds
