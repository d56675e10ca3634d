"""The KV hand-off between a prefill and a decode simulator.

Prefill side, like vLLM's MooncakeConnector (vllm==0.33.0: .../kv_connector/v1/mooncake/):
- the bootstrap server on VLLM_MOONCAKE_BOOTSTRAP_PORT answers
  GET /query -> {"<dp_rank>": {"engine_id": ..., "worker_addr": {"<tp>": {"<pp>": "tcp://ip:port"}}}}
  (mooncake_utils.py);
- a side channel at that worker address takes decode's pull requests (vLLM: ZMQ).
  Here it is a TCP socket with one JSON object per line:
    decode -> prefill  {"op": "pull", "id": n, "transfer_id": X, "engine_id": E} | {"op": "cancel", "id": n}
    prefill -> decode  {"id": n, "ok": true, "tokens": t, "bytes": b, "stored": s} | {"id": n, "ok": false, "error": ...}
  A pull waits until engine E has prefilled transfer X, then for the transfer time of
  its KV (bytes per token from the profile over `--sim-kv-gbps`), frees the blocks and
  answers. As in the connector, a pull that arrives before the prefill waits for it up
  to VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT; a prefill that did not end length-capped, or
  an unknown engine, fails the pull; KV nobody pulls is freed after the same timeout and
  counted in vllm:mooncake_num_kv_expired_reqs.

Decode side: `KvPuller` resolves the remote engine through `/query` (cached per
engine_id, as vLLM's `_remote_agents`) and pulls over one side-channel connection per
prefill; messages written in one event-loop turn share one write.

With `--sim-mooncake-master`, the push also goes through a real Mooncake store: prefill
puts a scaled-down payload under the transfer id and decode gets and removes it, so the
master's metrics move. The payload is KV bytes / MOONCAKE_PAYLOAD_DIVISOR, to keep the
store small on a laptop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from pdcluster.enginesim.engine import KvLoadError, RemotePrefill, Seq

log = logging.getLogger(__name__)

MOONCAKE_PAYLOAD_DIVISOR = 1024


class NotProcessed(Exception):
    """The prefill ended without keeping its KV (stop, abort, error)."""


@dataclass
class _Transfer:
    ready: asyncio.Future[int]
    engine: int = 0  # DP rank that prefilled it
    release: Callable[[], None] | None = None
    expiry: asyncio.TimerHandle | None = None
    pulling: bool = False


@dataclass
class TransferTable:
    """Prefill side: KV kept for decode, keyed by transfer_id."""

    abort_timeout_s: float
    on_expired: Callable[[int], None] = lambda engine: None
    _entries: dict[str, _Transfer] = field(default_factory=dict)

    def _entry(self, transfer_id: str) -> _Transfer:
        entry = self._entries.get(transfer_id)
        if entry is None:
            entry = _Transfer(asyncio.get_running_loop().create_future())
            self._entries[transfer_id] = entry
        return entry

    def prefilled(
        self, transfer_id: str, engine: int, tokens: int, release: Callable[[], None] | None
    ) -> None:
        """`release` frees the held KV; None when the prefill kept nothing."""
        entry = self._entry(transfer_id)
        entry.engine = engine
        entry.release = release
        if not entry.ready.done():
            if release is None:
                entry.ready.set_exception(NotProcessed(transfer_id))
                entry.ready.exception()  # retrieved: nobody may ever pull it
            else:
                entry.ready.set_result(tokens)
        loop = asyncio.get_running_loop()
        entry.expiry = loop.call_later(self.abort_timeout_s, self._expire, transfer_id)

    def _expire(self, transfer_id: str) -> None:
        entry = self._entries.pop(transfer_id, None)
        if entry is None:
            return
        if entry.release is not None:
            log.warning(
                "Request %s timed out after %d seconds without being sent. Freeing its blocks on the producer side.",
                transfer_id,
                self.abort_timeout_s,
            )
            entry.release()
            self.on_expired(entry.engine)
        if not entry.ready.done():
            entry.ready.set_exception(NotProcessed(transfer_id))
            entry.ready.exception()

    async def wait(self, transfer_id: str) -> tuple[int, int]:
        """(engine, tokens) once prefilled; raises NotProcessed or TimeoutError."""
        entry = self._entry(transfer_id)
        if entry.pulling:
            raise NotProcessed(f"{transfer_id} is already being pulled")
        if not entry.ready.done():  # the pull came first: wait for the prefill
            try:
                await asyncio.wait_for(asyncio.shield(entry.ready), self.abort_timeout_s)
            except TimeoutError:
                if not entry.ready.done():
                    self._entries.pop(transfer_id, None)
                raise
        tokens = entry.ready.result()
        entry.pulling = True
        return entry.engine, tokens

    def pulled(self, transfer_id: str) -> None:
        entry = self._entries.pop(transfer_id, None)
        if entry is None:
            return
        if entry.expiry is not None:
            entry.expiry.cancel()
        if entry.release is not None:
            entry.release()


class MooncakeStore:
    """A real Mooncake store client (mooncake-transfer-engine wheel), TCP transport.

    The master may come up after the engines (pods start in parallel): when the first
    setup fails, it keeps retrying in the background instead of giving up, and until it
    is connected puts fail, so KV goes only over the side channel.

    A restarted master knows nothing of this engine's segment. Mooncake's client
    reconnects (and mounts again) only after three failed pings, one a second, so a
    master replaced faster than that never learns of the segment and puts fail for lack
    of space. A marker key written at every setup tells: when a master answers that it
    does not have it, this is a new master, and the client is set up again. Not under
    HA: a new leader starts empty, and the client moves to it and mounts again itself."""

    RETRY_SECONDS = 2.0
    CHECK_SECONDS = 3.0

    SEGMENT_BYTES = 64 * 1024 * 1024
    BUFFER_BYTES = 16 * 1024 * 1024

    def __init__(
        self,
        master: str,
        local_hostname: str,
        metadata_server: str = "P2PHANDSHAKE",
        segment: int = SEGMENT_BYTES,
        buffer: int = BUFFER_BYTES,
    ):
        self.master = master
        self.local_hostname = local_hostname
        self.metadata_server = metadata_server
        self.segment, self.buffer = segment, buffer
        self.ha = master.startswith("etcd://")  # leader found in etcd (client_service.cpp)
        self.marker = f"pdcluster-sim/alive/{local_hostname}"
        self._store: Any = None
        self._marked = False
        self._in_use = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, master: str, local_hostname: str, **options: Any) -> MooncakeStore | None:
        try:
            import mooncake.store  # noqa: F401  optional: only with a store
        except ImportError as e:
            log.warning("Mooncake store disabled: %s", e)
            return None
        store = cls(master, local_hostname, **options)
        connected = await store._setup()
        store._task = asyncio.get_running_loop().create_task(store._maintain(connected))
        return store

    async def _setup(self) -> bool:
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        setup = (self.local_hostname, self.metadata_server, self.segment, self.buffer, "tcp", "", self.master)
        rc = await asyncio.to_thread(store.setup, *setup)
        if rc != 0:
            log.warning("Mooncake store: setup against master %s returned %s", self.master, rc)
            return False
        # No marker (a full store): no check, Mooncake's own reconnect is all there is.
        self._marked = await asyncio.to_thread(store.put, self.marker, b"1") == 0
        self._store = store
        log.info("Mooncake store connected to master %s", self.master)
        return True

    async def _maintain(self, connected: bool) -> None:
        while True:
            if not connected:
                await asyncio.sleep(self.RETRY_SECONDS)
                connected = await self._setup()
                continue
            await asyncio.sleep(self.CHECK_SECONDS)
            # 0: the master answered and has no marker; < 0: no answer (Mooncake retries).
            # Under HA a new leader starts empty, and the client moves to it by itself.
            if self._marked and not self.ha and await self._call("is_exist", self.marker) == 0:
                log.warning(
                    "Mooncake master %s does not know this engine (restarted): setting up again", self.master
                )
                await self._drop()
                connected = await self._setup()

    async def _call(self, method: str, *args: Any) -> Any:
        """A store call in a thread; the client is not closed while calls run."""
        store = self._store
        if store is None:
            return None
        self._in_use += 1
        self._idle.clear()
        try:
            return await asyncio.to_thread(getattr(store, method), *args)
        finally:
            self._in_use -= 1
            if not self._in_use:
                self._idle.set()

    async def _drop(self) -> None:
        store, self._store = self._store, None
        await self._idle.wait()
        if store is not None:
            await asyncio.to_thread(store.close)

    @property
    def connected(self) -> bool:
        return self._store is not None

    async def put(self, key: str, size: int) -> bool:
        return await self._call("put", key, b"\0" * max(size, 1)) == 0

    async def exist(self, keys: list[str]) -> list[int]:
        """Per key 1 stored, 0 not, < 0 no answer; all -1 while not connected."""
        found = await self._call("batch_is_exist", keys)
        return list(found) if found is not None else [-1] * len(keys)

    async def put_many(self, keys: list[str], size: int) -> bool:
        """Puts a payload of `size` bytes under each key."""
        return await self._call("put_batch", keys, [b"\0" * max(size, 1)] * len(keys)) == 0

    async def get_many(self, keys: list[str]) -> list[bytes]:
        got = await self._call("get_batch", keys)
        return list(got) if got is not None else [b""] * len(keys)

    async def take(self, key: str) -> int:
        data = await self._call("get", key)
        if data is None:
            raise RuntimeError("not connected to the Mooncake master")
        await self._call("remove", key)
        return len(data)

    async def close(self) -> None:
        """After the calls in flight: closing under one crashes the client."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._drop()


