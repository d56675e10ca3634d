"""Flexible engines (MooncakeConnector kv_both) behind the router, on the engine
simulator: the router makes each engine prefill or decode, and a change of the split
flips an engine under streaming load with no request lost or duplicated."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from loopback import engine_url, prefill_url, router, simulator

from conftest import wait_until
from pdcluster import constants as C
from pdcluster.enginesim.main import Simulator
from pdcluster.router.main import RouterService

BOTH = '{"kv_connector":"MooncakeConnector","kv_role":"kv_both"}'


@contextlib.asynccontextmanager
async def flexible_pool(
    engines: int, prefill_engines: int, profile: str = "zero"
) -> AsyncIterator[tuple[list[Simulator], RouterService]]:
    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                simulator("--kv-transfer-config", BOTH, "--sim-profile", profile, "--sim-record", "200")
            )
            for _ in range(engines)
        ]
        flags = [arg for sim in sims for arg in ("--flexible", prefill_url(sim))]
        service = await stack.enter_async_context(
            router(*flags, "--prefill-engines", str(prefill_engines), "--model", "sim-model")
        )
        yield sims, service


async def records(http: aiohttp.ClientSession, sim: Simulator) -> list[dict[str, Any]]:
    async with http.get(f"{engine_url(sim)}/sim/requests") as resp:
        found = await resp.json()
    return [r for r in found if not r["headers"].get("X-Request-Id", "").startswith("kv-probe-")]


def legs(found: list[dict[str, Any]], request_id: str) -> set[str]:
    """What an engine did for a request: prefill, decode, or whole."""
    out = set()
    for r in found:
        if r["headers"].get("X-Request-Id") != request_id:
            continue
        params = r["body"].get("kv_transfer_params") or {}
        out.add("prefill" if params.get("do_remote_decode") else "decode" if params.get("do_remote_prefill") else "whole")
    return out


async def complete(
    http: aiohttp.ClientSession, url: str, request_id: str, stream: bool = False, tokens: int = 8
) -> str:
    body = {
        "model": "sim-model", "prompt": f"request {request_id}", "max_tokens": tokens, "ignore_eos": True,
        "stream": stream,
    }  # fmt: skip
    async with http.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
    if not stream:
        return orjson.loads(raw)["choices"][0]["text"]
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]", raw[-300:]
    return "".join(orjson.loads(e)["choices"][0]["text"] for e in events[:-1] if orjson.loads(e)["choices"])


async def test_the_first_engines_in_pool_order_prefill_and_the_rest_decode() -> None:
    async with flexible_pool(3, prefill_engines=1) as (sims, service), aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{service.args.port}"
        assert service.pool is not None
        roles = [service.pool.roles[engine_url(s)] for s in sims]
        assert roles == [C.ROLE_PREFILL, C.ROLE_DECODE, C.ROLE_DECODE]
        for n in range(6):
            await complete(http, url, f"r{n}")
        found = [await records(http, s) for s in sims]
        for n in range(6):
            assert legs(found[0], f"r{n}") == {"prefill"}
            assert legs(found[1], f"r{n}") | legs(found[2], f"r{n}") == {"decode"}
        # Both decode engines served: the decode policy balances between them.
        assert all(any(legs(found[i], f"r{n}") for n in range(6)) for i in (1, 2))


async def test_a_lone_flexible_engine_serves_requests_whole() -> None:
    async with flexible_pool(1, prefill_engines=1) as (sims, service), aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{service.args.port}"
        text = await complete(http, url, "alone")
        assert text
        assert legs(await records(http, sims[0]), "alone") == {"whole"}


async def test_a_flip_under_streaming_load_loses_nothing() -> None:
    # Streams of 64 tokens at the H200 profile's pace: in flight when the split changes.
    async with (
        flexible_pool(3, prefill_engines=1, profile="h200-llama3.1-8b") as (sims, service),
        aiohttp.ClientSession() as http,
    ):
        url = f"http://127.0.0.1:{service.args.port}"
        pool, routed = service.pool, service.router
        assert pool is not None and routed is not None
        before = [asyncio.create_task(complete(http, url, f"before{n}", True, 64)) for n in range(12)]
        await wait_until(lambda: routed.inflight == 12, timeout=10, message="12 streams in flight")
        pool.assign(2)  # engine 1 flips from decode to prefill
        assert [pool.roles[engine_url(s)] for s in sims] == [C.ROLE_PREFILL, C.ROLE_PREFILL, C.ROLE_DECODE]
        # A new prefill -> decode pair takes traffic once its hand-off probe passes.
        prober = service.router.prober if service.router is not None else None
        assert prober is not None
        await wait_until(prober.settled, timeout=10, message="the flipped engine's pairs probed")
        assert routed.inflight > 0, "the flip came while streams were in flight"
        after = [asyncio.create_task(complete(http, url, f"after{n}", True, 64)) for n in range(12)]
        texts = await asyncio.gather(*before, *after)
        assert all(texts), "every stream answered in full"
        found = [await records(http, s) for s in sims]
        for n in range(12):
            # Each request: one prefill leg and one decode leg, never twice; a stream on
            # the flipped engine finished there.
            assert sum(len(legs(f, f"before{n}")) for f in found) == 2
            assert legs(found[2], f"after{n}") == {"decode"}
            assert legs(found[0], f"after{n}") | legs(found[1], f"after{n}") == {"prefill"}
        assert any(legs(found[1], f"after{n}") == {"prefill"} for n in range(12)), "the flipped engine prefills"
        assert any(legs(found[1], f"before{n}") == {"decode"} for n in range(12)), "it decoded before the flip"


async def test_a_short_prompt_skips_the_hand_off_when_asked() -> None:
    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                simulator("--kv-transfer-config", BOTH, "--sim-profile", "zero", "--sim-record", "50")
            )
            for _ in range(2)
        ]
        flags = [arg for sim in sims for arg in ("--flexible", prefill_url(sim))]
        service = await stack.enter_async_context(router(*flags, "--prefill-on-decode-below", "64"))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        url = f"http://127.0.0.1:{service.args.port}"
        body = {"prompt": "short", "max_tokens": 4, "ignore_eos": True}
        async with http.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "short"}) as r:
            assert r.status == 200
        body["prompt"] = "long " * 200  # about 250 tokens by the router's count
        async with http.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "long"}) as r:
            assert r.status == 200
        found = [await records(http, s) for s in sims]
        assert legs(found[0], "short") == set() and legs(found[1], "short") == {"whole"}
        assert legs(found[0], "long") == {"prefill"} and legs(found[1], "long") == {"decode"}
        async with http.get(f"{url}/metrics") as r:
            assert "pdcluster_router_local_prefills_total 1.0" in await r.text()
