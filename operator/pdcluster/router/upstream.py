"""A small HTTP/1.1 client for the router's calls to engines.

Measured on the router's hot path (benchmarks/router_bench.py, 4-token requests), the
router spent about 330 us of CPU per request with aiohttp's client and about 170 us with
this one: a bare asyncio protocol with keep-alive pools per backend and none of
aiohttp's per-request machinery. It speaks just what vLLM's server (uvicorn) and the
simulator answer: status line, headers, and a body framed by Content-Length, chunked
encoding or connection close.

Use:
    response = await pool.request(origin, b"POST", b"/v1/completions", headers, body)
    async for chunk in response.iter_chunks(): ...   # or: await response.read()
    response.close()   # returns a finished connection to the pool, drops an unfinished one
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

# Engines behind uvicorn close idle keep-alive connections after 5 s
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); do not reuse one that has idled nearly that long.
IDLE_REUSE_S = 4.0
CONNECT_TIMEOUT_S = 5.0
# Stop reading from an engine while this much answer waits for a slow client.
_HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """The engine could not be reached or broke the exchange."""


@dataclass(frozen=True)
class Origin:
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Origin:
        rest = url.removeprefix("http://")
        if rest == url:
            raise ValueError(f"{url!r}: only http:// engines are supported")
        hostport = rest.split("/", 1)[0]
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{url!r}: expected http://HOST:PORT")
        return cls(host.strip("[]"), int(port))

    @property
    def host_header(self) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}".encode()


class _Connection(asyncio.Protocol):
    __slots__ = (
        "_buf",
        "_chunks",
        "_head_waiter",
        "_paused",
        "_remaining",
        "_state",
        "_waiter",
        "buffered",
        "closed",
        "complete",
        "error",
        "headers",
        "keep_alive",
        "last_used",
        "received_any",
        "status",
        "transport",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_used = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self._buf = bytearray()
        self._state = "head"
        self._remaining = 0
        self._chunks: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        self._head_waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.buffered = 0
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.keep_alive = True
        self.complete = False
        self.received_any = False
        self.error: Exception | None = None

    # ------------------------------------------------------------ protocol callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            if self._state == "close":  # body framed by connection close
                self.complete = True
            else:
                self.error = UpstreamError(f"connection lost: {exc or 'closed by peer'}")
        self._wake()

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        self._buf += data
        try:
            self._parse()
        except (ValueError, IndexError) as e:
            self.error = UpstreamError(f"malformed HTTP answer: {e}")
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self._wake()

    def _wake(self) -> None:
        for waiter in (self._head_waiter, self._waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._head_waiter = self._waiter = None

    # ------------------------------------------------------------ parsing
    def _parse(self) -> None:
        """Consume the buffer state by state, until it is empty or a state needs more bytes."""
        buf = self._buf
        while buf:
            state = self._state
            if state == "head":
                if not self._parse_head(buf):
                    return
            elif state == "body":
                if self._take_framed(buf):
                    self._done()
            elif state == "size":
                if not self._parse_chunk_size(buf):
                    return
            elif state == "chunk":
                if self._take_framed(buf):
                    self._state = "chunk_end"
            elif state == "chunk_end":
                if len(buf) < 2:
                    return
                del buf[:2]
                self._state = "size"
            elif state == "trailer":
                if not self._parse_trailer_line(buf):
                    return
            elif state == "close":
                self._push(bytes(buf))
                buf.clear()
            else:  # "done": bytes after a complete answer are a protocol error
                raise ValueError("data after the end of the answer")

    def _parse_head(self, buf: bytearray) -> bool:
        """Status line and headers, then how the body is framed; False until all have come."""
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(buf[:end]).split(b"\r\n")
        del buf[: end + 4]
        self.status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        self.headers = headers
        self.keep_alive = headers.get(b"connection", b"").lower() != b"close"
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            self._state = "size"
        elif b"content-length" in headers:
            self._remaining = int(headers[b"content-length"])
            self._state = "body"
            if self._remaining == 0:
                self._done()
        else:
            self._state = "close"
            self.keep_alive = False
        return True

    def _take_framed(self, buf: bytearray) -> bool:
        """Body bytes of a known length (the whole body, or one chunk); True once all taken."""
        take = min(self._remaining, len(buf))
        self._push(bytes(buf[:take]))
        del buf[:take]
        self._remaining -= take
        return self._remaining == 0

    def _parse_chunk_size(self, buf: bytearray) -> bool:
        end = buf.find(b"\r\n")
        if end < 0:
            return False
        size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
        del buf[: end + 2]
        if size == 0:
            self._state = "trailer"
        else:
            self._remaining = size
            self._state = "chunk"
        return True

    def _parse_trailer_line(self, buf: bytearray) -> bool:
        """One trailer line; the empty one ends the answer."""
        end = buf.find(b"\r\n")
        if end < 0:
            return False
        del buf[: end + 2]
        if end == 0:
            self._done()
        return True

    def _push(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self.buffered += len(data)
            if self.buffered > _HIGH_WATER and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()

    def _done(self) -> None:
        self._state = "done"
        self.complete = True

    # ------------------------------------------------------------ consumer side
    async def wait_head(self) -> None:
        while self._state == "head" and self.error is None:
            self._head_waiter = asyncio.get_running_loop().create_future()
            await self._head_waiter
        if self.error is not None and self._state == "head":
            raise self.error

    def take(self) -> list[bytes]:
        chunks, self._chunks = self._chunks, []
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunks

    async def wait_body(self) -> None:
        if self._chunks or self.complete:
            return
        if self.error is not None:
            raise self.error
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter
        if self.error is not None and not self._chunks:
            raise self.error


class Response:
    """An engine's answer; iterate or read the body, then close()."""

    __slots__ = ("_conn", "_pool_idle", "status")

    def __init__(self, conn: _Connection, pool_idle: list[_Connection]):
        self._conn = conn
        self._pool_idle = pool_idle
        self.status = conn.status

    def header(self, name: bytes) -> bytes | None:
        return self._conn.headers.get(name)

    async def first_bytes(self) -> None:
        """Until some of the body has arrived (or it ended); consumes nothing."""
        await self._conn.wait_body()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            await conn.wait_body()
            chunks = conn.take()
            if chunks:
                yield chunks[0] if len(chunks) == 1 else b"".join(chunks)
            elif conn.complete:
                return

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_chunks()])

    def close(self) -> None:
        """Reuse the connection if the answer was read to its end, else drop it (an
        engine sees the drop as a client disconnect and aborts the request)."""
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None:
            conn._reset()
            conn.last_used = time.monotonic()
            self._pool_idle.append(conn)
        elif conn.transport is not None and not conn.closed:
            conn.closed = True
            conn.transport.close()


