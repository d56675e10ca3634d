"""Engine simulators and an in-process router on 127.0.0.1, on free ports, for the
integration tests. Plain helpers, no pytest."""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from harness import counter, wait_until  # noqa: F401 (the loopback tests' too)

from pdcluster.enginesim.cli import parse
from pdcluster.enginesim.main import Simulator
from pdcluster.router.discovery import parse_static
from pdcluster.router.flags import parser
from pdcluster.router.main import RouterService
from pdcluster.router.membership import Pool

# --kv-transfer-config of a MooncakeConnector prefill (producer) and decode (consumer).
PRODUCER = '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}'
CONSUMER = '{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}'


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_run(count: int) -> int:
    """The first of `count` consecutive ports free on every address, below the kernel's
    ephemeral range. For endpoints that bind base + rank (a data-parallel engine's KV
    events): a later free_port() is an ephemeral pick, so it never hands one of them out
    before the engine binds it."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    for base in random.sample(range(10000, low - count), 200):
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports below {low}")


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
    """A RouterService with the command-line flags argv (--prefill, --decode, --engine, ...), once
    `ready` holds for its pool and its hand-off probes have run. Its port is
    service.args.port."""
    args = parser().parse_args(["--host", "127.0.0.1", "--port", str(free_port()), *argv])
    service = RouterService(args, parse_static(args.prefill, args.decode, args.colocated, args.flexible))
    await service.start()
    try:
        pool = service.pool
        assert pool is not None
        prober = service.router.prober if service.router is not None else None

        def settled() -> bool:
            # Ready, and the KV hand-off probes done (their requests are not the test's).
            return ready(pool) and not (prober is not None and pool.ready and not prober.settled())

        await wait_until(settled, interval=0.02, message="router ready, its probes done")
        yield service
    finally:
        await service.stop()


MOONCAKE_MASTER = Path(sys.executable).parent / "mooncake_master"


@dataclass
class MasterProcess:
    rpc_port: int
    http_port: int
    flags: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None

    @property
    def rpc(self) -> str:  # for store clients
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def http(self) -> str:  # metrics, /health, key queries
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> bool:
        self.proc = subprocess.Popen(
            [str(MOONCAKE_MASTER), f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
             f"-metrics_port={self.http_port}", "-metrics_host=127.0.0.1", *self.flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.http}/health", timeout=1).close()
                return True
            except OSError:
                time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def mooncake_master(*flags: str) -> Iterator[MasterProcess | None]:
    """A real mooncake_master on 127.0.0.1, or None where the wheel is not installed or
    the master does not start."""
    if not MOONCAKE_MASTER.exists():
        yield None
        return
    master = MasterProcess(free_port(), free_port(), flags)
    try:
        yield master if master.start() else None
    finally:
        master.stop()


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
