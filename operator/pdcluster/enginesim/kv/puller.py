"""Decode side of the KV hand-off: fetch one request's KV from its prefill engine.

`KvPuller` resolves the remote engine through the bootstrap `/query` (cached per
engine_id, as vLLM's `_remote_agents`) and pulls over one side-channel connection per
prefill; messages written in one event-loop turn share one write (json_lines.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import aiohttp
import orjson

from pdcluster.enginesim.engine import KvLoadError, RemotePrefill, Seq
from pdcluster.enginesim.kv.json_lines import JsonLines
from pdcluster.enginesim.kv.mooncake_client import MooncakeStore

log = logging.getLogger(__name__)


class KvPuller:
    """Decode side: fetch one request's KV from its prefill engine."""

    def __init__(
        self, session: aiohttp.ClientSession, wait_timeout_s: float, store: MooncakeStore | None = None
    ):
        self.session = session
        self.wait_timeout_s = wait_timeout_s
        self.store = store
        self._channels: dict[str, tuple[str, int]] = {}  # engine_id -> side channel address
        self._conns: dict[tuple[str, int], JsonLines] = {}
        self._pending: dict[int, tuple[JsonLines, asyncio.Future[dict[str, Any]]]] = {}
        self._ids = itertools.count(1)

    async def _resolve(self, remote: RemotePrefill) -> tuple[str, int]:
        address = self._channels.get(remote.engine_id)
        if address is not None:
            return address
        payload: Any = None
        for attempt in range(3):  # vLLM: 3 attempts, 0.1 s apart, on request errors
            try:
                url = f"{remote.bootstrap_addr}/query"
                async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    payload = orjson.loads(await resp.read())
                break
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as e:
                if attempt == 2:
                    raise KvLoadError(f"bootstrap server {remote.bootstrap_addr} unreachable: {e!r}") from e
                await asyncio.sleep(0.1)
        entries = payload.values() if isinstance(payload, dict) else []
        entry = next(
            (e for e in entries if isinstance(e, dict) and e.get("engine_id") == remote.engine_id), None
        )
        if entry is None:
            raise KvLoadError(
                f"remote engine_id {remote.engine_id} not found from bootstrap server {remote.bootstrap_addr}"
            )
        try:
            worker = next(iter(next(iter(entry["worker_addr"].values())).values()))
            host, _, port = worker.removeprefix("tcp://").rpartition(":")
            address = (host.strip("[]"), int(port))
        except (AttributeError, KeyError, StopIteration, TypeError, ValueError) as e:
            raise KvLoadError(f"bad worker_addr for {remote.engine_id}: {entry.get('worker_addr')!r}") from e
        self._channels[remote.engine_id] = address
        return address

    async def _connection(self, address: tuple[str, int]) -> JsonLines:
        conn = self._conns.get(address)
        if conn is not None and conn.transport is not None:
            return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                lambda: JsonLines(self._on_message, self._on_lost), *address
            )
        except OSError as e:
            raise KvLoadError(f"side channel {address[0]}:{address[1]} unreachable: {e!r}") from e
        self._conns[address] = conn
        return conn

    def _on_message(self, conn: JsonLines, message: dict[str, Any]) -> None:
        pending = self._pending.pop(message.get("id", 0), None)
        if pending is not None and not pending[1].done():
            pending[1].set_result(message)

    def _on_lost(self, conn: JsonLines) -> None:
        for address, known in list(self._conns.items()):
            if known is conn:
                del self._conns[address]
        # Pulls on this connection cannot be answered any more; but, as vLLM's ZMQ request
        # socket does, the puller only learns so at its receive timeout, the pull's own
        # timer (mooncake_connector.py: RCVTIMEO = VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s).
        for pull_id, (owner, _waiter) in list(self._pending.items()):
            if owner is conn:
                del self._pending[pull_id]

    async def pull(self, seq: Seq) -> None:
        remote = seq.remote
        assert remote is not None
        conn = await self._connection(await self._resolve(remote))
        pull_id = next(self._ids)
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[pull_id] = (conn, waiter)
        conn.send(
            {"op": "pull", "id": pull_id, "transfer_id": remote.transfer_id, "engine_id": remote.engine_id}
        )
        # A timer on the future is much cheaper than asyncio.timeout per pull.
        timer = asyncio.get_running_loop().call_later(self.wait_timeout_s, _expire, waiter)
        try:
            reply = await waiter
        except TimeoutError as e:
            self._pending.pop(pull_id, None)
            conn.send({"op": "cancel", "id": pull_id})
            raise KvLoadError(f"no KV for {remote.transfer_id} within {self.wait_timeout_s:g} s") from e
        except asyncio.CancelledError:
            self._pending.pop(pull_id, None)
            conn.send({"op": "cancel", "id": pull_id})
            raise
        finally:
            timer.cancel()
        if not reply.get("ok"):
            raise KvLoadError(f"pull of {remote.transfer_id} failed: {reply.get('error')}")
        if self.store is not None and reply.get("stored"):
            try:
                await self.store.take(f"kv/{remote.transfer_id}")
            except Exception as e:  # the store is an optional side show; never fail decode on it
                log.warning("Mooncake store get of %s failed: %s", remote.transfer_id, e)


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
