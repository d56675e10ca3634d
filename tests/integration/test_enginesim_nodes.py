"""The engine simulator's multi-node group (enginesim/nodes.py) on loopback: the leader
serves only once every node joined, and a node leaving breaks the group on both sides."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pdcluster.enginesim.nodes import Group

WaitUntil = Callable[..., Awaitable[Any]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logged(caplog: pytest.LogCaptureFixture, text: str) -> Callable[[], bool]:
    return lambda: any(text in record.getMessage() for record in caplog.records)


async def test_the_leader_waits_for_every_node_and_a_node_leaving_breaks_the_group(
    caplog: pytest.LogCaptureFixture, wait_until: WaitUntil
) -> None:
    caplog.set_level(logging.INFO, logger="pdcluster.enginesim.nodes")
    port = free_port()
    leader = Group(3, 0, "127.0.0.1", port)
    workers = [Group(3, rank, "127.0.0.1", port) for rank in (1, 2)]
    # A worker started before its leader retries until the leader listens.
    first = asyncio.create_task(workers[0].follow())
    await wait_until(logged(caplog, "not reachable yet"), interval=0.02, message="node 1 refused")
    leading = asyncio.create_task(leader.lead())
    # The leader has answered node 1 and node 1 has read the answer: a leader that
    # served on one node of two would be done by now.
    await wait_until(logged(caplog, "as node 1"), interval=0.02, message="node 1 joined")
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


async def test_a_rank_outside_the_group_or_twice_is_refused(
    caplog: pytest.LogCaptureFixture, wait_until: WaitUntil
) -> None:
    caplog.set_level(logging.INFO, logger="pdcluster.enginesim.nodes")
    port = free_port()
    leader = Group(2, 0, "127.0.0.1", port)
    leading = asyncio.create_task(leader.lead())
    await wait_until(logged(caplog, "waiting for 1 nodes"), interval=0.02, message="the leader listens")
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
