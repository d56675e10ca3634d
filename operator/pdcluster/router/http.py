"""The router's HTTP/1.1 server: asyncio protocols and httptools' parser (llhttp).

Every client request crosses this front, so it does the least it can: one parser
callback per header, the whole body in one buffer, a response head built as bytes and
sent with its body in one write. aiohttp's server does much more per request (request
objects, multidicts, stream readers with flow control, response preparation), which
cost the router about half its CPU on short requests (docs/benchmarks.md).

What it keeps of a general server: keep-alive and pipelining (answers in order), chunked
and Content-Length bodies, `Expect: 100-continue`, limits on head and body size,
HTTP/1.0 clients, streamed answers with chunked encoding and write backpressure, an idle
timeout, and handler cancellation when the client goes away (what aiohttp calls
handler_cancellation): the router's upstream requests are aborted with it.

Slow and silent clients cannot hold it: each connection has one deadline for what it is
doing (a head within `head_timeout_s` of the connection's opening or of the head's first
byte on a kept-alive connection, a body within `body_timeout_s` of its head's end, the
next request within `keepalive_s` of an answer), however the bytes trickle; none while
its request is answered. A sweep over the open connections once a second (more often for
timeouts under 4 s) cuts those past their deadline, so a request costs a few attribute
writes and no timer of its own. A body declared over the limit is refused at its head,
and connections past `max_connections` get a 503; refusals linger (input read and
dropped) for at most as many connections again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import httptools

from pdcluster.router.http_messages import Request, Response, Stream, response_head

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
KEEPALIVE_S = 75.0  # aiohttp's and nginx's default
HEAD_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 4096
LINGER_S = 2.0  # after a refusal, how long the client's remaining input is read and dropped
_MAX_SWEEP_S = 1.0  # deadlines are kept to within this (or a quarter of the shortest timeout)
_MAX_QUEUED = 8  # pipelined requests buffered before reading pauses
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


# What a connection is doing, which says what its deadline is for.
_OPENED = 0  # accepted, no byte yet: the first head is due
_HEAD = 1  # a head in progress
_BODY = 2  # a body in progress
_BUSY = 3  # a request is answered (or waits in the pipeline): no deadline of the client's
_IDLE = 4  # kept alive between requests

_NEVER = float("inf")


Handler = Callable[[Request], Awaitable["Response | Stream"]]


class _Connection(asyncio.Protocol):
    __slots__ = (
        "_body",
        "_drain",
        "_head_bytes",
        "_headers",
        "_parser",
        "_phase",
        "_queue",
        "_read_paused",
        "_received_at",
        "_task",
        "_url",
        "closed",
        "deadline",
        "server",
        "transport",
        "write_paused",
    )  # fmt: skip

    def __init__(self, server: HttpServer):
        self.server = server
        self._parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.closed = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._queue: deque[Request] = deque()
        self._read_paused = False
        self._task: asyncio.Task[None] | None = None
        self._phase = _OPENED
        self.deadline = _NEVER  # server.clock() time by which the client must have done its part
        self._received_at = 0.0  # when the input being parsed arrived
        self._new_message()

    def _new_message(self) -> None:
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body = bytearray()
        self._head_bytes = 0

    # ------------------------------------------------------------------ transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        server = self.server
        if len(server.connections) >= server.max_connections:
            # The open connections keep working; this one is told so and hung up.
            server.on_cut("over_limit")
            self._refuse(503, f"the router has {server.max_connections} open connections, its limit")
            return
        server.connections.add(self)
        self.deadline = server.clock() + server.head_timeout_s

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.server.lingering.discard(self)
        if self._task is not None:
            self._task.cancel()  # the client left: stop its work upstream
        self._queue.clear()
        self._wake_drain()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self.write_paused and not self.closed:
            self._drain = self.server.loop.create_future()
            await self._drain
        if self.closed:
            raise ConnectionResetError("the client closed the connection")

    @property
    def idle(self) -> bool:
        """Kept alive between requests, nothing of a next one received."""
        return self._phase == _IDLE

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.close()

    def expire(self) -> None:
        """The deadline passed: cut the connection, saying why where a request was begun."""
        if self._read_paused:
            return  # the server stopped reading, not the client: the deadline restarts on resume
        self.deadline = _NEVER
        server, phase = self.server, self._phase
        if phase == _IDLE:
            self.close()  # an ordinary end of keep-alive
        elif phase == _OPENED:
            server.on_cut("head_timeout")
            self.close()  # not a byte received: there is no request to answer
        elif phase == _HEAD:
            server.on_cut("head_timeout")
            self._refuse(408, f"request head not received within {server.head_timeout_s:g} s")
        elif phase == _BODY:
            server.on_cut("body_timeout")
            self._refuse(408, f"request body not received within {server.body_timeout_s:g} s")

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return  # refused: dropped until the lingering close
        self._received_at = self.server.clock()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            self._refuse(400, f"malformed HTTP request: {e}")

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that cannot be parsed or taken, and hang up. Closing at once
        with unread input sends a reset, which some client stacks act on before they read
        the answer, so input is read and dropped for a moment first (a lingering close)."""
        if self.closed:
            return
        self.closed = True
        self.deadline = _NEVER
        server = self.server
        body = server.error_body(status, message)
        head = response_head(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], True)
        self.transport.write(head + b"\r\n" + body)
        if self._task is not None:
            self._task.cancel()
        self.transport.write_eof()
        server.connections.discard(self)  # counted with the refusals now, not the open connections
        if len(server.lingering) < server.max_connections:
            server.lingering.add(self)
            server.loop.call_later(LINGER_S, self.transport.close)
        else:  # a flood of refusals may not hold more descriptors than the connections do
            self.transport.close()

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        self._new_message()
        if self._phase != _OPENED:  # a kept-alive connection: the head is due from its first byte
            self.deadline = self._received_at + self.server.head_timeout_s
        self._phase = _HEAD

    def _head_fits(self, size: int) -> bool:
        self._head_bytes += size
        if self._head_bytes <= MAX_HEAD_BYTES:
            return True
        self._refuse(431, f"request head larger than {MAX_HEAD_BYTES} bytes")
        return False

    def on_url(self, url: bytes) -> None:
        if self._head_fits(len(url)):
            self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._head_fits(len(name) + len(value)):
            return
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        previous = self._headers.get(key)
        self._headers[key] = text if previous is None else f"{previous}, {text}"

    def on_headers_complete(self) -> None:
        if self.closed:
            return
        server = self.server
        length = self._headers.get("content-length", "")
        if length.isdigit() and int(length) > server.max_body:
            self._refuse_too_large()  # at once: reading a body only to drop it lets the client hold us
            return
        self._phase = _BODY
        self.deadline = self._received_at + server.body_timeout_s
        if self._headers.get("expect", "").lower() == "100-continue":
            self.transport.write(_CONTINUE)

    def _refuse_too_large(self) -> None:
        self.server.on_cut("too_large")
        self._refuse(413, f"request body larger than {self.server.max_body} bytes")

    def on_body(self, body: bytes) -> None:
        if self.closed:
            return
        self._body += body
        if len(self._body) > self.server.max_body:  # chunked: known only once it passes the limit
            self._refuse_too_large()

    def on_message_complete(self) -> None:
        if self.closed:
            return
        parser = self._parser
        path = self._url.split(b"?", 1)[0].decode("latin-1")
        request = Request(
            self,
            parser.get_method().decode("latin-1"),
            path,
            self._headers,
            bytes(self._body),
            parser.should_keep_alive(),
            parser.get_http_version(),
        )
        self._phase = _BUSY
        self.deadline = _NEVER
        if self._task is None:
            self._task = self.server.loop.create_task(self._serve(request))
        else:  # pipelined: answered in order
            self._queue.append(request)
            if len(self._queue) >= _MAX_QUEUED and not self._read_paused:
                self._read_paused = True
                self.transport.pause_reading()

    def _resume_reading(self) -> None:
        self._read_paused = False
        self.transport.resume_reading()
        # A request begun before the pause gets its full time again from now.
        server = self.server
        if self._phase == _HEAD:
            self.deadline = server.clock() + server.head_timeout_s
        elif self._phase == _BODY:
            self.deadline = server.clock() + server.body_timeout_s

    # ------------------------------------------------------------------ answers
    def start_stream(self, request: Request, status: int, headers: list[tuple[str, str]]) -> Stream:
        request.keep_alive = request.keep_alive and not self.server.closing
        chunked = request.version != "1.0"
        head = response_head(status, headers, not request.keep_alive)
        head += b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"\r\n"
        if not chunked:
            request.keep_alive = False  # the end of the answer is the end of the connection
        if not self.closed:
            self.transport.write(head)
        return Stream(self, chunked)

    def _respond(self, request: Request, response: Response) -> None:
        request.keep_alive = request.keep_alive and not self.server.closing
        body = response.body
        head = response_head(response.status, response.headers, not request.keep_alive)
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        if request.method != "HEAD":
            head += body
        self.transport.write(head)

    async def _serve(self, request: Request) -> None:
        server = self.server
        while True:
            try:
                answer = await server.handler(request)
            except asyncio.CancelledError:
                return  # the client left (or the server stops)
            except Exception:
                log.exception("%s %s failed", request.method, request.path)
                answer = Response(500, server.error_body(500, "internal error"), "application/json")
            if self.closed:
                return
            if isinstance(answer, Response):
                self._respond(request, answer)
            elif not answer.ended:  # a handler gave up mid-stream: the client must see a cut
                request.keep_alive = False
            if not request.keep_alive or server.closing:
                self.transport.close()
                self.closed = True
                return
            if not self._queue:
                self._task = None
                if self._phase == _BUSY:  # no next request begun: kept alive for one
                    self._phase = _IDLE
                    self.deadline = server.clock() + server.keepalive_s
                if self._read_paused:
                    self._resume_reading()
                return
            request = self._queue.popleft()