@dataclass
class UpstreamPool:
    """Keep-alive connections, one idle list per engine."""

    _idle: dict[Origin, list[_Connection]] = field(default_factory=dict)

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, conn = await loop.create_connection(_Connection, origin.host, origin.port)
        except (OSError, TimeoutError) as e:
            raise UpstreamError(f"cannot connect to {origin.host}:{origin.port}: {e!r}") from e
        return conn

    def _reusable(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.last_used < IDLE_REUSE_S:
                return conn
            if not conn.closed and conn.transport is not None:
                conn.transport.close()
        return None

    async def request(
        self, origin: Origin, method: bytes, path: bytes, headers: bytes, body: bytes
    ) -> Response:
        """Send a request and wait for the answer's head. `headers` are complete
        `Name: value\\r\\n` lines, without Host and Content-Length."""
        message = b"".join(
            (
                method, b" ", path, b" HTTP/1.1\r\nHost: ", origin.host_header,
                b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n", headers, b"\r\n", body,
            )
        )  # fmt: skip
        idle = self._idle.setdefault(origin, [])
        conn = self._reusable(origin)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(origin)
        while True:
            assert conn.transport is not None
            conn.transport.write(message)
            try:
                await conn.wait_head()
            except UpstreamError:
                # The engine closed a kept-alive connection as we reused it, before
                # reading anything: safe to send once more on a new one.
                if reused and not conn.received_any:
                    reused = False
                    conn = await self._connect(origin)
                    continue
                raise
            except BaseException:
                if conn.transport is not None:
                    conn.transport.close()
                raise
            return Response(conn, idle)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()
