"""ClusterIP Services as userspace TCP proxies (what kube-proxy's old userspace mode did):
one listener per ClusterIP:port, each connection forwarded round-robin to a ready
endpoint. UDP and SCTP ports are not served."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
from collections.abc import Callable

Address = tuple[str, int]
ServicePort = tuple[str, str, int]  # namespace, name, port
CONNECT_TIMEOUT = 3.0


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reset: Callable[[], None]
) -> None:
    """Copies one direction; its end (EOF) is passed on as a half-close. A reset on either
    side resets both, as through kube-proxy's NAT: a client whose request was on the wire
    sees its connection fail and can retry, where a swallowed reset left it waiting for an
    answer that could not come."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        reset()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes with a RST (linger 0), not a FIN: what the peer of a NAT'd reset sees."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class ServiceProxy:
    def __init__(self, resolve: Callable[[ServicePort], list[Address]], log: Callable[[str], None]):
        self._resolve = resolve
        self._log = log
        self._servers: dict[Address, tuple[ServicePort, asyncio.Server]] = {}
        self._turn: dict[ServicePort, itertools.count[int]] = {}

    async def sync(self, wanted: dict[Address, ServicePort]) -> None:
        """Listens on exactly the wanted addresses."""
        for address in list(self._servers):
            if self._servers[address][0] != wanted.get(address):
                _, server = self._servers.pop(address)
                server.close()
        for address, service_port in wanted.items():
            if address in self._servers:
                continue
            try:
                server = await asyncio.start_server(
                    lambda r, w, sp=service_port: self._forward(sp, r, w), address[0], address[1], reuse_address=True
                )
            except OSError as e:
                self._log(f"cannot listen on {address[0]}:{address[1]} for {service_port}: {e}")
                continue
            self._servers[address] = (service_port, server)

    async def close(self) -> None:
        for _, server in self._servers.values():
            server.close()
        self._servers.clear()

    async def _forward(self, service_port: ServicePort, client_r: asyncio.StreamReader,
                       client_w: asyncio.StreamWriter) -> None:
        targets = self._resolve(service_port)
        start = next(self._turn.setdefault(service_port, itertools.count())) if targets else 0
        upstream = None
        for i in range(len(targets)):
            host, port = targets[(start + i) % len(targets)]
            with contextlib.suppress(OSError, TimeoutError):
                upstream = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
                break
        if upstream is None:  # no ready endpoint: like kube-proxy's REJECT, refuse the connection
            client_w.transport.abort()
            return
        up_r, up_w = upstream

        def reset() -> None:
            for w in (up_w, client_w):
                _reset(w)

        try:
            await asyncio.gather(_pipe(client_r, up_w, reset), _pipe(up_r, client_w, reset))
        finally:
            for w in (up_w, client_w):
                w.close()
