"""Prefill side of the KV hand-off: the bootstrap route and the side channel.

- the bootstrap server on VLLM_MOONCAKE_BOOTSTRAP_PORT answers
  GET /query -> {"<dp_rank>": {"engine_id": ..., "worker_addr": {"<tp>": {"<pp>": "tcp://ip:port"}}}}
  (mooncake_utils.py);
- a side channel at that worker address takes decode's pull requests (vLLM: ZMQ).
  Here it is a TCP socket with one JSON object per line (json_lines.py):
    decode -> prefill  {"op": "pull", "id": n, "transfer_id": X, "engine_id": E} | {"op": "cancel", "id": n}
    prefill -> decode  {"id": n, "ok": true, "tokens": t, "bytes": b, "stored": s} | {"id": n, "ok": false, "error": ...}
  A pull waits until engine E has prefilled transfer X (transfers.py), then for the
  transfer time of its KV (bytes per token from the profile over `--sim-kv-gbps`), frees
  the blocks and answers. A prefill that did not end length-capped, or an unknown engine,
  fails the pull.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from pdcluster.enginesim.kv.json_lines import JsonLines
from pdcluster.enginesim.kv.mooncake_client import MOONCAKE_PAYLOAD_DIVISOR, MooncakeStore
from pdcluster.enginesim.kv.transfers import NotProcessed, TransferTable


class SideChannel:
    """Prefill side: serves pulls of KV kept in the transfer table."""

    def __init__(
        self,
        table: TransferTable,
        engine_ids: list[str],
        transfer_seconds: Callable[[int], float],
        kv_bytes: Callable[[int], int],
        on_transferred: Callable[[int, float, int], None],
        store: MooncakeStore | None = None,
    ):
        self.table = table
        self.engine_ids = engine_ids
        self.transfer_seconds = transfer_seconds
        self.kv_bytes = kv_bytes
        self.on_transferred = on_transferred
        self.store = store
        self._pulls: dict[tuple[JsonLines, int], asyncio.Task[None]] = {}
        self._server: asyncio.Server | None = None
        self.failing = False  # a broken hand-off (tests): every pull fails after the wait

    async def start(self, host: str) -> int:
        """Listen on a random port, as vLLM's ZMQ side channel does; returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: JsonLines(self._on_message, self._on_lost), host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for task in self._pulls.values():
            task.cancel()
        if self._server is not None:
            self._server.close()

    def _on_message(self, conn: JsonLines, message: dict[str, Any]) -> None:
        key = (conn, message.get("id", 0))
        if message.get("op") == "cancel":
            task = self._pulls.pop(key, None)
            if task is not None:
                task.cancel()
        elif message.get("op") == "pull":
            task = asyncio.get_running_loop().create_task(self._pull(conn, message))
            self._pulls[key] = task
            task.add_done_callback(lambda _: self._pulls.pop(key, None))

    def _on_lost(self, conn: JsonLines) -> None:
        for key, task in list(self._pulls.items()):
            if key[0] is conn:
                task.cancel()

    async def _pull(self, conn: JsonLines, message: dict[str, Any]) -> None:
        transfer_id = str(message.get("transfer_id", ""))
        engine_id = message.get("engine_id")
        reply: dict[str, Any] = {"id": message.get("id", 0), "ok": False}
        if engine_id not in self.engine_ids:
            conn.send(reply | {"error": f"remote engine_id {engine_id} not found"})
            return
        try:
            engine, tokens = await self.table.wait(transfer_id)
        except TimeoutError:
            conn.send(reply | {"error": "Timeout waiting for P side ready."})
            return
        except NotProcessed:
            conn.send(reply | {"error": f"transfer {transfer_id} was not kept for decode"})
            return
        if self.failing:
            self.table.pulled(transfer_id)
            conn.send(
                reply | {"error": f"transfer {transfer_id} failed: the KV transfer is broken (--sim-faults)"}
            )
            return
        if self.engine_ids[engine] != engine_id:
            self.table.pulled(transfer_id)
            conn.send(reply | {"error": f"transfer {transfer_id} was prefilled by {self.engine_ids[engine]}"})
            return
        size = self.kv_bytes(tokens)
        started = time.monotonic()
        seconds = self.transfer_seconds(tokens)
        if seconds > 0:
            await asyncio.sleep(seconds)
        stored = 0
        if self.store is not None:
            stored = size // MOONCAKE_PAYLOAD_DIVISOR
            if not await self.store.put(f"kv/{transfer_id}", stored):
                stored = 0
        self.table.pulled(transfer_id)
        self.on_transferred(engine, time.monotonic() - started, size)
        conn.send(reply | {"ok": True, "tokens": tokens, "bytes": size, "stored": stored})


class BootstrapServer:
    """Prefill side: vLLM's bootstrap HTTP route."""

    def __init__(self, engine_ids: list[str], worker_addrs: list[dict[str, dict[str, str]]]):
        self.engine_ids = engine_ids
        self.worker_addrs = worker_addrs

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/query", self.query)
        return app

    async def query(self, request: web.Request) -> web.Response:
        body = {
            str(rank): {"engine_id": engine_id, "worker_addr": self.worker_addrs[rank]}
            for rank, engine_id in enumerate(self.engine_ids)
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")
