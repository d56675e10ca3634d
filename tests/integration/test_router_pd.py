"""The router in front of a prefill and a decode simulator on loopback: the PD flow on
the wire, streaming, errors, cancellation, admission, metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from loopback import CONSUMER, PRODUCER, engine_url, free_port, prefill_url, router, simulator
from prometheus_client.parser import text_string_to_metric_families

from pdcluster import observability as obs
from pdcluster.enginesim.main import Simulator
from pdcluster.router.main import RouterService

RECORD = ("--sim-record", "50")
WaitUntil = Callable[..., Awaitable[Any]]


class Cluster:
    def __init__(self, prefill: Simulator, decode: Simulator, router: RouterService):
        self.prefill = prefill
        self.decode = decode
        self.service = router

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.service.args.port}"


@contextlib.asynccontextmanager
async def cluster(
    *router_args: str, prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()
) -> AsyncIterator[Cluster]:
    profile = ("--sim-profile", "zero")
    async with (
        simulator(*RECORD, "--kv-transfer-config", PRODUCER, *(prefill_args or profile)) as p,
        simulator(*RECORD, "--kv-transfer-config", CONSUMER, *(decode_args or profile)) as d,
        router("--prefill", prefill_url(p), "--decode", engine_url(d), *router_args) as service,
    ):
        yield Cluster(p, d, service)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, target: str, body: Any, **headers: str) -> tuple[int, Any, Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with http.post(target, data=data, headers={"Content-Type": "application/json", **headers}) as resp:
        raw = await resp.read()
        payload = orjson.loads(raw) if "json" in resp.content_type else raw
        return resp.status, payload, resp.headers


async def recorded(http: aiohttp.ClientSession, sim: Simulator) -> list[dict[str, Any]]:
    """The client requests an engine received: not the router's own hand-off probes."""
    async with http.get(f"http://127.0.0.1:{sim.config.port}/sim/requests") as resp:
        records = await resp.json()
    return [r for r in records if not r["headers"].get("X-Request-Id", "").startswith("kv-probe-")]


async def scrape(http: aiohttp.ClientSession, target: str) -> str:
    async with http.get(target) as resp:
        return await resp.text()


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def sse(raw: bytes) -> list[Any]:
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------------ the flow
async def test_completion_on_the_wire(http: aiohttp.ClientSession) -> None:
    async with cluster("--model", "sim-model") as c:
        body = {
            "model": "sim-model",
            "prompt": "tell me a story",
            "max_tokens": 7,
            "ignore_eos": True,
            "kv_transfer_params": {"do_remote_decode": False, "remote_engine_id": "evil"},
        }
        status, answer, _ = await post(http, f"{c.url}/v1/completions", body, **{"X-Request-Id": "req-1"})
        (p_req,), (d_req,) = await recorded(http, c.prefill), await recorded(http, c.decode)
    assert status == 200 and answer["id"] == "cmpl-req-1"
    assert answer["usage"]["completion_tokens"] == 7 and answer["choices"][0]["finish_reason"] == "length"
    transfer_id = p_req["body"]["kv_transfer_params"]["transfer_id"]
    assert transfer_id.startswith("xfer-") and len(transfer_id) > 20
    assert p_req["path"] == "/v1/completions"
    assert p_req["headers"] == {"X-Request-Id": "req-1", "X-data-parallel-rank": "0"}
    assert p_req["body"] == {
        "model": "sim-model",
        "prompt": "tell me a story",
        "max_tokens": 1,
        "min_tokens": 1,
        "ignore_eos": True,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        },
    }
    assert d_req["headers"] == {"X-Request-Id": "req-1"}
    assert d_req["body"] == {
        "model": "sim-model",
        "prompt": "tell me a story",
        "max_tokens": 7,
        "ignore_eos": True,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": c.prefill.engine_ids[0],
            "remote_bootstrap_addr": f"http://127.0.0.1:{c.prefill.config.bootstrap_port}",
            "transfer_id": transfer_id,
        },
    }


