"""Engine simulators and an in-process router on 127.0.0.1, on free ports, for the
integration tests. Plain helpers, no pytest."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from pdcluster.enginesim.cli import parse
from pdcluster.enginesim.main import Simulator
from pdcluster.router.main import RouterService, parser
from pdcluster.router.membership import Pool, parse_static

# --kv-transfer-config of a MooncakeConnector prefill (producer) and decode (consumer).
PRODUCER = '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}'
CONSUMER = '{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}'


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_url(sim: Simulator) -> str:
    return f"http://127.0.0.1:{sim.config.port}"


def prefill_url(sim: Simulator) -> str:
    """The router's --prefill for a simulator: its URL and bootstrap port."""
    return f"{engine_url(sim)}#bootstrap={sim.config.bootstrap_port}"


@contextlib.asynccontextmanager
async def simulator(
    *argv: str, model: str = "sim-model", host: str = "127.0.0.1", abort_timeout: float | None = None
) -> AsyncIterator[Simulator]:
    """A simulator serving `model` on `host` with the command-line flags argv."""
    config = parse([model, "--host", host, "--port", str(free_port(host)), *argv])
    config.bootstrap_port = free_port(host)
    if abort_timeout is not None:
        config.abort_timeout_s = abort_timeout
    sim = Simulator(config)
    await sim.start()
    try:
        yield sim
    finally:
        await sim.stop()


@contextlib.asynccontextmanager
async def router(
    *argv: str, ready: Callable[[Pool], bool] = lambda pool: pool.ready
) -> AsyncIterator[RouterService]:
    """A RouterService with the command-line flags argv (--prefill, --decode, ...), once
    `ready` holds for its pool (within 5 s). Its port is service.args.port."""
    args = parser().parse_args(["--host", "127.0.0.1", "--port", str(free_port()), *argv])
    service = RouterService(args, parse_static(args.prefill, args.decode))
    await service.start()
    try:
        pool = service.pool
        assert pool is not None
        async with asyncio.timeout(5):
            while not ready(pool):
                await asyncio.sleep(0.02)
        yield service
    finally:
        await service.stop()


PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


@contextlib.contextmanager
def prometheus(root: Path, config: str) -> Iterator[str]:
    """Debian's Prometheus on a free loopback port with `config`, its data in root/data;
    its URL once it answers /-/ready."""
    (root / "prometheus.yml").write_text(config)
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address={url.removeprefix('http://')}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError("Prometheus never became ready") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
