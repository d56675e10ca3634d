"""The router's HTTP/1.1 server on a loopback socket, spoken to byte by byte."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from pdcluster.router import http
from pdcluster.router.http import HttpServer, Request, Response, Stream


class App:
    """Echoes requests; /stream streams three parts; /slow waits until cancelled; /wait
    until released."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, request: Request) -> Response | Stream:
        if request.path == "/stream":
            stream = request.stream(200, [("Content-Type", "text/event-stream")])
            for part in (b"a", b"bb", b"ccc"):
                await stream.write(part)
            await stream.write_eof()
            return stream
        if request.path == "/slow":
            self.started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path == "/wait":
            await self.release.wait()
        if request.path == "/boom":
            raise RuntimeError("handler bug")
        echo = {
            "method": request.method,
            "path": request.path,
            "body": request.body.decode(),
            "headers": request.headers,
        }
        return Response(body=orjson.dumps(echo), content_type="application/json")


def error_body(status: int, message: str) -> bytes:
    return orjson.dumps({"error": {"code": status, "message": message}})


@pytest.fixture
async def server() -> AsyncIterator[tuple[HttpServer, App, int]]:
    app = App()
    srv = HttpServer(app, error_body, max_body=1000)
    port = await srv.start("127.0.0.1", 0)
    yield srv, app, port
    await srv.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if line)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await asyncio.wait_for(reader.read(), 5)
    return status, headers, body


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (
        path.encode(),
        len(body),
        extra,
        body,
    )


async def test_keep_alive_and_pipelining_answer_in_order(server: tuple[HttpServer, App, int]) -> None:
    _, _, port = server
    reader, writer = await connect(port)
    # Three requests in one write, the second split into a chunked body.
    writer.write(
        post("/one", b"1")
        + b"POST /two?x=1 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\n"
        + post("/three", b"333", b"X-Thing: A\r\nx-thing: b\r\n")
    )
    answers = [orjson.loads((await read_response(reader))[2]) for _ in range(3)]
    assert [(a["path"], a["body"]) for a in answers] == [("/one", "1"), ("/two", "abc"), ("/three", "333")]
    assert answers[2]["headers"]["x-thing"] == "A, b"
    writer.close()


async def test_streamed_answer_is_chunked_and_the_connection_stays_open(
    server: tuple[HttpServer, App, int],
) -> None:
    _, _, port = server
    reader, writer = await connect(port)
    for _ in range(2):
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert (status, headers["transfer-encoding"], body) == (200, "chunked", b"abbccc")
        assert "date" in headers
    writer.close()


async def test_http10_client_gets_a_close_delimited_stream(server: tuple[HttpServer, App, int]) -> None:
    _, _, port = server
    reader, writer = await connect(port)
    writer.write(b"GET /stream HTTP/1.0\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert (status, body) == (200, b"abbccc") and "transfer-encoding" not in headers
    assert reader.at_eof()
    writer.close()


async def test_expect_continue(server: tuple[HttpServer, App, int]) -> None:
    _, _, port = server
    reader, writer = await connect(port)
    writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"abc")
    assert orjson.loads((await read_response(reader))[2])["body"] == "abc"
    # Too large for the limit: refused before the client sends the body.
    writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 413 and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == 413
    writer.close()


