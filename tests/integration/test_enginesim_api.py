"""The engine simulator over HTTP: vLLM's response shapes, metrics, and the
MooncakeConnector hand-off between a prefill and a decode instance on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from loopback import CONSUMER, PRODUCER, simulator
from loopback import mooncake_master as loopback_master
from prometheus_client.parser import text_string_to_metric_families

from pdcluster import observability as obs
from pdcluster.enginesim.main import Simulator
from pdcluster.router.protocol import MooncakeProtocol, PrefillEngine

WaitUntil = Callable[..., Awaitable[Any]]


def url(sim: Simulator, path: str) -> str:
    return f"http://127.0.0.1:{sim.config.port}{path}"


def bootstrap(sim: Simulator) -> str:
    return f"http://127.0.0.1:{sim.config.bootstrap_port}"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    http: aiohttp.ClientSession, target: str, body: dict[str, Any], **headers: str
) -> tuple[int, Any]:
    async with http.post(target, json=body, headers=headers) as resp:
        raw = await resp.read()
        return resp.status, (orjson.loads(raw) if "json" in resp.content_type else raw)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


async def scrape(http: aiohttp.ClientSession, target: str) -> str:
    async with http.get(target) as resp:
        return await resp.text()


def sse_events(raw: bytes) -> list[Any]:
    events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------------ shapes
async def test_completion_response(http: aiohttp.ClientSession) -> None:
    async with simulator("--sim-profile", "zero") as sim:
        status, body = await post(
            http, url(sim, "/v1/completions"), {"prompt": "a" * 40, "max_tokens": 5, "ignore_eos": True},
            **{"X-Request-Id": "abc"},
        )  # fmt: skip
    assert status == 200
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion" and body["model"] == "sim-model"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["stop_reason"] is None
    assert len(choice["text"].split()) == 5
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": None,
    }
    assert body["kv_transfer_params"] is None


async def test_per_request_metrics_as_vllm_reports_them(http: aiohttp.ClientSession) -> None:
    """--enable-per-request-metrics: a whole answer carries `metrics` (every field), a
    stream's usage event the fields that are set; the time to first token is the engine's
    own prefill, queue excluded, the same figure as its prefill-time histogram."""
    body = {"prompt": "a" * 4000, "max_tokens": 1, "ignore_eos": True}
    async with simulator("--enable-per-request-metrics") as sim:
        status, whole = await post(http, url(sim, "/v1/completions"), body)
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        _, raw = await post(http, url(sim, "/v1/completions"), streamed)
        metrics = await scrape(http, url(sim, "/metrics"))
    assert status == 200 and whole["metrics"]["speculative_decoding"] is None
    assert set(whole["metrics"]) == {
        "time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second",
        "speculative_decoding",
    }  # fmt: skip
    usage_event = sse_events(raw)[-1]
    assert "mean_itl_ms" not in usage_event["metrics"]  # one token: no gap, left out as vLLM leaves None out
    prefill_s = metric(metrics, "vllm:request_prefill_time_seconds_sum")
    own_ms = whole["metrics"]["time_to_first_token_ms"] + usage_event["metrics"]["time_to_first_token_ms"]
    assert own_ms == pytest.approx(prefill_s * 1000.0) and own_ms > 0


async def test_streamed_chat_with_usage(http: aiohttp.ClientSession) -> None:
    async with simulator("--sim-profile", "zero", "--served-model-name", "chat") as sim:
        request = {
            "model": "chat",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_completion_tokens": 3,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        status, raw = await post(http, url(sim, "/v1/chat/completions"), request)
    assert status == 200
    events = sse_events(raw)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [e["choices"][0]["delta"]["content"] for e in events[1:4]]
    assert all(isinstance(c, str) and c for c in contents)
    assert [e["choices"][0]["finish_reason"] for e in events[1:4]] == [None, None, "length"]
    assert {e["id"] for e in events} == {events[0]["id"]} and events[0]["id"].startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == "chat" for e in events)
    assert events[4]["choices"] == [] and events[4]["usage"]["completion_tokens"] == 3
    assert len(events) == 5


async def test_streamed_completion_token_ids_prompt(http: aiohttp.ClientSession) -> None:
    async with simulator("--sim-profile", "zero") as sim:
        request = {"prompt": list(range(100)), "max_tokens": 4, "stream": True, "ignore_eos": True}
        status, raw = await post(http, url(sim, "/v1/completions"), request)
        status2, body = await post(http, url(sim, "/v1/completions"), {**request, "stream": False})
    events = sse_events(raw)
    assert status == 200 and len(events) == 4
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None, "length"]
    # vLLM 0.32.0's chunks carry no kv_transfer_params; the last one names the engine.
    assert not any("kv_transfer_params" in e for e in events)
    assert events[-1]["system_fingerprint"].startswith("vllm-0.32.0-")
    assert not any("system_fingerprint" in e for e in events[:-1])
    # Same prompt and seed, same text streamed or not.
    assert "".join(e["choices"][0]["text"] for e in events) == body["choices"][0]["text"]
    assert status2 == 200 and body["usage"]["prompt_tokens"] == 100


async def test_eos_and_min_tokens(http: aiohttp.ClientSession) -> None:
    async with simulator("--sim-profile", "zero", "--sim-output-mean", "1") as sim:
        _, stopped = await post(http, url(sim, "/v1/completions"), {"prompt": "x", "max_tokens": 10})
        _, held = await post(
            http, url(sim, "/v1/completions"), {"prompt": "x", "max_tokens": 10, "min_tokens": 4}
        )
        _, chat = await post(
            http, url(sim, "/v1/chat/completions"), {"messages": [{"role": "user", "content": "x"}]}
        )
    assert (stopped["choices"][0]["finish_reason"], stopped["usage"]["completion_tokens"]) == ("stop", 1)
    assert (held["choices"][0]["finish_reason"], held["usage"]["completion_tokens"]) == ("stop", 5)
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["object"] == "chat.completion"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"prompt": "x", "model": "other"}, 404),
        ({"prompt": "x", "max_tokens": 0}, 400),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400),
        ({"prompt": "x" * 4000, "max_tokens": 10}, 400),  # 1000 + 10 > --max-model-len 1000
        ({"messages": "x"}, 400),
    ],
)
async def test_request_errors(http: aiohttp.ClientSession, body: dict[str, Any], status: int) -> None:
    async with simulator("--sim-profile", "zero", "--max-model-len", "1000") as sim:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        got, payload = await post(http, url(sim, path), body)
    assert got == status
    assert payload["error"]["code"] == status and payload["error"]["message"]


async def test_api_key(http: aiohttp.ClientSession) -> None:
    async with simulator("--sim-profile", "zero", "--api-key", "sekret") as sim:
        denied, _ = await post(http, url(sim, "/v1/completions"), {"prompt": "x"})
        allowed, _ = await post(
            http, url(sim, "/v1/completions"), {"prompt": "x"}, Authorization="Bearer sekret"
        )
    assert (denied, allowed) == (401, 200)


async def test_models_and_health(http: aiohttp.ClientSession) -> None:
    async with simulator(
        "--sim-profile", "zero", "--served-model-name", "a", "b", "--max-model-len", "4096"
    ) as sim:
        async with http.get(url(sim, "/v1/models")) as resp:
            models = await resp.json()
        async with http.get(url(sim, "/health")) as resp:
            assert resp.status == 200
    assert [m["id"] for m in models["data"]] == ["a", "b"]
    assert models["data"][0]["max_model_len"] == 4096 and models["data"][0]["root"] == "sim-model"


async def test_metrics_follow_vllm(http: aiohttp.ClientSession) -> None:
    async with simulator(
        "--sim-profile", "zero", "--served-model-name", "served", "--max-model-len", "32768"
    ) as sim:
        for _ in range(3):
            await post(
                http, url(sim, "/v1/completions"), {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
            )
        async with http.get(url(sim, "/metrics")) as resp:
            text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        obs.VLLM_TTFT: "histogram",
        obs.VLLM_ITL: "histogram",
        obs.VLLM_E2E: "histogram",
        obs.VLLM_QUEUE_TIME: "histogram",
        obs.VLLM_PREFILL_TIME: "histogram",
        obs.VLLM_DECODE_TIME: "histogram",
        obs.VLLM_RUNNING: "gauge",
        obs.VLLM_WAITING: "gauge",
        obs.VLLM_KV_USAGE: "gauge",
        obs.VLLM_PROMPT_TOKENS: "counter",
        obs.VLLM_GENERATION_TOKENS: "counter",
        obs.VLLM_REQUEST_SUCCESS: "counter",
        obs.VLLM_ITERATION_TOKENS: "histogram",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
    success = [s for s in families[obs.VLLM_REQUEST_SUCCESS].samples if s.name.endswith("_total")]
    assert {s.labels["finished_reason"]: s.value for s in success}["length"] == 3
    assert all(s.labels["model_name"] == "served" and s.labels["engine"] == "0" for s in success)

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")][:-1]

    assert bounds(obs.VLLM_TTFT) == list(obs.VLLM_TTFT_BUCKETS)
    assert bounds(obs.VLLM_ITL) == list(obs.VLLM_ITL_BUCKETS)
    assert bounds(obs.VLLM_E2E) == list(obs.VLLM_REQUEST_LATENCY_BUCKETS)
    assert bounds(obs.VLLM_ITERATION_TOKENS) == list(obs.VLLM_ITERATION_TOKEN_BUCKETS)
    assert bounds("vllm:request_prompt_tokens") == list(obs.vllm_request_token_buckets(32768))
    assert "vllm:iteration_tokens_total_bucket" in text and "vllm:prompt_tokens_total{" in text


async def test_dp_ranks_have_their_own_engines(http: aiohttp.ClientSession) -> None:
    async with simulator("--sim-profile", "zero", "-dp", "2", "--kv-transfer-config", PRODUCER) as sim:
        async with http.get(f"{bootstrap(sim)}/query") as resp:
            query = await resp.json()
        for rank in ("0", "1", "1"):
            await post(
                http,
                url(sim, "/v1/completions"),
                {"prompt": "x", "max_tokens": 1},
                **{"X-data-parallel-rank": rank},
            )
        bad, _ = await post(
            http, url(sim, "/v1/completions"), {"prompt": "x"}, **{"X-data-parallel-rank": "2"}
        )
        async with http.get(url(sim, "/metrics")) as resp:
            text = await resp.text()
    assert set(query) == {"0", "1"}
    assert query["0"]["engine_id"].endswith("_dp0") and query["1"]["engine_id"].endswith("_dp1")
    assert query["1"]["worker_addr"]["0"]["0"].startswith("tcp://127.0.0.1:")
    assert bad == 400
    counts = {
        s.labels["engine"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == obs.VLLM_REQUEST_SUCCESS
        for s in f.samples
        if s.labels.get("finished_reason") == "length" and s.name.endswith("_total")
    }
    assert counts == {"0": 1.0, "1": 2.0}


# ------------------------------------------------------------------------ P/D hand-off
def pd_bodies(sim_p: Simulator, prompt: str, max_tokens: int, transfer_id: str) -> tuple[dict, dict]:
    engine = PrefillEngine(sim_p.engine_ids[0], 0, bootstrap(sim_p))
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    return MooncakeProtocol.prefill_body(body, transfer_id), MooncakeProtocol.decode_body(
        body, transfer_id, engine
    )


async def test_decode_waits_for_the_prefill_even_when_it_arrives_first(
    http: aiohttp.ClientSession, wait_until: WaitUntil
) -> None:
    async with (
        simulator("--kv-transfer-config", PRODUCER, "--sim-time-scale", "2") as p,
        simulator("--kv-transfer-config", CONSUMER, "--sim-time-scale", "2") as d,
    ):
        prefill_body, decode_body = pd_bodies(p, "word " * 8000, 8, "xfer-1")  # 10000 tokens
        decode = asyncio.ensure_future(post(http, url(d, "/v1/completions"), decode_body))
        # Decode holds the prompt's KV blocks while it waits for them to arrive.
        await wait_until(lambda: d.cores[0].kv_used == 10000, interval=0.02, message="decode fetching")
        assert not decode.done(), "decode must wait for the prefill's KV"
        p_status, p_body = await post(http, url(p, "/v1/completions"), prefill_body)
        d_status, d_body = await decode
        p_metrics, d_metrics = await scrape(http, url(p, "/metrics")), await scrape(http, url(d, "/metrics"))
    assert (
        p_status == 200 and p_body["kv_transfer_params"] is None and p_body["usage"]["completion_tokens"] == 1
    )
    assert d_status == 200 and d_body["usage"] == {
        "prompt_tokens": 10000, "completion_tokens": 8, "total_tokens": 10008, "prompt_tokens_details": None
    }  # fmt: skip
    # One transfer, of the whole prompt's KV (how long it took is the calibration
    # benchmark's business, not a test's).
    assert metric(p_metrics, "vllm:mooncake_xfer_time_seconds_count") == 1
    assert metric(p_metrics, "vllm:mooncake_bytes_transferred_sum") == 10000 * p.profile.kv_bytes_per_token > 0
    assert metric(d_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 10000
    assert metric(d_metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0


async def test_unknown_transfer_fails_decode_after_the_abort_timeout(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pdcluster.enginesim")
    async with (
        simulator("--sim-profile", "zero", "--kv-transfer-config", PRODUCER, abort_timeout=0.5) as p,
        simulator("--sim-profile", "zero", "--kv-transfer-config", CONSUMER) as d,
    ):
        _, decode_body = pd_bodies(p, "x", 4, "xfer-never-prefilled")
        status, body = await post(http, url(d, "/v1/completions"), decode_body)
        stream_status, raw = await post(http, url(d, "/v1/completions"), {**decode_body, "stream": True})
        failed_recvs = metric(await scrape(http, url(d, "/metrics")), "vllm:mooncake_num_failed_recvs_total")
    assert status == 500 and body["error"]["message"] == "Internal server error"
    # Both pulls failed because the prefill side waited out its abort timeout, not at once.
    timeouts = [r for r in caplog.records if "Timeout waiting for P side ready" in r.getMessage()]
    assert failed_recvs == 2 and len(timeouts) == 2, caplog.text
    assert stream_status == 200  # a stream has begun; the error comes as an event
    error, done = raw.split(b"\n\n")[:2]
    assert orjson.loads(error.removeprefix(b"data: "))["error"]["code"] == 500 and done == b"data: [DONE]"


async def test_wrong_engine_id_fails_at_once(http: aiohttp.ClientSession) -> None:
    async with (
        simulator("--sim-profile", "zero", "--kv-transfer-config", PRODUCER, abort_timeout=600) as p,
        simulator("--sim-profile", "zero", "--kv-transfer-config", CONSUMER) as d,
    ):
        prefill_body, decode_body = pd_bodies(p, "x", 4, "xfer-2")
        decode_body["kv_transfer_params"]["remote_engine_id"] = "not-this-one"
        await post(http, url(p, "/v1/completions"), prefill_body)
        # An answer at all means it did not wait for the 600 s abort timeout.
        status, _ = await asyncio.wait_for(post(http, url(d, "/v1/completions"), decode_body), 60)
    assert status == 500


async def test_prefill_ending_on_eos_strands_decode_unless_min_tokens(http: aiohttp.ClientSession) -> None:
    """Why the router sends min_tokens=1: a one-token prefill that ends on EOS frees
    its KV, and decode's pull fails."""
    async with (
        simulator("--sim-profile", "zero", "--sim-output-mean", "1", "--kv-transfer-config", PRODUCER) as p,
        simulator("--sim-profile", "zero", "--kv-transfer-config", CONSUMER) as d,
    ):
        prefill_body, decode_body = pd_bodies(p, "x", 4, "xfer-eos")
        del prefill_body["min_tokens"], prefill_body["ignore_eos"]
        _, eos_prefill = await post(http, url(p, "/v1/completions"), prefill_body)
        eos_status, _ = await post(http, url(d, "/v1/completions"), decode_body)
        prefill_body, decode_body = pd_bodies(p, "x", 4, "xfer-min")
        del prefill_body["ignore_eos"]
        _, capped = await post(http, url(p, "/v1/completions"), prefill_body)
        ok_status, _ = await post(http, url(d, "/v1/completions"), decode_body)
    assert eos_prefill["choices"][0]["finish_reason"] == "stop" and eos_status == 500
    assert capped["choices"][0]["finish_reason"] == "length" and ok_status == 200


