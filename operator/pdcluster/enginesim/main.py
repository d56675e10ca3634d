"""`pdcluster-engine-sim serve MODEL [vllm serve flags] [--sim-* flags]`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import sys
from typing import Any

import aiohttp
from aiohttp import web

from pdcluster import __version__, perf
from pdcluster import constants as C
from pdcluster.enginesim.api import OpenAIServer
from pdcluster.enginesim.cli import SimConfig, parse
from pdcluster.enginesim.engine import EngineCore, Seq, TransferHook
from pdcluster.enginesim.kv.mooncake_client import MooncakeStore
from pdcluster.enginesim.kv.puller import KvPuller
from pdcluster.enginesim.kv.side_channel import BootstrapServer, SideChannel
from pdcluster.enginesim.kv.transfers import TransferTable
from pdcluster.enginesim.nodes import Group
from pdcluster.enginesim.prefix import EventPublisher, PrefixCache
from pdcluster.enginesim.store_connector import PrefixStore
from pdcluster.enginesim.vllm_metrics import EngineMetrics, MetricFamilies
from pdcluster.vllm import kvtransfer as kvt

log = logging.getLogger("pdcluster.enginesim")

ZERO_PROFILE = perf.Profile(
    "zero", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), max_kv_tokens=1 << 40, kv_bytes_per_token=0
)


def load_profile(name: str) -> perf.Profile:
    return ZERO_PROFILE if name == "zero" else perf.load(name)


class Simulator:
    """All the parts of one simulated `vllm serve` process."""

    def __init__(self, config: SimConfig):
        self.config = config
        self.profile = load_profile(config.profile)
        if config.num_gpu_blocks:
            self.profile = dataclasses.replace(
                self.profile, max_kv_tokens=config.num_gpu_blocks * config.block_size
            )
        kv = self.profile.max_kv_tokens
        self.families = MetricFamilies(
            config.max_model_len, kv_tokens=kv if kv < 1 << 40 else None, block_size=config.block_size
        )
        self.engine_ids = config.engine_ids
        self.table = TransferTable(
            config.abort_timeout_s, on_expired=lambda rank: self.cores[rank].metrics.expired.inc()
        )
        self.cores: list[EngineCore] = []
        self.store: MooncakeStore | None = None  # the hand-off's bytes (--sim-mooncake-master)
        self.prefix_store: PrefixStore | None = None  # MooncakeStoreConnector's blocks
        self.session: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []
        self.side_channel: SideChannel | None = None

    @property
    def advertised_ip(self) -> str:
        """The address peers use: VLLM_HOST_IP, else --host if it names one, else what
        the host name resolves to (a pod's own IP in Kubernetes)."""
        host = self.config.host
        if self.config.host_ip:
            return self.config.host_ip
        if host and host not in ("0.0.0.0", "::"):
            return host
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    def _on_prefilled(self, rank: int) -> TransferHook:
        def hook(transfer_id: str, seq: Seq, kept: bool) -> None:
            core = self.cores[rank]
            tokens = seq.kv
            release = (lambda: core.release_held(tokens)) if kept else None
            self.table.prefilled(transfer_id, rank, seq.prompt_tokens, release)

        return hook

    def _transfer_seconds(self, tokens: int) -> float:
        if self.profile.kv_bytes_per_token == 0:
            return 0.0
        return self.profile.kv_transfer_ms(tokens, self.config.kv_gbps) / 1000.0 / self.config.time_scale

    def _on_transferred(self, rank: int, seconds: float, size: int) -> None:
        metrics = self.cores[rank].metrics
        metrics.xfer_time.observe(seconds)
        metrics.xfer_bytes.observe(size)

    async def _prefix_store(self, config: dict) -> PrefixStore | None:
        c = self.config
        client = await MooncakeStore.connect(
            config["master_server_address"],
            self.advertised_ip,
            metadata_server=config.get("metadata_server") or "P2PHANDSHAKE",
            segment=int(config.get("global_segment_size", MooncakeStore.SEGMENT_BYTES)),
            buffer=int(config.get("local_buffer_size", MooncakeStore.BUFFER_BYTES)),
        )
        if client is None:
            return None
        return PrefixStore(
            client,
            role=c.store_role or kvt.KV_BOTH,
            model=c.model,
            block_size=c.block_size,
            hash_seed=c.hash_seed,
            profile=self.profile,
            gbps=c.kv_gbps,
            time_scale=c.time_scale,
        )

    async def start(self) -> None:
        c = self.config
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if c.mooncake_master:
            self.store = await MooncakeStore.connect(c.mooncake_master, self.advertised_ip)
        puller = KvPuller(self.session, c.abort_timeout_s + 60.0, self.store) if c.role != "prefill" else None
        for rank in range(c.data_parallel_size):
            core = EngineCore(
                self.profile,
                EngineMetrics(self.families, c.model_name, rank),
                time_scale=c.time_scale,
                max_num_seqs=c.max_num_seqs,
                max_num_batched_tokens=c.max_num_batched_tokens,
                max_model_len=c.max_model_len,
                recompute_on_load_failure=c.recompute_on_load_failure,
                pull_kv=puller.pull if puller else None,
                on_prefilled=self._on_prefilled(rank),
            )
            if c.prefix_caching:
                core.prefix = PrefixCache(
                    self.profile.max_kv_tokens // c.block_size,
                    c.block_size,
                    c.hash_seed,
                    self._publisher(rank),
                )
            core.start()
            self.cores.append(core)
        if c.store_config is not None:
            self.prefix_store = await self._prefix_store(c.store_config)
        api = OpenAIServer(c, self.cores, self.families.registry, self.prefix_store)
        app = api.app()
        if c.faults:
            app.router.add_post("/sim/faults", self._faults)
        await self._serve(app, c.host or "0.0.0.0", c.port)
        if c.serves_bootstrap:
            # vLLM binds 0.0.0.0; binding the advertised address instead lets several
            # simulated pods share one host's loopback network.
            bind = c.host_ip or (c.host if c.host else "0.0.0.0")
            self.side_channel = SideChannel(
                self.table,
                self.engine_ids,
                self._transfer_seconds,
                lambda tokens: tokens * self.profile.kv_bytes_per_token,
                self._on_transferred,
                self.store,
            )
            port = await self.side_channel.start(bind)
            app = BootstrapServer(self.engine_ids, self._worker_addrs(port)).app()
            await self._serve(app, bind, c.bootstrap_port)
            log.info("bootstrap server on %s:%d, engine ids %s", bind, c.bootstrap_port, self.engine_ids)
        log.info("role %s, profile %s, time scale %g", c.role, self.profile.name, c.time_scale)
        log.info("Application startup complete.")

    def _publisher(self, rank: int) -> EventPublisher | None:
        c = self.config
        if c.kv_events_config is None:
            return None
        config = dict(c.kv_events_config)
        # As for the bootstrap server: the advertised address, not vLLM's wildcard, so
        # that simulated pods can share a host.
        bind = c.host_ip or c.host
        if bind and bind not in ("0.0.0.0", "::"):
            for key in ("endpoint", "replay_endpoint"):
                if config.get(key):
                    config[key] = str(config[key]).replace("*", bind, 1)
            # vLLM's default endpoint (config/kv_events.py), our KV_EVENTS_PORT.
            config.setdefault("endpoint", f"tcp://{bind}:{C.KV_EVENTS_PORT}")
        return EventPublisher(config, rank)

    async def _faults(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.side_channel is None or body.get("kv_send") not in ("fail", "ok"):
            return web.json_response(
                {"error": 'expected {"kv_send": "fail" | "ok"} on a prefill'}, status=400
            )
        self.side_channel.failing = body["kv_send"] == "fail"
        log.warning("KV hand-offs %s", "fail from now on" if self.side_channel.failing else "work again")
        return web.json_response({"kv_send": body["kv_send"]})

    def _worker_addrs(self, port: int) -> list[dict[str, dict[str, str]]]:
        """vLLM lists each worker's ZMQ address; every simulated worker shares the one
        side channel."""
        c = self.config
        address = f"tcp://{self.advertised_ip}:{port}"
        per_rank = {
            str(tp): {str(pp): address for pp in range(c.pipeline_parallel_size)}
            for tp in range(c.tensor_parallel_size)
        }
        return [per_rank for _ in range(c.data_parallel_size)]

    async def _serve(self, app: web.Application, host: str, port: int) -> None:
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, host, port, backlog=1024).start()
        self._runners.append(runner)

    async def stop(self) -> None:
        if self.side_channel is not None:
            await self.side_channel.stop()
        for runner in self._runners:
            await runner.cleanup()
        for core in self.cores:
            await core.stop()
            if core.prefix is not None and core.prefix.publisher is not None:
                await core.prefix.publisher.close()
        if self.session is not None:
            await self.session.close()
        if self.store is not None:
            await self.store.close()
        if self.prefix_store is not None:
            await self.prefix_store.close()


async def _until(*aws: Any) -> None:
    """Until the first of `aws` finishes; the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def serve(config: SimConfig) -> int:
    """Run until SIGTERM (0) or until a node of a multi-node group leaves (1)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    c = config
    group = Group(c.nnodes, c.node_rank, c.master_addr, c.master_port) if c.nnodes > 1 else None
    try:
        if group is not None:
            follower = c.headless and c.node_rank > 0
            await _until(group.follow() if follower else group.lead(), stop.wait())
            if follower:
                await _until(group.broken.wait(), stop.wait())
                return 0 if stop.is_set() else 1
            if stop.is_set():
                return 0
        sim = Simulator(config)
        await sim.start()
        try:
            await _until(stop.wait(), *([group.broken.wait()] if group else []))
        finally:
            await sim.stop()
        return 0 if stop.is_set() else 1
    finally:
        if group is not None:
            await group.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        print(f"pdcluster-engine-sim {__version__}")
        return
    if argv[:1] in (["-h"], ["--help"]):
        argv = ["serve", "--help"]  # the one command's help, as `vllm serve --help`
    if not argv or argv[0] != "serve":
        sys.exit("usage: pdcluster-engine-sim serve MODEL [vllm serve flags] [--sim-* flags]")
    config = parse(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    code = 0
    with contextlib.suppress(KeyboardInterrupt):
        code = runner(serve(config))
    sys.exit(code)


if __name__ == "__main__":
    main()