@pytest.mark.parametrize(
    "raw",
    [
        post("/big", b"x" * 5000),
        # Chunked, with no end: refused once it passes the limit.
        b"POST /big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (b"1f4\r\n" + b"x" * 500 + b"\r\n") * 3,
    ],
    ids=["declared", "chunked"],
)
async def test_a_body_over_the_limit_is_refused_by_the_front_and_the_connection_closes(
    server: tuple[HttpServer, App, int], raw: bytes
) -> None:
    _, _, port = server
    reader, writer = await connect(port)
    writer.write(raw)
    status, headers, body = await read_response(reader)
    assert (status, headers["connection"]) == (413, "close")
    assert orjson.loads(body)["error"]["code"] == 413
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX-Big: " + b"y" * (http.MAX_HEAD_BYTES + 1) + b"\r\n\r\n", 431),
        (b"GET /" + b"u" * (http.MAX_HEAD_BYTES + 1) + b" HTTP/1.1\r\n\r\n", 431),
        # A head that never ends is refused once it passes the limit, not at its end.
        (b"GET / HTTP/1.1\r\n" + b"X-Many: y\r\n" * (http.MAX_HEAD_BYTES // 4), 431),
    ],
    ids=["garbage", "bad-length", "upgrade", "huge-head", "huge-url", "endless-head"],
)
async def test_bad_requests_get_a_json_error_and_a_hang_up(
    server: tuple[HttpServer, App, int], raw: bytes, status: int
) -> None:
    _, _, port = server
    reader, writer = await connect(port)
    writer.write(raw)
    got, headers, body = await read_response(reader)
    assert got == status and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == status
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_a_failing_handler_is_a_500_and_the_connection_lives(
    server: tuple[HttpServer, App, int],
) -> None:
    _, _, port = server
    reader, writer = await connect(port)
    writer.write(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\nGET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await read_response(reader))[0] == 500
    assert orjson.loads((await read_response(reader))[2])["path"] == "/ok"
    writer.close()


