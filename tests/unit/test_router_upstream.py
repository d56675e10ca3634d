"""The router's HTTP/1.1 answer parser, fed byte streams split at every position."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.router.upstream import Origin, Response, UpstreamError, _Connection

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"7\r\ndata: a\r\n"
    b"9;ext=1\r\ndata: bcd\r\n"
    b"0\r\nX-Trailer: t\r\n\r\n"
)
SIZED = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"


class _Transport:
    def __init__(self) -> None:
        self.closed = False
        self.paused = False

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def feed(conn: _Connection, data: bytes, split: int) -> None:
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    for part in (data[:split], data[split:]):
        if part:
            conn.data_received(part)


@pytest.mark.parametrize("split", range(len(CHUNKED) + 1))
async def test_chunked_answer_at_any_split(split: int) -> None:
    conn = _Connection()
    feed(conn, CHUNKED, split)
    assert conn.complete and conn.error is None
    assert conn.status == 200 and conn.headers[b"content-type"] == b"text/event-stream"
    assert b"".join(conn.take()) == b"data: adata: bcd"
    assert conn.keep_alive


@pytest.mark.parametrize("split", range(len(SIZED) + 1))
async def test_sized_answer_at_any_split(split: int) -> None:
    conn = _Connection()
    feed(conn, SIZED, split)
    assert conn.complete and conn.status == 400
    assert b"".join(conn.take()) == b"hello"
    assert not conn.keep_alive


async def test_body_until_close() -> None:
    conn = _Connection()
    feed(conn, b"HTTP/1.1 200 OK\r\n\r\npart one, ", 0)
    conn.data_received(b"part two")
    assert not conn.complete
    conn.connection_lost(None)
    assert conn.complete and b"".join(conn.take()) == b"part one, part two"


async def test_cut_off_answer_is_an_error() -> None:
    conn = _Connection()
    feed(conn, SIZED[:-2], 0)
    conn.connection_lost(None)
    assert not conn.complete and isinstance(conn.error, UpstreamError)
    response = Response(conn, [])
    with pytest.raises(UpstreamError):
        await response.read()


async def test_garbage_is_an_error_not_a_crash() -> None:
    conn = _Connection()
    feed(conn, b"HTTP/1.1 abc\r\n\r\n", 0)
    assert isinstance(conn.error, UpstreamError) and conn.closed


async def test_read_returns_the_body_and_pools_the_connection() -> None:
    conn = _Connection()
    feed(conn, CHUNKED, 20)
    idle: list[_Connection] = []
    response = Response(conn, idle)
    assert await response.read() == b"data: adata: bcd"
    response.close()
    assert idle == [conn] and conn.status == 0  # reset for the next exchange


async def test_unfinished_answer_drops_the_connection() -> None:
    conn = _Connection()
    feed(conn, CHUNKED[:-5], 0)
    idle: list[_Connection] = []
    Response(conn, idle).close()
    assert idle == [] and conn.transport.closed  # type: ignore[union-attr]


async def test_slow_reader_pauses_the_engine() -> None:
    conn = _Connection()
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 3000000\r\n\r\n" + b"x" * 2_000_000)
    assert conn.transport.paused  # type: ignore[union-attr]
    assert sum(map(len, conn.take())) == 2_000_000
    assert not conn.transport.paused  # type: ignore[union-attr]


async def test_wait_head_wakes_on_data() -> None:
    conn = _Connection()
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    waiting = asyncio.ensure_future(conn.wait_head())
    await asyncio.sleep(0)
    assert not waiting.done()
    conn.data_received(SIZED)
    await waiting
    assert conn.status == 400


@pytest.mark.parametrize(
    ("url", "origin"),
    [("http://127.0.0.1:8000", Origin("127.0.0.1", 8000)), ("http://[fd00::1]:80/x", Origin("fd00::1", 80))],
)
def test_origin(url: str, origin: Origin) -> None:
    assert Origin.parse(url) == origin


def test_origin_host_header() -> None:
    assert Origin("fd00::1", 80).host_header == b"[fd00::1]:80"