async def test_streamed_chat(http: aiohttp.ClientSession) -> None:
    async with cluster() as c:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        status, raw, headers = await post(http, f"{c.url}/v1/chat/completions", body)
        (p_req,), (d_req,) = await recorded(http, c.prefill), await recorded(http, c.decode)
        text = await scrape(http, f"{c.url}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse(raw)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [e["choices"][0]["finish_reason"] for e in events[1:6]] == [None] * 4 + ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 5
    assert p_req["path"] == "/v1/chat/completions"
    assert p_req["body"]["max_completion_tokens"] == 1 and "stream_options" not in p_req["body"]
    assert d_req["body"]["stream"] is True and d_req["body"]["stream_options"] == {"include_usage": True}
    assert metric(text, obs.ROUTER_GENERATION_TOKENS + "_total") == 5
    assert metric(text, obs.ROUTER_TTFT + "_count") == 1
    assert metric(text, obs.ROUTER_ITL + "_count") == 4
    # One stream's mean time per output token: its four gaps' mean.
    assert metric(text, obs.ROUTER_TPOT + "_count") == 1
    assert metric(text, obs.ROUTER_TPOT + "_sum") == pytest.approx(metric(text, obs.ROUTER_ITL + "_sum") / 4)
    assert metric(text, obs.ROUTER_REQUESTS + "_total", outcome="ok") == 1


async def test_streamed_completion_and_concurrency(http: aiohttp.ClientSession) -> None:
    async with cluster() as c:
        body = {"prompt": "x" * 1000, "max_tokens": 16, "ignore_eos": True, "stream": True}
        results = await asyncio.gather(*(post(http, f"{c.url}/v1/completions", body) for _ in range(40)))
        text = await scrape(http, f"{c.url}/metrics")
        backends = await (await http.get(f"{c.url}/backends")).json()
    for status, raw, _ in results:
        events = sse(raw)
        assert status == 200 and len(events) == 16 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert metric(text, obs.ROUTER_PROMPT_TOKENS + "_total") == 40 * 250
    assert all(
        b["inflight_requests"] == 0 and b["inflight_tokens"] == 0
        for b in backends["prefill"] + backends["decode"]
    )
    assert metric(text, obs.ROUTER_BACKENDS, role="prefill") == 1


async def test_metrics_and_models(http: aiohttp.ClientSession) -> None:
    async with cluster("--model", "sim-model") as c:
        models = await (await http.get(f"{c.url}/v1/models")).json()
        text = await scrape(http, f"{c.url}/metrics")
    assert models["data"][0]["id"] == "sim-model"
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in (obs.ROUTER_TTFT, obs.ROUTER_ITL, obs.ROUTER_TPOT, obs.ROUTER_E2E, obs.ROUTER_INFLIGHT,
                 obs.ROUTER_INFLIGHT_TOKENS, obs.ROUTER_BACKENDS, obs.ROUTER_REQUESTS, obs.ROUTER_REJECTIONS,
                 obs.ROUTER_PROMPT_TOKENS, obs.ROUTER_GENERATION_TOKENS):  # fmt: skip
        assert name in names, name
    ttft_bounds = [
        float(s.labels["le"])
        for f in text_string_to_metric_families(text)
        if f.name == obs.ROUTER_TTFT
        for s in f.samples
        if s.name.endswith("_bucket")
    ][:-1]
    assert ttft_bounds == list(obs.ROUTER_TTFT_BUCKETS)


async def test_health_and_ready(http: aiohttp.ClientSession) -> None:
    async with cluster() as c:
        assert (await http.get(f"{c.url}/health")).status == 200
        assert (await http.get(f"{c.url}/ready")).status == 200
        assert c.service.router is not None
        c.service.router.draining = True
        assert (await http.get(f"{c.url}/ready")).status == 503
        # A request on a connection opened before the drain is still served, and ends it.
        status, _, headers = await post(http, f"{c.url}/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200 and headers.get("Connection", "").lower() == "close"


# ------------------------------------------------------------------------ failures
async def test_prefill_refusal_is_relayed_and_decode_cancelled(
    http: aiohttp.ClientSession, wait_until: WaitUntil
) -> None:
    # Prefill accepts 100 tokens of context, decode 10000: prefill refuses with 400.
    async with cluster(
        prefill_args=("--sim-profile", "zero", "--max-model-len", "100"),
        decode_args=("--sim-time-scale", "1"),
    ) as c:
        status, body, _ = await post(http, f"{c.url}/v1/completions", {"prompt": "x" * 2000, "max_tokens": 5})

        async def decode_aborted() -> bool:
            text = await scrape(http, f"http://127.0.0.1:{c.decode.config.port}/metrics")
            return metric(text, "vllm:request_success_total", finished_reason="abort") == 1

        # The cancellation reaches decode after the client has its answer.
        await wait_until(decode_aborted, message="decode's request aborted")
        router_metrics = await scrape(http, f"{c.url}/metrics")
    assert status == 400 and "maximum context length" in body["error"]["message"]
    assert c.decode.cores[0].load == 0, "decode's request must be cancelled"
    assert metric(router_metrics, obs.ROUTER_REQUESTS + "_total", outcome="client_error") == 1


async def test_an_unreachable_prefill_is_retried_and_decode_computes_the_prompt(
    http: aiohttp.ClientSession,
) -> None:
    """The only prefill cannot be reached: the request is not the client's error; the
    one decode engine computes the prompt itself, and the router says what happened."""
    async with cluster() as c:
        assert c.service.pool is not None
        engine = c.service.pool.prefill[0]
        object.__setattr__(engine, "origin", engine.origin.__class__("127.0.0.1", free_port()))
        status, body, _ = await post(http, f"{c.url}/v1/completions", {"prompt": "x" * 400, "max_tokens": 3})
        text = await scrape(http, f"{c.url}/metrics")
        decode_metrics = await scrape(http, f"{engine_url(c.decode)}/metrics")
        sent = await recorded(http, c.decode)
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    assert metric(text, obs.ROUTER_UPSTREAM_ERRORS + "_total", role="prefill") == 1
    assert metric(text, obs.ROUTER_RETRIES + "_total", role="prefill") == 1
    assert metric(text, obs.ROUTER_REQUESTS + "_total", outcome="ok") == 1
    # The first attempt's decode request (if it got out at all) was abandoned; the one
    # that answered carried no KV hand-off.
    assert sent[-1]["body"].get("kv_transfer_params") is None, sent
    assert metric(decode_metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 100
    assert c.decode.cores[0].load == 0


async def test_when_every_attempt_fails_the_client_learns_each_reason(http: aiohttp.ClientSession) -> None:
    async with cluster() as c:
        assert c.service.pool is not None
        for engine in (c.service.pool.prefill[0], c.service.pool.decode[0]):
            object.__setattr__(engine, "origin", engine.origin.__class__("127.0.0.1", free_port()))
        status, body, _ = await post(http, f"{c.url}/v1/completions", {"prompt": "x"})
        text = await scrape(http, f"{c.url}/metrics")
    message = body["error"]["message"]
    assert status == 502 and message.startswith("every attempt failed (2): prefill "), message
    assert "; decode " in message and "cannot connect" in message, message
    assert metric(text, obs.ROUTER_REQUESTS + "_total", outcome="upstream_error") == 1


async def test_client_disconnect_cancels_prefill_and_decode(
    http: aiohttp.ClientSession, wait_until: WaitUntil
) -> None:
    # A 30000-token prompt takes ~0.9 s to prefill at real time: leave during it.
    async with cluster(prefill_args=("--sim-time-scale", "1"), decode_args=("--sim-time-scale", "1")) as c:
        body = {"prompt": "word " * 24000, "max_tokens": 50, "stream": True}
        task = asyncio.ensure_future(post(http, f"{c.url}/v1/completions", body))
        await wait_until(
            lambda: c.prefill.cores[0].load and c.decode.cores[0].load,
            interval=0.01,
            message="both engines busy",
        )
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await wait_until(
            lambda: not c.prefill.cores[0].load and not c.decode.cores[0].load, message="both engines idle"
        )
        p_text = await scrape(http, f"http://127.0.0.1:{c.prefill.config.port}/metrics")
        d_text = await scrape(http, f"http://127.0.0.1:{c.decode.config.port}/metrics")
        r_text = await scrape(http, f"{c.url}/metrics")
        assert c.service.router is not None and c.service.router.inflight == 0
    assert metric(p_text, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(d_text, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(r_text, obs.ROUTER_REQUESTS + "_total", outcome="cancelled") == 1


async def test_client_disconnect_mid_stream_stops_decode(
    http: aiohttp.ClientSession, wait_until: WaitUntil
) -> None:
    async with cluster(decode_args=("--sim-time-scale", "1")) as c:
        body = {"prompt": "x", "max_tokens": 5000, "ignore_eos": True, "stream": True}
        async with http.post(f"{c.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
        await wait_until(lambda: not c.decode.cores[0].load, message="decode idle")
        d_text = await scrape(http, f"http://127.0.0.1:{c.decode.config.port}/metrics")
    assert metric(d_text, "vllm:request_success_total", finished_reason="abort") == 1


async def test_request_timeout(http: aiohttp.ClientSession, wait_until: WaitUntil) -> None:
    async with cluster("--request-timeout", "0.3", decode_args=("--sim-time-scale", "1")) as c:
        status, body, _ = await post(http, f"{c.url}/v1/completions", {"prompt": "x", "max_tokens": 5000})
        stream_status, raw, _ = await post(
            http, f"{c.url}/v1/completions", {"prompt": "x", "max_tokens": 5000, "stream": True}
        )
        # Both requests were answered at the timeout; the aborts reach decode after that.
        await wait_until(lambda: c.decode.cores[0].load == 0, message="decode's requests aborted")
    assert status == 504 and body["error"]["code"] == 504
    assert stream_status == 200 and raw.endswith(b"data: [DONE]\n\n") and b'"code":504' in raw


# ------------------------------------------------------------------------ admission, auth
async def test_slo_admission_rejects_early(http: aiohttp.ClientSession, wait_until: WaitUntil) -> None:
    # Until it has measured anything the router assumes 1000 prefill tokens/s: a
    # 2000-token prompt is predicted at 2 s, admitted alone (limit = 2 s own time x 1)
    # and rejected while another one is queued on the same prefill.
    async with cluster(
        "--admission-ttft-ms", "10", "--admission-reject-factor", "1", "--admission-prefill-rate", "1000",
        prefill_args=("--sim-time-scale", "1"),
    ) as c:  # fmt: skip
        body = {"prompt": "x" * 8000, "max_tokens": 2}
        first = asyncio.ensure_future(post(http, f"{c.url}/v1/completions", body))
        assert c.service.pool is not None
        prefill = c.service.pool.prefill[0]
        await wait_until(
            lambda: prefill.inflight_requests, interval=0.002, message="the first on the prefill"
        )
        status, error, headers = await post(http, f"{c.url}/v1/completions", body)
        assert (await first)[0] == 200
        text = await scrape(http, f"{c.url}/metrics")
    assert status == 429 and error["error"]["type"] == "RateLimitError"
    assert int(headers["Retry-After"]) >= 1
    assert metric(text, obs.ROUTER_REJECTIONS + "_total", reason="slo") == 1


async def test_engines_behind_an_api_key(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    """Engines started with --api-key refuse the router unless it sends their key."""
    key_file = tmp_path / "engine-key"
    key_file.write_text("engine-sekret\n")
    locked = ("--sim-profile", "zero", "--api-key", "engine-sekret")
    body = {"prompt": "x" * 100, "max_tokens": 2, "stream": True}
    async with cluster("--engine-api-key-file", str(key_file), prefill_args=locked, decode_args=locked) as c:
        status, raw, _ = await post(http, f"{c.url}/v1/completions", body)
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw
        direct, _, _ = await post(http, f"{engine_url(c.decode)}/v1/completions", body)
    assert direct == 401
    async with cluster(prefill_args=locked, decode_args=locked) as c:
        status, answer, _ = await post(http, f"{c.url}/v1/completions", {**body, "stream": False})
    # Not the client's fault: a 502 that says which engines refused the router.
    assert status == 502 and "prefill" in answer["error"]["message"], answer
    assert "HTTP 401" in answer["error"]["message"], answer


async def test_api_key(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sekret\n")
    async with cluster("--api-key-file", str(key_file)) as c:
        denied, body, _ = await post(http, f"{c.url}/v1/completions", {"prompt": "x"})
        wrong, _, _ = await post(
            http, f"{c.url}/v1/completions", {"prompt": "x"}, Authorization="Bearer nope"
        )
        allowed, _, _ = await post(
            http, f"{c.url}/v1/completions", {"prompt": "x"}, Authorization="Bearer sekret"
        )
        assert (await http.get(f"{c.url}/metrics")).status == 200  # scrapes need no key
    assert (denied, wrong, allowed) == (401, 401, 200)
    assert body["error"]["code"] == 401


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"\xff\xfe\x00", 400),
        (b"[]", 400),
        (b'{"prompt": 5}', 400),
        (b'{"prompt": "x", "max_tokens": -1}', 400),
        (b'{"prompt": "x", "n": 0}', 400),
        (b'{"prompt": ["a", "b"], "n": 9}', 400),  # 18 flows: past --max-fan-out
        (b'{"prompt": "x", "model": "other"}', 404),
    ],
)
async def test_bad_requests(http: aiohttp.ClientSession, body: bytes, status: int) -> None:
    async with cluster("--model", "sim-model") as c:
        got, answer, _ = await post(http, f"{c.url}/v1/completions", body)
        assert await recorded(http, c.prefill) == [] and await recorded(http, c.decode) == []
    assert got == status and answer["error"]["code"] == status


async def test_prefix_aware_policy_keeps_a_conversation_on_one_prefill(http: aiohttp.ClientSession) -> None:
    zero = ("--sim-profile", "zero")
    async with (
        simulator(*RECORD, "--kv-transfer-config", PRODUCER, *zero) as p1,
        simulator(*RECORD, "--kv-transfer-config", PRODUCER, *zero) as p2,
        simulator(*RECORD, "--kv-transfer-config", CONSUMER, *zero) as d,
        router(
            "--policy", "prefix-aware", "--prefill", prefill_url(p1), "--prefill", prefill_url(p2),
            "--decode", engine_url(d), ready=lambda pool: len(pool.prefill) >= 2,
        ) as service,
    ):  # fmt: skip
        base = f"http://127.0.0.1:{service.args.port}/v1/completions"
        history = "system prompt " * 200
        for turn in range(6):
            history += f" turn {turn} " * 20
            status, _, _ = await post(http, base, {"prompt": history, "max_tokens": 2})
            assert status == 200
        counts = [len(await recorded(http, p)) for p in (p1, p2)]
    assert sorted(counts) == [0, 6]


async def test_unknown_routes_and_methods_answer_in_openai_shape(http: aiohttp.ClientSession) -> None:
    async with cluster() as c:
        async with http.get(f"{c.url}/v1/completions") as resp:
            assert resp.status == 405 and (await resp.json())["error"]["code"] == 405
        async with http.post(f"{c.url}/v2/nothing", json={}) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == 404


async def test_prefill_dp_ranks_are_separate_backends(http: aiohttp.ClientSession) -> None:
    async with cluster(prefill_args=("--sim-profile", "zero", "--data-parallel-size", "2")) as c:
        assert c.service.pool is not None and len(c.service.pool.prefill) == 2
        for _ in range(4):
            status, _, _ = await post(http, f"{c.url}/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 200
        prefills, decodes = await recorded(http, c.prefill), await recorded(http, c.decode)
    ranks = [p["headers"]["X-data-parallel-rank"] for p in prefills]
    assert sorted(ranks) == ["0", "0", "1", "1"]
    by_transfer = {d["body"]["kv_transfer_params"]["transfer_id"]: d for d in decodes}
    for p in prefills:
        decode = by_transfer[p["body"]["kv_transfer_params"]["transfer_id"]]
        rank = int(p["headers"]["X-data-parallel-rank"])
        assert decode["body"]["kv_transfer_params"]["remote_engine_id"] == c.prefill.engine_ids[rank]
        assert c.prefill.engine_ids[rank].endswith(f"_dp{rank}")


async def test_usage_reports_the_prefill_legs_cached_tokens(http: aiohttp.ClientSession) -> None:
    """usage.prompt_tokens_details.cached_tokens is what prefill found cached, not what
    decode counts (it is handed the whole prompt's KV), streamed and not."""
    flags = ("--sim-profile", "zero", "--enable-prefix-caching", "--enable-prompt-tokens-details")
    async with cluster(prefill_args=flags, decode_args=flags) as c:
        body = {"prompt": list(range(1, 2049)), "max_tokens": 4, "ignore_eos": True}
        _, first, _ = await post(http, f"{c.url}/v1/completions", body)
        _, second, _ = await post(http, f"{c.url}/v1/completions", body)
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        _, raw, _ = await post(http, f"{c.url}/v1/completions", streamed)
    usage = [e["usage"] for e in sse(raw) if e.get("usage")]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < 2048  # whole blocks, the prompt's last token computed again
    assert usage[-1]["prompt_tokens_details"]["cached_tokens"] == cached


async def test_ttft_beyond_prefill_leaves_out_the_prompts_own_compute(http: aiohttp.ClientSession) -> None:
    """The prefill engine's answer carries its own compute for the prompt (vLLM's
    per-request metrics); the router's TTFT beyond prefill is its TTFT less that, and
    without the engine's figure it observes nothing rather than guess."""
    body = {"prompt": list(range(1, 2049)), "max_tokens": 4, "ignore_eos": True, "stream": True}
    beyond = obs.ROUTER_TTFT_BEYOND_PREFILL
    prefill = ("--enable-per-request-metrics",)
    async with cluster("--kv-probe-interval", "0", prefill_args=prefill, decode_args=("--sim-profile", "zero")) as c:
        status, _, _ = await post(http, f"{c.url}/v1/completions", body)
        router_metrics = await scrape(http, f"{c.url}/metrics")
        prefill_metrics = await scrape(http, f"{engine_url(c.prefill)}/metrics")
        answers = await recorded(http, c.prefill)
    assert status == 200 and len(answers) == 1
    own_s = metric(prefill_metrics, "vllm:request_prefill_time_seconds_sum")
    ttft_s = metric(router_metrics, obs.ROUTER_TTFT + "_sum")
    assert metric(router_metrics, beyond + "_count") == 1 and own_s > 0
    assert metric(router_metrics, beyond + "_sum") == pytest.approx(ttft_s - own_s, abs=1e-6)
    async with cluster() as c:  # engines without per-request metrics
        await post(http, f"{c.url}/v1/completions", body)
        router_metrics = await scrape(http, f"{c.url}/metrics")
    assert metric(router_metrics, obs.ROUTER_TTFT + "_count") == 1
    assert metric(router_metrics, beyond + "_count") == 0
