"""How the router talks to engines: one connection pool and one way to present the
engine API key (vLLM's `--api-key`), for requests, hand-offs, probes and lookups."""

from __future__ import annotations

from pdcluster.router.membership import Upstream
from pdcluster.router.upstream import Response, UpstreamPool


def header_lines(headers: list[tuple[str, str]]) -> bytes:
    return "".join(f"{name}: {value}\r\n" for name, value in headers).encode()


class EngineClient:
    def __init__(self, api_key: str | None = None, upstream: UpstreamPool | None = None):
        self.upstream = upstream if upstream is not None else UpstreamPool()
        auth = [("Authorization", f"Bearer {api_key}")] if api_key else []
        self.auth = dict(auth)  # for aiohttp, off the hot path
        self.auth_lines = header_lines(auth)  # for the upstream pool's raw requests

    def headers(self, headers: list[tuple[str, str]]) -> bytes:
        return header_lines(headers) + self.auth_lines

    async def post(self, engine: Upstream, path: bytes, headers: bytes, body: bytes) -> Response:
        return await self.upstream.request(engine.origin, b"POST", path, headers, body)

    async def post_read(self, engine: Upstream, path: bytes, headers: bytes, body: bytes) -> tuple[int, bytes]:
        """POST and read the whole answer: (status, body)."""
        response = await self.post(engine, path, headers, body)
        try:
            return response.status, await response.read()
        finally:
            response.close()

    async def get_read(self, engine: Upstream, path: bytes) -> tuple[int, bytes]:
        response = await self.upstream.request(engine.origin, b"GET", path, self.auth_lines, b"")
        try:
            return response.status, await response.read()
        finally:
            response.close()