class HttpServer:
    """Listens and dispatches every request to one handler. `on_cut` is told each time the
    front cuts a connection, and why: head_timeout, body_timeout, too_large, over_limit.
    `clock` (the loop's by default) is what the deadlines are kept on."""

    def __init__(
        self,
        handler: Handler,
        error_body: Callable[[int, str], bytes],
        max_body: int,
        *,
        keepalive_s: float = KEEPALIVE_S,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        on_cut: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] | None = None,
    ):
        self.handler = handler
        self.error_body = error_body
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.head_timeout_s = head_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_connections = max_connections
        self.on_cut = on_cut
        self.loop = asyncio.get_running_loop()
        self.clock = clock or self.loop.time
        self.connections: set[_Connection] = set()
        self.lingering: set[_Connection] = set()  # refused, reading and dropping input until closed
        self._sweep_s = min(_MAX_SWEEP_S, keepalive_s / 4, head_timeout_s / 4, body_timeout_s / 4)
        self.closing = False  # end_keepalive() was called
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    def connection(self) -> _Connection:
        """A new connection's protocol."""
        return _Connection(self)

    async def start(self, host: str, port: int, backlog: int = 2048) -> int:
        """Listen; returns the port (useful with port 0)."""
        self._server = await self.loop.create_server(
            self.connection, host, port, backlog=backlog, reuse_address=True
        )
        self._sweep()
        return int(self._server.sockets[0].getsockname()[1])

    def _sweep(self) -> None:
        self.expire(self.clock())
        self._sweeper = self.loop.call_later(self._sweep_s, self._sweep)

    def expire(self, now: float) -> None:
        """Cut the connections past their deadline (one sweep for all: no timer per request)."""
        for conn in [c for c in self.connections if c.deadline <= now]:
            conn.expire()

    def end_keepalive(self) -> None:
        """Every answer from now on ends its connection: a draining router's clients
        reconnect, through its Service, to a router that stays. Idle connections are left
        to their clients (their next request is answered and ends them): closing one could
        cut a request already on its way, which its client sees as a disconnect with no
        answer (the chaos run lost requests so)."""
        self.closing = True

    async def close(self) -> None:
        """Stop listening and close every connection; handlers still running are cancelled."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in [*self.connections, *self.lingering]:
            conn.transport.close()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
