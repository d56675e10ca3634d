"""SIGTERM: the router fails readiness, finishes in-flight streams and what still arrives
on open connections, exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from loopback import CONSUMER, PRODUCER, engine_url, free_port, prefill_url, simulator, wait_until

ROUTER = str(Path(sys.executable).parent / "pdcluster-router")
WaitUntil = Callable[..., Awaitable[Any]]


@contextlib.asynccontextmanager
async def engines() -> AsyncIterator[tuple[str, str]]:
    """A prefill and a decode simulator at real time (decode steps of ~6 ms)."""
    async with (
        simulator("--kv-transfer-config", PRODUCER, model="m") as p,
        simulator("--kv-transfer-config", CONSUMER, model="m") as d,
    ):
        yield prefill_url(p), engine_url(d)


@contextlib.asynccontextmanager
async def router(
    prefill: str, decode: str, *args: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        ROUTER, "--host", "127.0.0.1", "--port", str(port), "--prefill", prefill, "--decode", decode, *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    return await ready_status(http, url) == 200
                return False

            await wait_until(ready, interval=0.05, message="router ready")
        yield proc, url
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def stream(
    http: aiohttp.ClientSession, url: str, max_tokens: int, mid_stream: list[str]
) -> tuple[int, list[bytes]]:
    """One stream's status and events; appends to `mid_stream` once its first token is in."""
    body = {"prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    raw = b""
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        with contextlib.suppress(aiohttp.ClientError):  # a stream cut by the router ends here
            raw = await resp.content.readuntil(b"\n\n")
            mid_stream.append(url)
            raw += await resp.read()
    return resp.status, [e for e in raw.split(b"\n\n") if e]


async def ready_status(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/ready") as resp:
        return resp.status


async def test_sigterm_drains_in_flight_streams(wait_until: WaitUntil) -> None:
    async with (
        engines() as (prefill, decode),
        router(prefill, decode, "--drain-timeout", "20") as (proc, url),
    ):
        async with aiohttp.ClientSession() as http:
            mid_stream: list[str] = []
            streams = [asyncio.ensure_future(stream(http, url, 150, mid_stream)) for _ in range(4)]
            await wait_until(lambda: len(mid_stream) == 4, interval=0.02, message="four streams begun")
            proc.send_signal(signal.SIGTERM)

            async def refusing() -> bool:
                return await ready_status(http, url) == 503

            await wait_until(refusing, interval=0.02, message="readiness fails")
            async with http.get(f"{url}/health") as resp:
                assert resp.status == 200
            # A late request on an open connection is served (the Service sends no new
            # connection to a terminating pod), and its connection is closed after it.
            async with http.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}) as resp:
                assert resp.status == 200 and resp.headers.get("Connection", "").lower() == "close"
                assert len((await resp.json())["choices"][0]["text"].split()) == 2
            results = await asyncio.gather(*streams)
        assert await asyncio.wait_for(proc.wait(), 10) == 0  # the streams are done: nothing to wait for
        assert proc.stderr is not None
        log = (await proc.stderr.read()).decode()
    assert "draining 4 in-flight requests" in log and "drain timeout" not in log, log
    for status, events in results:
        assert status == 200 and events[-1] == b"data: [DONE]"
        tokens = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        assert len(tokens) == 150 and tokens[-1]["choices"][0]["finish_reason"] == "length"


async def test_drain_timeout_bounds_the_wait(wait_until: WaitUntil) -> None:
    async with (
        engines() as (prefill, decode),
        router(prefill, decode, "--drain-timeout", "0.5") as (proc, url),
        aiohttp.ClientSession() as http,
    ):
        mid_stream: list[str] = []
        long_stream = asyncio.ensure_future(stream(http, url, 5000, mid_stream))  # ~30 s
        await wait_until(lambda: mid_stream, interval=0.02, message="the stream begun")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert proc.stderr is not None
        log = (await proc.stderr.read()).decode()
        _, events = await long_stream
    # The drain waited out its timeout with the stream still in flight, then cut it.
    assert "drain timeout: dropping 1 requests" in log, log
    assert len(events) < 5000
