"""The router's HTTP front against slow, silent and greedy clients, on loopback: a few
hundred connections that trickle their heads or bodies or send nothing are cut at their
deadlines while every ordinary request is served; a body declared over the limit is
answered 413 at once; past the connection limit a new connection gets a 503 and the open
ones keep working."""

from __future__ import annotations

import asyncio

import aiohttp
from loopback import counter, engine_url, router, simulator
from test_router_pd import post, scrape

from pdcluster import observability as obs

ZERO = ("--sim-profile", "zero")
SILENT, HEAD_TRICKLERS, BODY_TRICKLERS = 200, 100, 50
TRICKLE_S = 0.2  # a byte this often: well inside any idle timer, never a whole head or body
ANSWER_WITHIN_S = 15.0  # bounds a test that would otherwise hang; no figure is asserted on it


def completion(i: int) -> dict:
    return {"model": "sim-model", "prompt": f"story {i}", "max_tokens": 3, "ignore_eos": True}


async def silent(port: int) -> bytes:
    """Connect, send nothing; what the router sends before it hangs up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S)
    finally:
        writer.close()


async def trickle(port: int, start: bytes, byte: bytes) -> bytes:
    """Send `start`, then `byte` every TRICKLE_S until the router hangs up; what it answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.ensure_future(asyncio.wait_for(reader.read(), ANSWER_WITHIN_S))
    try:
        writer.write(start)
        while not answer.done():
            await asyncio.wait([answer], timeout=TRICKLE_S)
            if not answer.done():
                writer.write(byte)
        return await answer
    finally:
        writer.close()


async def test_slow_and_silent_clients_are_cut_while_requests_are_served() -> None:
    async with (
        simulator(*ZERO) as engine,
        router(
            "--colocated", engine_url(engine), "--kv-probe-interval", "0", "--head-timeout", "1",
            "--body-timeout", "1",
        ) as service,
        aiohttp.ClientSession() as http,
    ):  # fmt: skip
        port = service.args.port
        url = f"http://127.0.0.1:{port}"
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "
        body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
        holders = asyncio.gather(
            *(silent(port) for _ in range(SILENT)),
            *(trickle(port, head, b"a") for _ in range(HEAD_TRICKLERS)),
            *(trickle(port, body, b" ") for _ in range(BODY_TRICKLERS)),
        )
        # Ordinary requests while the slow connections are open, and after they are cut.
        during = await asyncio.gather(
            *(post(http, f"{url}/v1/completions", completion(i)) for i in range(60))
        )
        answers = await holders
        after = await asyncio.gather(*(post(http, f"{url}/v1/completions", completion(i)) for i in range(20)))
        metrics = await scrape(http, f"{url}/metrics")
    assert [status for status, _, _ in during + after] == [200] * 80
    silent_answers = answers[:SILENT]
    head_answers = answers[SILENT : SILENT + HEAD_TRICKLERS]
    body_answers = answers[SILENT + HEAD_TRICKLERS :]
    assert silent_answers == [b""] * SILENT  # nothing asked, nothing answered
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in head_answers + body_answers)
    assert b"request head not received" in head_answers[0] and b"request body" in body_answers[0]
    cut = obs.ROUTER_CONNECTIONS_CUT + "_total"
    assert counter(metrics, cut, reason="head_timeout") == SILENT + HEAD_TRICKLERS
    assert counter(metrics, cut, reason="body_timeout") == BODY_TRICKLERS
    assert counter(metrics, cut, reason="too_large") == counter(metrics, cut, reason="over_limit") == 0


async def test_a_body_declared_too_large_is_refused_at_once_and_the_connection_limit_holds() -> None:
    limit = 20
    async with (
        simulator(*ZERO) as engine,
        router(
            "--colocated", engine_url(engine), "--kv-probe-interval", "0", "--max-connections", str(limit)
        ) as service,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http,
    ):
        port = service.args.port
        url = f"http://127.0.0.1:{port}"
        # The default body timeout is 60 s: an answer that comes sooner than that comes at the head.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000000000\r\n\r\n{"
        )
        refused = await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S)
        writer.close()
        # One kept-alive client connection, then connections up to the limit, each answered once
        # so that the router holds it.
        assert (await post(http, f"{url}/v1/completions", completion(0)))[0] == 200
        held = []
        for _ in range(limit - 1):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WITHIN_S)).startswith(
                b"HTTP/1.1 200 "
            )
            held.append(writer)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        over = await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S)
        writer.close()
        still = await post(http, f"{url}/v1/completions", completion(1))
        metrics = await scrape(http, f"{url}/metrics")
        for writer in held:
            writer.close()
    assert refused.startswith(b"HTTP/1.1 413 ") and b"Connection: close" in refused
    assert over.startswith(b"HTTP/1.1 503 ") and b"open connections" in over
    assert still[0] == 200  # the kept-alive connection works past the limit
    cut = obs.ROUTER_CONNECTIONS_CUT + "_total"
    assert counter(metrics, cut, reason="too_large") == 1
    assert counter(metrics, cut, reason="over_limit") == 1
