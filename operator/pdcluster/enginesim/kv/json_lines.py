"""The side channel's wire format: one JSON object per line, in both directions."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson

log = logging.getLogger(__name__)


class JsonLines(asyncio.Protocol):
    """A connection carrying one JSON object per line, in both directions."""

    def __init__(
        self, on_message: Callable[[JsonLines, dict[str, Any]], None], on_lost: Callable[[JsonLines], None]
    ):
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.on_lost(self)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        end = self._buf.rfind(b"\n")
        if end < 0:
            return
        lines = bytes(self._buf[:end]).split(b"\n")
        del self._buf[: end + 1]
        for line in lines:
            try:
                message = orjson.loads(line)
            except orjson.JSONDecodeError:
                log.warning("side channel: dropping a malformed message")
                continue
            if isinstance(message, dict):
                self.on_message(self, message)

    def send(self, message: dict[str, Any]) -> None:
        if self.transport is None:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(orjson.dumps(message) + b"\n")

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None:
            self.transport.write(b"".join(out))