class _Lines(asyncio.Protocol):
    """A connection carrying one JSON object per line, in both directions."""

    def __init__(
        self, on_message: Callable[[_Lines, dict[str, Any]], None], on_lost: Callable[[_Lines], None]
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
        self._pulls: dict[tuple[_Lines, int], asyncio.Task[None]] = {}
        self._server: asyncio.Server | None = None
        self.failing = False  # a broken hand-off (tests): every pull fails after the wait

    async def start(self, host: str) -> int:
        """Listen on a random port, as vLLM's ZMQ side channel does; returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Lines(self._on_message, self._on_lost), host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for task in self._pulls.values():
            task.cancel()
        if self._server is not None:
            self._server.close()

    def _on_message(self, conn: _Lines, message: dict[str, Any]) -> None:
        key = (conn, message.get("id", 0))
        if message.get("op") == "cancel":
            task = self._pulls.pop(key, None)
            if task is not None:
                task.cancel()
        elif message.get("op") == "pull":
            task = asyncio.get_running_loop().create_task(self._pull(conn, message))
            self._pulls[key] = task
            task.add_done_callback(lambda _: self._pulls.pop(key, None))

    def _on_lost(self, conn: _Lines) -> None:
        for key, task in list(self._pulls.items()):
            if key[0] is conn:
                task.cancel()

    async def _pull(self, conn: _Lines, message: dict[str, Any]) -> None:
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


class KvPuller:
    """Decode side: fetch one request's KV from its prefill engine."""

    def __init__(
        self, session: aiohttp.ClientSession, wait_timeout_s: float, store: MooncakeStore | None = None
    ):
        self.session = session
        self.wait_timeout_s = wait_timeout_s
        self.store = store
        self._channels: dict[str, tuple[str, int]] = {}  # engine_id -> side channel address
        self._conns: dict[tuple[str, int], _Lines] = {}
        self._pending: dict[int, tuple[_Lines, asyncio.Future[dict[str, Any]]]] = {}
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

    async def _connection(self, address: tuple[str, int]) -> _Lines:
        conn = self._conns.get(address)
        if conn is not None and conn.transport is not None:
            return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Lines(self._on_message, self._on_lost), *address)
        except OSError as e:
            raise KvLoadError(f"side channel {address[0]}:{address[1]} unreachable: {e!r}") from e
        self._conns[address] = conn
        return conn

    def _on_message(self, conn: _Lines, message: dict[str, Any]) -> None:
        pending = self._pending.pop(message.get("id", 0), None)
        if pending is not None and not pending[1].done():
            pending[1].set_result(message)

    def _on_lost(self, conn: _Lines) -> None:
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
