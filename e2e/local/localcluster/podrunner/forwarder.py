"""ClusterIP Services as userspace TCP proxies (what kube-proxy's old userspace mode did):
one listener per ClusterIP:port, each connection forwarded round-robin to a ready
endpoint. UDP and SCTP ports are not served."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable

Address = tuple[str, int]
ServicePort = tuple[str, str, int]  # namespace, name, port
CONNECT_TIMEOUT = 3.0


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


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
        try:
            await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
        finally:
            for w in (up_w, client_w):
                w.close()