async def test_head_has_no_body(server: tuple[HttpServer, App, int]) -> None:
    _, _, port = server
    reader, writer = await connect(port)
    writer.write(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\nGET /g HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b"Content-Length: " in head
    assert orjson.loads((await read_response(reader))[2])["method"] == "GET"
    writer.close()


async def test_a_client_that_leaves_cancels_its_handler(
    server: tuple[HttpServer, App, int], wait_until: Callable[..., Awaitable[Any]]
) -> None:
    srv, app, port = server
    _, writer = await connect(port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(app.started.wait(), 5)
    writer.close()
    await asyncio.wait_for(app.cancelled.wait(), 5)
    await wait_until(lambda: not srv.connections, interval=0.01, message="the connection forgotten")


async def test_close_cancels_what_runs_and_stops_listening(server: tuple[HttpServer, App, int]) -> None:
    srv, app, port = server
    reader, writer = await connect(port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(app.started.wait(), 5)
    await srv.close()
    await asyncio.wait_for(app.cancelled.wait(), 5)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    with pytest.raises(OSError):
        await connect(port)
    writer.close()


@pytest.mark.parametrize(
    "header",
    [("X-Id", "a\r\nSet-Cookie: x=1"), ("X-Id", "a\nb"), ("X Id", "a"), ("X-Id:", "a"), ("X-Id", "a\x00")],
)
def test_a_response_header_cannot_split_the_response(header: tuple[str, str]) -> None:
    from pdcluster.router.http_messages import response_head

    with pytest.raises(ValueError, match="invalid response header"):
        response_head(200, [header], close=False)
    assert b"X-Id: a\tb\r\n" in response_head(200, [("X-Id", "a\tb")], close=False)


# ---------------------------------------------------------------------- deadlines, on a fake clock
# Connections on fake transports: bytes arrive when a test says, the clock moves when a
# test says, and the sweep runs when a test calls it.


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeTransport:
    def __init__(self, conn: asyncio.Protocol) -> None:
        self.conn = conn
        self.written = bytearray()
        self.wrote = asyncio.Event()
        self.resumed = asyncio.Event()
        self.eof = False
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written += data
        self.wrote.set()

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.conn.connection_lost(None)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True
        self.resumed.set()

    async def answer(self) -> bytes:
        """What the front writes next (handlers run on the loop)."""
        await asyncio.wait_for(self.wrote.wait(), 5)
        self.wrote.clear()
        out = bytes(self.written)
        self.written.clear()
        return out


@dataclass
class Front:
    server: HttpServer
    clock: FakeClock
    app: App
    cuts: list[str] = field(default_factory=list)

    def open(self) -> FakeTransport:
        conn = self.server.connection()
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        return transport

    def at(self, now: float) -> None:
        """Move the clock and sweep."""
        self.clock.now = now
        self.server.expire(now)


@pytest.fixture
async def front() -> AsyncIterator[Front]:
    clock, app = FakeClock(), App()
    cuts: list[str] = []
    srv = HttpServer(
        app,
        error_body,
        max_body=1000,
        keepalive_s=75,
        head_timeout_s=30,
        body_timeout_s=60,
        max_connections=3,
        on_cut=cuts.append,
        clock=clock,
    )
    yield Front(srv, clock, app, cuts)
    await srv.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_a_head_trickled_a_byte_a_second_is_cut_at_the_head_deadline(front: Front) -> None:
    t = front.open()
    head = b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 40
    for second in range(30):
        front.at(second)
        t.conn.data_received(head[second : second + 1])
        front.at(second + 0.9)
        assert not t.written and not t.closed and not front.cuts
    front.at(30)  # the head began when the connection opened, not at its last byte
    assert status_of(t.written) == 408 and t.eof
    assert front.cuts == ["head_timeout"]
    t.conn.data_received(b"\r\n\r\n")  # too late: dropped until the lingering close
    assert b"200" not in t.written


async def test_a_silent_connection_is_closed_quietly_at_the_head_deadline(front: Front) -> None:
    t = front.open()
    front.at(29.9)
    assert not t.closed
    front.at(30)
    assert t.closed and not t.written and front.cuts == ["head_timeout"]
    assert not front.server.connections


async def test_keep_alive_waits_its_own_time_and_the_next_head_is_timed_from_its_first_byte(
    front: Front,
) -> None:
    t = front.open()
    front.at(1)
    t.conn.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(await t.answer()) == 200
    front.at(75.9)  # idle past the head deadline: keep-alive's time, not the head's
    assert not t.closed
    t.conn.data_received(b"G")  # the next head's first byte, at 75.9: due by 105.9
    front.at(105.8)
    assert not t.closed
    t.conn.data_received(b"ET /b HTTP/1.1\r\nHost: x\r\n\r\n")
    assert orjson.loads((await t.answer()).split(b"\r\n\r\n", 1)[1])["path"] == "/b"
    front.at(105.8 + 75)
    assert t.closed and front.cuts == []  # an ordinary end of keep-alive, not a cut


async def test_a_trickled_body_is_cut_at_the_body_deadline_from_the_end_of_its_head(front: Front) -> None:
    t = front.open()
    front.at(20)
    t.conn.data_received(b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
    for second in range(20, 80, 5):
        front.at(second)
        t.conn.data_received(b"x")
    front.at(79.9)
    assert not t.written and front.cuts == []
    front.at(80)
    assert status_of(t.written) == 408 and t.eof and front.cuts == ["body_timeout"]


async def test_a_declared_body_over_the_limit_is_answered_413_at_its_head(front: Front) -> None:
    t = front.open()
    t.conn.data_received(b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\nx")
    answer = bytes(t.written)
    assert status_of(answer) == 413 and b"Connection: close" in answer and t.eof
    assert front.cuts == ["too_large"] and t.conn in front.server.lingering
    t.conn.data_received(b"x" * 100_000)  # the rest is read and dropped
    assert bytes(t.written) == answer and not front.app.started.is_set()


async def test_past_the_connection_limit_a_new_connection_gets_503_and_the_open_ones_work(
    front: Front,
) -> None:
    opened = [front.open() for _ in range(3)]
    refused = front.open()
    assert status_of(refused.written) == 503 and refused.eof and front.cuts == ["over_limit"]
    assert refused.conn not in front.server.connections
    opened[0].conn.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(await opened[0].answer()) == 200
    opened[1].close()
    assert not front.open().written  # room again


async def test_a_connection_whose_request_is_being_answered_has_no_deadline(front: Front) -> None:
    t = front.open()
    t.conn.data_received(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(front.app.started.wait(), 5)
    front.at(10_000)
    assert not t.closed and front.cuts == []


async def test_time_the_front_stopped_reading_does_not_count_against_a_pipelined_head(
    front: Front,
) -> None:
    t = front.open()
    t.conn.data_received(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n" * 9 + b"GET /b HT")
    assert not t.reading  # eight answers queued: the front stops reading
    front.at(1000)
    assert not t.closed and front.cuts == []
    front.app.release.set()
    await asyncio.wait_for(t.resumed.wait(), 5)  # every answer written, reading again
    front.at(1029.9)
    assert not t.eof
    front.at(1030)
    assert t.written.count(b" 200 OK") == 9 and b" 408 " in t.written and front.cuts == ["head_timeout"]
