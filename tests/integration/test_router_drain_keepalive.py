"""A draining router sends its kept-alive clients elsewhere: after SIGTERM every answer
says `Connection: close` and ends its connection (an idle one's next request included:
it is answered, not cut), and a stream in flight finishes and then its connection closes. Behind a Service the
client's next request so opens a new connection, which reaches a router that stays,
instead of being refused on the old one (tests/e2e/test_router_pod_loss.py, in a cluster)."""

from __future__ import annotations

import asyncio
import json
import signal

from loopback import wait_until
from test_router_drain import engines, router

HEAD_END = b"\r\n\r\n"


async def request(writer: asyncio.StreamWriter, method: str, path: str, body: dict | None = None) -> None:
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: router\r\nContent-Length: {len(data)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    writer.write(head.encode() + b"\r\n" + data)
    await writer.drain()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = (await reader.readuntil(HEAD_END)).decode()
    status_line, *lines = head.strip().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers


async def test_sigterm_ends_keep_alive() -> None:
    async with (
        engines() as (prefill, decode),
        router(prefill, decode, "--drain-timeout", "20") as (proc, url),
    ):
        host, port = url.removeprefix("http://").split(":")
        idle_reader, idle_writer = await asyncio.open_connection(host, int(port))
        await request(idle_writer, "GET", "/health")
        status, headers = await read_head(idle_reader)
        assert status == 200 and headers.get("connection") != "close"
        await idle_reader.readexactly(int(headers["content-length"]))  # now idle, kept alive

        stream_reader, stream_writer = await asyncio.open_connection(host, int(port))
        body = {"prompt": "x", "max_tokens": 150, "ignore_eos": True, "stream": True}
        await request(stream_writer, "POST", "/v1/completions", body)
        status, headers = await read_head(stream_reader)
        assert status == 200 and headers.get("transfer-encoding") == "chunked"
        await stream_reader.readuntil(b"\n\n")  # the first token is in

        proc.send_signal(signal.SIGTERM)

        async def draining() -> bool:
            reader, writer = await asyncio.open_connection(host, int(port))
            await request(writer, "GET", "/ready")
            status, _ = await read_head(reader)
            writer.close()
            return status == 503

        await wait_until(draining, interval=0.02, message="readiness fails")
        # The idle connection is not cut under a request that may be on its way: its next
        # request is answered, and the connection ends with the answer.
        await request(idle_writer, "GET", "/health")
        status, headers = await read_head(idle_reader)
        assert status == 200 and headers.get("connection") == "close"
        await idle_reader.readexactly(int(headers["content-length"]))
        assert await asyncio.wait_for(idle_reader.read(), 10) == b""
        # A request that still reaches the router while the stream drains (behind a
        # Service: one already sent on a kept-alive connection): answered, not refused
        # (a refusal lost it in the chaos run), and its connection ends with the answer.
        late_reader, late_writer = await asyncio.open_connection(host, int(port))
        await request(late_writer, "POST", "/v1/completions", {"prompt": "late", "max_tokens": 2})
        status, headers = await read_head(late_reader)
        assert status == 200 and headers.get("connection") == "close"
        await late_reader.readexactly(int(headers["content-length"]))
        assert await asyncio.wait_for(late_reader.read(), 10) == b""

        # The stream finishes whole, then its connection closes.
        rest = await asyncio.wait_for(stream_reader.read(), 30)
        assert b"data: [DONE]" in rest and rest.endswith(b"0\r\n\r\n")
        for writer in (idle_writer, stream_writer, late_writer):
            writer.close()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
