"""The engine simulator's multi-node group (enginesim/nodes.py) on loopback: the leader
serves only once every node joined, and a node leaving breaks the group on both sides."""

from __future__ import annotations

import asyncio
import socket

from pdcluster.enginesim.nodes import Group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_the_leader_waits_for_every_node_and_a_node_leaving_breaks_the_group() -> None:
    port = free_port()
    leader = Group(3, 0, "127.0.0.1", port)
    workers = [Group(3, rank, "127.0.0.1", port) for rank in (1, 2)]
    # A worker started before its leader retries until the leader listens.
    first = asyncio.create_task(workers[0].follow())
    await asyncio.sleep(0.2)
    leading = asyncio.create_task(leader.lead())
    await asyncio.sleep(0.8)
    assert not leading.done(), "the leader served with a node missing"
    second = asyncio.create_task(workers[1].follow())
    await asyncio.wait_for(leading, timeout=5)
    assert not leader.broken.is_set()

    second.cancel()  # node 2's process ends: its connection closes
    await workers[1].close()
    for task in (second,):
        await asyncio.gather(task, return_exceptions=True)
    await asyncio.wait_for(leader.broken.wait(), timeout=5)
    await leader.close()  # the leader exits: the remaining worker's group is broken too
    await asyncio.wait_for(workers[0].broken.wait(), timeout=5)
    await asyncio.gather(first, return_exceptions=True)


async def test_a_rank_outside_the_group_or_twice_is_refused() -> None:
    port = free_port()
    leader = Group(2, 0, "127.0.0.1", port)
    leading = asyncio.create_task(leader.lead())
    await asyncio.sleep(0.2)
    for line in (b"5\n", b"nonsense\n"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(line)
        await writer.drain()
        assert await reader.read() == b""  # closed without "ok"
        writer.close()
    assert not leading.done()
    worker = Group(2, 1, "127.0.0.1", port)
    following = asyncio.create_task(worker.follow())
    await asyncio.wait_for(leading, timeout=5)
    await leader.close()
    await asyncio.wait_for(following, timeout=5)