async def test_decode_without_kv_params_recomputes_like_vllm(http: aiohttp.ClientSession) -> None:
    """What Mooncake's own proxy does against vLLM 0.33: no transfer_id to prefill, no
    parameters back, so decode prefills locally."""
    async with simulator("--sim-profile", "zero", "--kv-transfer-config", CONSUMER) as d:
        status, body = await post(http, url(d, "/v1/completions"), {"prompt": "x" * 400, "max_tokens": 2})
        text = await scrape(http, url(d, "/metrics"))
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert metric(text, "vllm:prompt_tokens_by_source_total", source="local_compute") == 100


async def test_unpulled_kv_expires_on_the_prefill_side(
    http: aiohttp.ClientSession, wait_until: WaitUntil
) -> None:
    async with simulator("--sim-profile", "zero", "--kv-transfer-config", PRODUCER, abort_timeout=0.3) as p:
        prefill_body, _ = pd_bodies(p, "x" * 4000, 4, "xfer-orphan")
        await post(http, url(p, "/v1/completions"), prefill_body)
        held = p.cores[0].kv_used
        await wait_until(lambda: p.cores[0].kv_used == 0, interval=0.05, message="the held KV freed")
        text = await scrape(http, url(p, "/metrics"))
    assert held == 1001
    assert metric(text, "vllm:mooncake_num_kv_expired_reqs_total", engine="0", model_name="sim-model") == 1


