"""The router's HTTP/1.1 server on a loopback socket, spoken to byte by byte."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from pdcluster.router import http
from pdcluster.router.http import HttpServer, Request, Response, Stream


class App:
    """Echoes requests; /stream streams three parts; /slow waits until cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()

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
        b"POST /big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + (b"1f4\r\n" + b"x" * 500 + b"\r\n") * 3,
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


async def test_a_client_that_leaves_cancels_its_handler(server: tuple[HttpServer, App, int]) -> None:
    srv, app, port = server
    _, writer = await connect(port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(app.started.wait(), 5)
    writer.close()
    await asyncio.wait_for(app.cancelled.wait(), 5)
    await asyncio.sleep(0.05)
    assert not srv.connections


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
    from pdcluster.router.http import _head

    with pytest.raises(ValueError, match="invalid response header"):
        _head(200, [header], close=False)
    assert b"X-Id: a\tb\r\n" in _head(200, [("X-Id", "a\tb")], close=False)
