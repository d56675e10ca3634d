"""The router in front of colocated engines (a plain pool: no KV hand-off) and of a mixed
fleet, on loopback: each request served whole by one engine, balanced, admitted,
measured and retried as PD requests are."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from loopback import CONSUMER, PRODUCER, counter, engine_url, prefill_url, router, simulator
from test_router_pd import WaitUntil, post, recorded, scrape, sse

from pdcluster import observability as obs

RECORD = ("--sim-record", "200")
ZERO = ("--sim-profile", "zero")


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def completion(i: int, stream: bool = False) -> dict:
    return {
        "model": "sim-model",
        "prompt": f"story {i}",
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": stream,
    }


async def test_a_plain_pool_serves_each_request_on_one_engine(http: aiohttp.ClientSession) -> None:
    async with (
        simulator(*RECORD, *ZERO) as a,
        simulator(*RECORD, *ZERO) as b,
        router(
            "--colocated", engine_url(a), "--colocated", engine_url(b), "--kv-probe-interval", "0"
        ) as service,
    ):
        url = f"http://127.0.0.1:{service.args.port}"
        async with http.get(f"{url}/ready") as resp:
            assert resp.status == 200
        answers = await asyncio.gather(
            *(post(http, f"{url}/v1/completions", completion(i)) for i in range(12))
        )
        status, raw, _ = await post(http, f"{url}/v1/completions", completion(99, stream=True))
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        chat_status, chat_answer, _ = await post(http, f"{url}/v1/chat/completions", chat)
        got = [await recorded(http, a), await recorded(http, b)]
        metrics = await scrape(http, f"{url}/metrics")
        async with http.get(f"{url}/backends") as resp:
            backends = await resp.json()
    assert [s for s, _, _ in answers] == [200] * 12
    assert all(answer["usage"]["completion_tokens"] == 5 for _, answer, _ in answers)
    assert status == 200 and len([e for e in sse(raw) if e["choices"]]) == 5
    assert chat_status == 200 and chat_answer["usage"]["completion_tokens"] == 3
    # Balanced, and each engine got the request as the client sent it: no KV hand-off.
    assert all(got) and sum(map(len, got)) == 14
    assert all("kv_transfer_params" not in r["body"] for records in got for r in records)
    assert {r["body"]["max_tokens"] for records in got for r in records} == {5, 3}
    assert counter(metrics, obs.ROUTER_TTFT + "_count") == 1
    assert counter(metrics, obs.ROUTER_BACKENDS, role="colocated") == 2
    assert counter(metrics, obs.ROUTER_INFLIGHT_TOKENS, role="colocated") == 0  # all released
    assert {e["url"] for e in backends["colocated"]} == {engine_url(a), engine_url(b)}


async def test_a_failed_colocated_engine_is_retried_on_another(http: aiohttp.ClientSession) -> None:
    async with simulator(*RECORD, *ZERO) as alive:
        dead = engine_url(alive).rsplit(":", 1)[0] + ":1"  # nothing listens on port 1
        async with router(
            "--colocated", dead, "--colocated", engine_url(alive), "--kv-probe-interval", "0"
        ) as service:
            url = f"http://127.0.0.1:{service.args.port}"
            answers = await asyncio.gather(
                *(post(http, f"{url}/v1/completions", completion(i)) for i in range(6))
            )
            metrics = await scrape(http, f"{url}/metrics")
    assert [s for s, _, _ in answers] == [200] * 6
    assert counter(metrics, obs.ROUTER_RETRIES + "_total", role="colocated") >= 1
    assert counter(metrics, obs.ROUTER_UPSTREAM_ERRORS + "_total", role="colocated", backend=dead) >= 1


async def test_admission_weighs_a_colocated_engine_like_a_prefill(
    http: aiohttp.ClientSession, wait_until: WaitUntil
) -> None:
    """An engine assumed to prefill 10 tokens/s: a 100-token prompt alone takes 10 s, so
    with another queued (20 s) it misses 1.5x that and is rejected with Retry-After, as
    on PD. The first, a hundred times slower than the H200 profile, is still in flight."""
    body = {"model": "sim-model", "prompt": "x" * 400, "max_tokens": 50, "ignore_eos": True}
    async with (
        simulator(*RECORD, "--sim-time-scale", "0.01") as engine,
        router(
            "--colocated", engine_url(engine), "--admission-prefill-rate", "10",
            "--admission-reject-factor", "1.5", "--kv-probe-interval", "0",
        ) as service,
    ):  # fmt: skip
        assert service.pool is not None
        url = f"http://127.0.0.1:{service.args.port}"
        first = asyncio.ensure_future(post(http, f"{url}/v1/completions", body))
        engine = service.pool.colocated[0]
        await wait_until(lambda: engine.inflight_requests, interval=0.01, message="the first in flight")
        status, _, headers = await post(http, f"{url}/v1/completions", body)
        assert not first.done()
        first.cancel()
    assert status == 429 and int(headers["Retry-After"]) >= 1


async def test_a_mixed_fleet_uses_both_paths(http: aiohttp.ClientSession) -> None:
    async with (
        simulator(*RECORD, *ZERO, "--kv-transfer-config", PRODUCER) as p,
        simulator(*RECORD, *ZERO, "--kv-transfer-config", CONSUMER) as d,
        simulator(*RECORD, *ZERO) as e,
        router(
            "--prefill", prefill_url(p), "--decode", engine_url(d), "--colocated", engine_url(e),
            "--kv-probe-interval", "0",
        ) as service,
    ):  # fmt: skip
        url = f"http://127.0.0.1:{service.args.port}"
        answers = await asyncio.gather(
            *(post(http, f"{url}/v1/completions", completion(i)) for i in range(10))
        )
        prefilled, decoded, plain = await recorded(http, p), await recorded(http, d), await recorded(http, e)
    assert [s for s, _, _ in answers] == [200] * 10
    assert prefilled and plain and len(prefilled) + len(plain) == 10
    assert len(decoded) == len(prefilled)  # every PD request was decoded by the decode engine
    assert all(r["body"]["kv_transfer_params"]["do_remote_prefill"] for r in decoded)
