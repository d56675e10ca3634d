"""The local cluster's ClusterIP proxy (localcluster/podrunner/forwarder.py) on loopback:
what the backend does to a connection, the client sees, as it would through kube-proxy's
NAT. An answer and a close arrive whole; a backend that resets the connection (a router
pod killed with a request on the wire) resets the client's too, instead of leaving the
client waiting for an answer that cannot come."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from localcluster.podrunner.forwarder import ServiceProxy
from localcluster.ports import free_port

SERVICE = ("default", "router", 8000)
PART = b"part of an ans"
WITHIN_S = 10.0  # bounds a test that would otherwise hang; no figure is asserted on it

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def answers_and_closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\n")
    writer.write(b"answer\n")
    await writer.drain()
    writer.close()


async def resets_mid_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\n")
    writer.write(PART)
    await writer.drain()
    await reader.readuntil(b"\n")  # the client has the part: the reset comes after it
    # Linger 0: close() sends RST, as the kernel does for a killed process with data unread.
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@pytest.fixture
async def through_proxy(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, int]]:
    """A backend running the test's handler, behind a ServiceProxy on its own port."""
    handler: Handler = request.param
    backend = await asyncio.start_server(handler, "127.0.0.1", 0)
    backend_port = backend.sockets[0].getsockname()[1]
    proxy = ServiceProxy(lambda _: [("127.0.0.1", backend_port)], print)
    address = ("127.0.0.1", free_port())
    await proxy.sync({address: SERVICE})
    try:
        yield address
    finally:
        await proxy.close()
        backend.close()


@pytest.mark.parametrize("through_proxy", [answers_and_closes], indirect=True)
async def test_an_answer_and_its_close_pass_through(through_proxy: tuple[str, int]) -> None:
    reader, writer = await asyncio.open_connection(*through_proxy)
    writer.write(b"question\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), WITHIN_S) == b"answer\n"
    writer.close()


@pytest.mark.parametrize("through_proxy", [resets_mid_answer], indirect=True)
async def test_a_backend_reset_resets_the_client(through_proxy: tuple[str, int]) -> None:
    reader, writer = await asyncio.open_connection(*through_proxy)
    writer.write(b"question\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(len(PART)), WITHIN_S) == PART
    writer.write(b"got it\n")
    await writer.drain()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(65536), WITHIN_S)
    writer.close()
