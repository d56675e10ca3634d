"""What the router's HTTP server hands its handler and takes back: the request, a whole
response, a streamed one; and how a response head is written."""

from __future__ import annotations

import re
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.router.http import _Connection

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class Request:
    """One complete request. Header names are lower-case."""

    __slots__ = ("_conn", "body", "headers", "keep_alive", "method", "path", "version")

    def __init__(
        self,
        conn: _Connection,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        keep_alive: bool,
        version: str,
    ):
        self._conn = conn
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.version = version

    def stream(self, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Stream:
        """Start a streamed answer (chunked; HTTP/1.0 clients get it close-delimited)."""
        return self._conn.start_stream(self, status, headers or [])


class Response:
    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        content_type: str = "text/plain; charset=utf-8",
        headers: list[tuple[str, str]] | None = None,
    ):
        self.status = status
        self.body = body
        self.headers = [("Content-Type", content_type), *(headers or [])]


class Stream:
    """A streamed answer in progress. `write` raises ConnectionResetError once the
    client has gone."""

    __slots__ = ("_chunked", "_conn", "ended")

    def __init__(self, conn: _Connection, chunked: bool):
        self._conn = conn
        self._chunked = chunked
        self.ended = False

    async def write(self, data: bytes) -> None:
        if not data:
            return
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("the client closed the connection")
        conn.transport.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        if conn.write_paused:
            await conn.drain()

    async def write_eof(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self._chunked and not self._conn.closed:
            self._conn.transport.write(b"0\r\n\r\n")


class _Date:
    """The Date header, formatted once a second."""

    second = -1
    value = b""

    @classmethod
    def header(cls) -> bytes:
        now = int(time.time())
        if now != cls.second:
            cls.second = now
            cls.value = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return cls.value


# As uvicorn checks what it writes (RFC 9110 5.1 and 5.5): a token for a name, no control
# characters but tab in a value, so no header a caller passes can split the response.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_HEADER_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def response_head(status: int, headers: list[tuple[str, str]], close: bool) -> bytearray:
    out = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"")))
    out += _Date.header()
    for name, value in headers:
        if not _HEADER_NAME.fullmatch(name) or _BAD_HEADER_VALUE.search(value):
            raise ValueError(f"invalid response header {name!r}: {value!r}")
        out += f"{name}: {value}\r\n".encode("latin-1")
    if close:
        out += b"Connection: close\r\n"
    return out
