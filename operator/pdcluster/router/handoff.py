"""One request through a prefill -> decode pair, as vLLM's MooncakeConnector expects it
(protocol.py): decode's request goes first and waits for the KV, the prefill request
right after it; decode answers once it has pulled the KV. Client requests (attempt.py)
and the hand-off probes (probe.py) send it the same way."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from pdcluster.router.engines import EngineClient
from pdcluster.router.membership import Upstream
from pdcluster.router.protocol import MooncakeProtocol, PrefillEngine
from pdcluster.router.upstream import Response


class Handoff:
    def __init__(self, engines: EngineClient, protocol: MooncakeProtocol, path: bytes, request_id: str):
        self.engines = engines
        self.protocol = protocol
        self.path = path
        self.request_id = request_id

    def send_decode(
        self,
        decode: Upstream,
        body: dict[str, Any],
        transfer_id: str,
        source: PrefillEngine | None,
        extra_headers: bytes = b"",
    ) -> asyncio.Task[Response]:
        """Start decode's request: with the hand-off parameters when `source` holds its
        KV, else plain (decode loads a stored prefix or computes the prompt)."""
        if source is not None:
            body = self.protocol.decode_body(body, transfer_id, source)
        headers = self.engines.headers(self.protocol.decode_headers(self.request_id)) + extra_headers
        return asyncio.get_running_loop().create_task(
            self.engines.post(decode, self.path, headers, orjson.dumps(body))
        )

    async def send_prefill(
        self, prefill: Upstream, body: dict[str, Any], transfer_id: str, extra_headers: bytes = b""
    ) -> tuple[int, bytes]:
        """The prefill request, read whole: (status, body)."""
        engine = prefill.engine
        assert engine is not None, "a prefill upstream always has its engine"
        headers = self.engines.headers(self.protocol.prefill_headers(self.request_id, engine)) + extra_headers
        payload = orjson.dumps(self.protocol.prefill_body(body, transfer_id))
        return await self.engines.post_read(prefill, self.path, headers, payload)


def discard(task: asyncio.Task[Response]) -> None:
    """Abandon a decode request: cancel it, or close its response to abort the engine."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        task.result().close()
