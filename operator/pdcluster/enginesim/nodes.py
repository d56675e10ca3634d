"""One engine across several nodes, as vLLM's multi-node mode starts one.

vLLM with `--nnodes N` starts a process group over every node's ranks before node 0
serves anything: node 0 (the leader, `--master-addr` names it) waits for the others,
each of which runs `--headless` (ranks only, no API) and dies with the group. The
simulator keeps that shape, so what LeaderWorkerSet groups do to an engine is testable
without GPUs: the leader listens on `--master-port` until every other node has joined,
then serves; a worker connects (retrying while the leader starts) and stays; when either
side's connection drops, the process exits non-zero, as a rank does when its collective
breaks.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)
RETRY_S = 0.5


class Group:
    def __init__(self, nnodes: int, node_rank: int, master_addr: str, master_port: int) -> None:
        self.nnodes, self.node_rank = nnodes, node_rank
        self.master_addr, self.master_port = master_addr, master_port
        self.broken = asyncio.Event()
        self._joined: dict[int, asyncio.StreamWriter] = {}
        self._all_joined = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._leader: asyncio.StreamWriter | None = None  # a worker's connection

    async def lead(self) -> None:
        """Node 0: wait until every other node has joined."""
        self._server = await asyncio.start_server(self._join, None, self.master_port)
        log.info("waiting for %d nodes on port %d", self.nnodes - 1, self.master_port)
        await self._all_joined.wait()
        log.info("all %d nodes joined", self.nnodes)

    async def _join(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        try:
            rank = int(line.decode().strip())
        except ValueError:
            writer.close()
            return
        if not 0 < rank < self.nnodes or rank in self._joined:
            log.warning("node rank %r refused", rank)
            writer.close()
            return
        self._joined[rank] = writer
        log.info("node %d joined from %s", rank, writer.get_extra_info("peername"))
        writer.write(b"ok\n")
        await writer.drain()
        if len(self._joined) == self.nnodes - 1:
            self._all_joined.set()
        await reader.read()  # until the node goes
        log.error("node %d left the group", rank)
        self.broken.set()

    async def follow(self) -> None:
        """A headless node: join the leader, then stay until it goes."""
        while True:
            try:
                reader, self._leader = await asyncio.open_connection(self.master_addr, self.master_port)
                self._leader.write(f"{self.node_rank}\n".encode())
                await self._leader.drain()
                if await reader.readline() == b"ok\n":
                    break
                self._leader.close()
            except OSError as e:
                log.info("leader %s:%d not reachable yet (%s)", self.master_addr, self.master_port, e)
            await asyncio.sleep(RETRY_S)
        log.info("joined the group of %s:%d as node %d", self.master_addr, self.master_port, self.node_rank)
        await reader.read()
        log.error("the leader left the group")
        self.broken.set()

    async def close(self) -> None:
        for writer in [*self._joined.values(), *([self._leader] if self._leader else [])]:
            writer.close()
        if self._server is not None:
            self._server.close()