async def test_disconnect_aborts_the_request(http: aiohttp.ClientSession, wait_until: WaitUntil) -> None:
    async with simulator("--sim-time-scale", "1") as sim:
        task = asyncio.ensure_future(
            post(http, url(sim, "/v1/completions"), {"prompt": "x", "max_tokens": 10_000})
        )
        await wait_until(lambda: sim.cores[0].load, interval=0.02, message="the request running")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await wait_until(
            lambda: sim.cores[0].load == 0 and sim.cores[0].kv_used == 0, interval=0.02, message="aborted"
        )
        text = await scrape(http, url(sim, "/metrics"))
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1


# ------------------------------------------------------------------------ Mooncake store
@pytest.fixture
def mooncake_master() -> Any:
    with loopback_master() as master:
        if master is None:
            pytest.skip("mooncake_master is not installed or does not start here")
        yield master.rpc, f"{master.http}/metrics"


async def test_kv_bytes_pass_through_a_real_mooncake_store(
    http: aiohttp.ClientSession, mooncake_master: Any
) -> None:
    master, metrics_url = mooncake_master
    async with (
        simulator(
            "--sim-profile", "zero", "--kv-transfer-config", PRODUCER, "--sim-mooncake-master", master
        ) as p,
        simulator(
            "--sim-profile", "zero", "--kv-transfer-config", CONSUMER, "--sim-mooncake-master", master
        ) as d,
    ):
        if p.store is None or d.store is None:
            pytest.skip("the Mooncake store client cannot run here")
        p.profile = p.profile.__class__(**{**p.profile.__dict__, "kv_bytes_per_token": 131072})
        for i in range(3):
            prefill_body, decode_body = pd_bodies(p, "word " * 800, 2, f"xfer-store-{i}")
            (_, _), (status, _) = await asyncio.gather(
                post(http, url(p, "/v1/completions"), prefill_body),
                post(http, url(d, "/v1/completions"), decode_body),
            )
            assert status == 200
        async with http.get(metrics_url) as resp:
            text = await resp.text()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples.get("master_value_size_bytes_count", 0) >= 3, json.dumps(samples)[:2000]
