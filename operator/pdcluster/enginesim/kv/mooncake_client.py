"""A real Mooncake store client, for the hand-off's payloads and the store connector.

With `--sim-mooncake-master`, the push also goes through a real Mooncake store: prefill
puts a scaled-down payload under the transfer id and decode gets and removes it, so the
master's metrics move. The payload is KV bytes / MOONCAKE_PAYLOAD_DIVISOR, to keep the
store small on a laptop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

MOONCAKE_PAYLOAD_DIVISOR = 1024


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
