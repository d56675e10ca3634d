"""`pdcluster-router`: the PD-aware router in front of vLLM prefill and decode pools."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

import aiohttp

from pdcluster.io.kube import Kube, KubeConfig
from pdcluster.router import openai
from pdcluster.router.attempt import Services
from pdcluster.router.config import RouterConfig
from pdcluster.router.discovery import Members, parse_static, watch_kube, watch_roles
from pdcluster.router.engines import EngineClient
from pdcluster.router.flags import parser, problem
from pdcluster.router.http import HttpServer
from pdcluster.router.kvevents import KvEventFeed, Source
from pdcluster.router.membership import Pool, Upstream
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.otlp_config import export_config
from pdcluster.router.policy import Admission, KvIndex, make_policy
from pdcluster.router.probe import KvProber
from pdcluster.router.prompt import BLOCK_TOKENS
from pdcluster.router.protocol import MooncakeProtocol
from pdcluster.router.server import MAX_BODY_BYTES, Router
from pdcluster.router.state import StatePublisher
from pdcluster.router.store_hits import StoreIndex
from pdcluster.router.upstream import UpstreamPool

if TYPE_CHECKING:
    from pdcluster.router.tracing import Tracing

_DRAIN_POLL_S = 0.1
log = logging.getLogger("pdcluster.router")


class RouterService:
    """The router with its backends, listening; `start()`, then `drain()` and `stop()`."""

    def __init__(self, args: argparse.Namespace, members: Members | None):
        self.args = args
        self.members = members  # None: from EndpointSlices
        self.session: aiohttp.ClientSession | None = None
        self.pool: Pool | None = None
        self.router: Router | None = None
        self._http: HttpServer | None = None
        self._kube: Kube | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._publishing: asyncio.Task[None] | None = None
        self._events: asyncio.Task[None] | None = None
        self._roles: asyncio.Task[None] | None = None

    async def start(self) -> None:
        args = self.args
        loop = asyncio.get_running_loop()
        # For the few calls off the hot path (bootstrap /query, /v1/models).
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self.pool = Pool(self.session, on_forget=self._forget)
        services = self._services(self.pool)
        publisher = await self._follow_engines(self.pool)
        prober = None
        if args.kv_probe_interval > 0:
            prober = KvProber(
                services,
                args.kv_probe_interval,
                args.kv_probe_tokens,
                on_change=(lambda: self._publish(publisher)) if publisher is not None else lambda: None,
            )
        tracing = self._tracing(services.metrics)
        store = self._store(services.engines)
        policy = make_policy(args.policy, BLOCK_TOKENS)
        self.router = Router(services, self.session, policy, store=store, prober=prober, tracing=tracing)
        if prober is not None:
            self._prober = loop.create_task(prober.run())
            if publisher is not None:
                self._publish(publisher)
        if policy.kv_index is not None:
            self._events = loop.create_task(self._kv_events(policy.kv_index, services.metrics).run())
        cut = services.metrics.connections_cut
        self._http = HttpServer(
            self.router.handle,
            openai.error_body,
            MAX_BODY_BYTES,
            head_timeout_s=args.head_timeout,
            body_timeout_s=args.body_timeout,
            max_connections=args.max_connections,
            on_cut=lambda reason: cut[reason].inc(),
        )
        await self._http.start(args.host, args.port)
        log.info(
            "listening on %s:%d, policy %s, admission %s, store lookups %s",
            args.host,
            args.port,
            args.policy,
            "off" if services.admission is None else "on",
            args.store_master or "off",
        )

    def _tracing(self, metrics: RouterMetrics) -> Tracing | None:
        """The span exporter, started, where the flags or the OTEL_* variables ask for one."""
        export = export_config(self.args.otlp_traces_endpoint, self.args.trace_sample_ratio, os.environ)
        if export is None:
            return None
        from pdcluster.router.tracing import Tracing

        dropped = metrics.trace_spans_dropped
        tracing = Tracing(
            export.endpoint,
            export.sample_ratio,
            headers=export.headers,
            resource=export.resource,
            timeout_s=export.timeout_s,
            on_drop=lambda reason, spans: dropped[reason].inc(spans),
        )
        tracing.start()
        log.info(
            "tracing: %g of requests to %s as service %s, headers %s",  # names only: values may be secrets
            export.sample_ratio, export.endpoint, export.resource["service.name"], sorted(export.headers) or "none",
        )  # fmt: skip
        return tracing

    def _services(self, pool: Pool) -> Services:
        args = self.args
        api_key = args.api_key_file.read_text().strip() if args.api_key_file else None
        engine_key = args.engine_api_key_file.read_text().strip() if args.engine_api_key_file else None
        config = RouterConfig(
            model=args.model,
            request_timeout_s=args.request_timeout,
            api_key=api_key,
            engine_api_key=engine_key,
            max_attempts=max(args.max_attempts, 1),
            prefill_timeout_s=args.prefill_timeout,
            resume_streams=not args.no_resume_streams,
            hash_seed=args.hash_seed,
            exact_timeout_s=args.exact_timeout,
            prefill_on_decode_below=args.prefill_on_decode_below,
            max_fan_out=max(args.max_fan_out, 1),
        )
        admission = None
        if not args.no_admission:
            admission = Admission(
                args.admission_ttft_ms,
                args.admission_reject_factor,
                args.admission_prefill_rate,
                plus_prefill=args.admission_ttft_plus_prefill,
            )
        metrics = RouterMetrics(pool.load_snapshot)
        return Services(config, EngineClient(engine_key), MooncakeProtocol(), metrics, admission, pool)

    def _store(self, engines: EngineClient) -> StoreIndex | None:
        args = self.args
        if not args.store_master:
            return None
        return StoreIndex(
            UpstreamPool(),
            args.store_master,
            hash_seed=args.hash_seed,
            max_computed_tokens=args.store_max_computed_tokens,
            timeout_s=args.store_lookup_timeout,
            engine_headers=engines.auth_lines,
        )

    async def _follow_engines(self, pool: Pool) -> StatePublisher | None:
        """Follow the cluster's engines (or take the static ones); the publisher of the
        KV verdicts, where the router has a ConfigMap to write them to."""
        args = self.args
        pool.assign(args.prefill_engines)
        if self.members is not None:
            pool.update(self.members)
            return None
        config = KubeConfig.load(args.kubeconfig)
        self._kube = Kube(config)
        await self._kube.__aenter__()
        namespace = args.namespace or config.namespace
        loop = asyncio.get_running_loop()
        self._watcher = loop.create_task(watch_kube(self._kube, namespace, args.cluster, pool, args.discovery))
        if args.roles_configmap:
            self._roles = loop.create_task(
                watch_roles(self._kube, namespace, args.roles_configmap, pool)
            )
        if args.state_configmap and args.pod_name:
            return StatePublisher(self._kube, namespace, args.state_configmap, args.pod_name)
        return None

    def _kv_events(self, index: KvIndex, metrics: RouterMetrics) -> KvEventFeed:
        return KvEventFeed(
            index,
            self._event_sources,
            topic=self.args.kv_events_topic,
            on_batch=lambda engine: metrics.kv_event_batches.inc(),
            on_loss=lambda engine, reason: metrics.kv_event_losses[reason].inc(),
        )

    def _event_sources(self) -> list[Source]:
        """Where the engines the policy picks among publish their KV events: each prefill
        DP rank on the ports plus its rank (as vLLM offsets them), a colocated engine on the ports."""
        pool, port, replay = self.pool, self.args.kv_events_port, self.args.kv_events_replay_port
        assert pool is not None

        def source(u: Upstream) -> Source:
            rank = u.engine.dp_rank if u.engine is not None else 0
            return Source(u.id, u.origin.host, port + rank, None if replay is None else replay + rank)

        return [source(u) for u in [*pool.prefill, *pool.colocated]]

    def _publish(self, publisher: StatePublisher) -> None:
        """Write the verdicts in the background; a newer change waits for the write before."""
        router, pool = self.router, self.pool
        assert router is not None and router.prober is not None and pool is not None
        publisher.routers = set(pool.routers) | {publisher.pod}
        summary = router.prober.summary()
        previous = self._publishing

        async def write() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            await publisher.publish(summary)

        self._publishing = asyncio.get_running_loop().create_task(write())

    def _forget(self, backend_id: str) -> None:
        if self.router is not None:
            self.router.forget(backend_id)

    async def drain(self, timeout: float) -> None:
        """Fail readiness (no new connections come), end kept-alive connections, and wait
        for the requests in flight; one arriving on an open connection meanwhile is served
        and closes it."""
        router = self.router
        assert router is not None
        router.draining = True
        if self._http is not None:
            self._http.end_keepalive()
        log.info("draining %d in-flight requests (up to %g s)", router.inflight, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(router.idle.wait(), timeout)
        if router.inflight:
            log.warning("drain timeout: dropping %d requests", router.inflight)
        # Then the connections still open: each ends after its answer (end_keepalive), so
        # a request already on its way is answered rather than cut by the exit.
        while self._http is not None and self._http.connections and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)

    async def stop(self) -> None:
        if self._http is not None:  # the drain has waited for in-flight requests: cut the rest
            await self._http.close()
        for task in (self._watcher, self._roles, self._prober, self._publishing, self._events):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._kube is not None:
            await self._kube.close()
        if self.pool is not None:
            await self.pool.close()
        if self.router is not None:
            self.router.services.engines.upstream.close()
            if self.router.engine_tokens is not None:
                self.router.engine_tokens.upstream.close()
            if self.router.tracing is not None:
                await self.router.tracing.close()  # sends what is still batched
        if self.session is not None:
            await self.session.close()


async def run(args: argparse.Namespace, members: Members | None) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = RouterService(args, members)
    await service.start()
    await stop.wait()
    await service.drain(args.drain_timeout)
    await service.stop()


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if why := problem(args):
        parser().error(why)
    try:
        members = None if args.kube else parse_static(args.prefill, args.decode, args.colocated, args.flexible)
    except ValueError as e:
        sys.exit(f"pdcluster-router: {e}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    runner(run(args, members))


if __name__ == "__main__":
    main()
