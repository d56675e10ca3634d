"""`pdcluster-router`: the PD-aware router in front of vLLM prefill and decode pools."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

import aiohttp

from pdcluster import add_version_flag
from pdcluster.constants import KV_EVENTS_PORT, ROUTER_PORT
from pdcluster.io.kube import Kube, KubeConfig
from pdcluster.router import openai
from pdcluster.router.attempt import Services
from pdcluster.router.config import RouterConfig
from pdcluster.router.discovery import Members, parse_static, watch_kube, watch_roles
from pdcluster.router.engines import EngineClient
from pdcluster.router.http import BODY_TIMEOUT_S, HEAD_TIMEOUT_S, MAX_CONNECTIONS, HttpServer
from pdcluster.router.kvevents import KvEventFeed, Source
from pdcluster.router.membership import Pool, Upstream
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.otlp_config import export_config
from pdcluster.router.policy import POLICIES, Admission, KvIndex, make_policy
from pdcluster.router.probe import KvProber
from pdcluster.router.prompt import BLOCK_TOKENS
from pdcluster.router.protocol import MooncakeProtocol
from pdcluster.router.server import MAX_BODY_BYTES, Router
from pdcluster.router.state import StatePublisher
from pdcluster.router.store_hits import StoreIndex
from pdcluster.router.upstream import UpstreamPool

log = logging.getLogger("pdcluster.router")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdcluster-router",
        description="Disaggregated prefill/decode router for vLLM's MooncakeConnector, and for pools of "
        "colocated engines. Backends come from the cluster's EndpointSlices or Pods (--kube) or from "
        "--prefill/--decode/--colocated. Prompt tokens are counted "
        "without a tokenizer (UTF-8 bytes / 4; token-id prompts exactly).",
    )
    add_version_flag(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=ROUTER_PORT)
    _add_backends(p)
    _add_routing(p)
    _add_admission(p)
    _add_store(p)
    _add_requests(p)
    _add_connections(p)
    _add_tracing(p)
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM"
    )
    p.add_argument("--log-level", default="INFO")
    return p


def _add_backends(p: argparse.ArgumentParser) -> None:
    members = p.add_argument_group("backends")
    members.add_argument("--kube", action="store_true", help="follow the cluster's engines in Kubernetes")
    members.add_argument("--namespace", help="namespace to watch (default: the service account's)")
    members.add_argument("--cluster", help="PDCluster name (label pdcluster.io/cluster)")
    members.add_argument(
        "--discovery",
        choices=("endpointslices", "pods"),
        default="endpointslices",
        help="with --kube: read ready engines from EndpointSlices, or from Pods where slices cannot hold "
        "the addresses (a loopback test cluster)",
    )
    members.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, in-cluster, ~/.kube/config)"
    )
    members.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL[#bootstrap=PORT]",
        help="a prefill engine, e.g. http://127.0.0.1:8100#bootstrap=8998 (bootstrap port default 8998); repeatable",
    )
    members.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="a decode engine; repeatable"
    )
    members.add_argument(
        "--colocated",
        action="append",
        default=[],
        metavar="URL",
        help="a colocated engine (prefill and decode in one, no KV hand-off); repeatable, with or "
        "without --prefill/--decode",
    )
    members.add_argument(
        "--flexible",
        action="append",
        default=[],
        metavar="URL[#bootstrap=PORT]",
        help="a flexible engine (MooncakeConnector kv_both), made prefill or decode by the router; "
        "repeatable, in pool order",
    )
    members.add_argument(
        "--prefill-engines",
        type=int,
        default=1,
        help="how many flexible engines act as prefill, the first ones in pool order (at least one of "
        "each role); with --kube the roles ConfigMap changes it",
    )
    members.add_argument(
        "--prefill-on-decode-below",
        type=int,
        default=0,
        metavar="TOKENS",
        help="a prompt shorter than this is prefilled by its decode engine, with no KV hand-off; 0: never",
    )
    members.add_argument(
        "--roles-configmap", help="with --kube: the ConfigMap whose prefillEngines sets the flexible split"
    )


def _add_routing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="served model name; requests naming another model get 404")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="least-loaded",
        help="precise-prefix: prefix-aware on the engines' KV events (vLLM --kv-events-config, ZMQ), "
        "guessing where an engine's events are not flowing",
    )
    events = p.add_argument_group("KV events (precise-prefix)")
    events.add_argument(
        "--kv-events-port",
        type=int,
        default=KV_EVENTS_PORT,
        help="the engines' KV event port (their endpoint's; a DP rank publishes on it plus its rank)",
    )
    events.add_argument(
        "--kv-events-replay-port",
        type=int,
        help="the engines' KV event replay port (their replay_endpoint's, plus the DP rank), where the "
        "router asks for the batches it missed; unset: none",
    )
    events.add_argument("--kv-events-topic", default="", help="the engines' KV event topic")
    events.add_argument(
        "--exact-timeout",
        type=float,
        default=0.1,
        help="seconds that hashing a prompt as the engines do (their /tokenize) may add to a request",
    )
    p.add_argument(
        "--hash-seed",
        help="the engines' PYTHONHASHSEED (it seeds vLLM's block hashes); unset: none",
    )


def _add_admission(p: argparse.ArgumentParser) -> None:
    slo = p.add_argument_group("admission")
    slo.add_argument("--admission-ttft-ms", type=float, default=500.0, help="TTFT target")
    slo.add_argument(
        "--admission-reject-factor",
        type=float,
        default=2.0,
        help="reject when predicted TTFT > target x factor",
    )
    slo.add_argument("--no-admission", action="store_true", help="admit everything")
    slo.add_argument(
        "--admission-ttft-plus-prefill",
        action="store_true",
        help="the TTFT target comes on top of each prompt's own prefill time",
    )
    slo.add_argument(
        "--admission-prefill-rate",
        type=float,
        default=20000.0,
        help="prefill tokens/s assumed for a backend before any measurement",
    )


def _add_store(p: argparse.ArgumentParser) -> None:
    store = p.add_argument_group("Mooncake store: prompts whose prefix is stored skip prefill")
    store.add_argument(
        "--store-master", metavar="URL", help="the master's HTTP port, e.g. http://master:9003"
    )
    store.add_argument(
        "--store-max-computed-tokens",
        type=int,
        default=512,
        help="send a prompt straight to decode when at most this many of its tokens are not stored",
    )
    store.add_argument(
        "--store-lookup-timeout", type=float, default=0.1, help="seconds a lookup may add to a request"
    )


def _add_requests(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request, streams included"
    )
    p.add_argument(
        "--api-key-file", type=Path, help="require `Authorization: Bearer <key>` with the key in this file"
    )
    p.add_argument(
        "--engine-api-key-file", type=Path, help="send engines `Authorization: Bearer <key>` (vLLM --api-key)"
    )
    probe = p.add_argument_group("KV hand-off verification")
    probe.add_argument(
        "--kv-probe-interval",
        type=float,
        default=60.0,
        help="seconds between re-checks of failed and sampled prefill -> decode pairs; 0: no probes",
    )
    probe.add_argument("--kv-probe-tokens", type=int, default=64, help="prompt tokens per probe")
    probe.add_argument(
        "--state-configmap", help="ConfigMap to write the probe verdicts to (needs --kube and --pod-name)"
    )
    probe.add_argument("--pod-name", default=os.environ.get("POD_NAME", ""), help="this router's pod")
    retry = p.add_argument_group("retries")
    retry.add_argument(
        "--max-attempts", type=int, default=3, help="attempts per request, each on engines not tried before"
    )
    retry.add_argument(
        "--prefill-timeout",
        type=float,
        default=120.0,
        help="seconds a prefill may take before another is tried",
    )
    retry.add_argument(
        "--no-resume-streams",
        action="store_true",
        help="end a stream with an error when its decode engine dies, instead of resuming it",
    )


def _add_connections(p: argparse.ArgumentParser) -> None:
    conns = p.add_argument_group("client connections: what slow, silent or greedy clients may hold")
    conns.add_argument(
        "--head-timeout",
        type=float,
        default=HEAD_TIMEOUT_S,
        help="seconds for a request's whole head, from the connection's opening (or, kept alive, from the "
        "head's first byte), however it trickles; a connection that sends nothing is closed after as long",
    )
    conns.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help="seconds for a request's whole body, from the end of its head",
    )
    conns.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="open client connections; past it a new one gets a 503 and is closed, the open ones keep working",
    )


def _add_tracing(p: argparse.ArgumentParser) -> None:
    traces = p.add_argument_group("tracing")
    traces.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send OpenTelemetry spans of each request over OTLP/HTTP to this URL, e.g. "
        "http://collector:4318/v1/traces, and a traceparent to the engines; unset: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, else no tracing "
        "(headers, timeout and resource come from the other OTEL_* variables)",
    )
    traces.add_argument(
        "--trace-sample-ratio",
        type=float,
        help="the share of requests traced (a client's sampled traceparent is followed); unset: "
        "OTEL_TRACES_SAMPLER_ARG where OTEL_TRACES_SAMPLER is a traceidratio one, else 1",
    )


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
        tracing = None
        export = export_config(args.otlp_traces_endpoint, args.trace_sample_ratio, os.environ)
        if export is not None:
            from pdcluster.router.tracing import Tracing

            dropped = services.metrics.trace_spans_dropped
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
        """Refuse new requests (readiness fails) and wait for the in-flight ones."""
        router = self.router
        assert router is not None
        router.draining = True
        log.info("draining %d in-flight requests (up to %g s)", router.inflight, timeout)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(router.idle.wait(), timeout)
        if router.inflight:
            log.warning("drain timeout: dropping %d requests", router.inflight)

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
    if args.kube and not args.cluster:
        parser().error("--kube needs --cluster")
    if not args.kube and not (args.prefill and args.decode) and not args.colocated and not args.flexible:
        parser().error("give --kube, at least one --prefill and one --decode, --colocated or --flexible")
    if args.head_timeout <= 0 or args.body_timeout <= 0 or args.max_connections < 1:
        parser().error("--head-timeout and --body-timeout must be positive, --max-connections at least 1")
    if args.trace_sample_ratio is not None and not 0.0 <= args.trace_sample_ratio <= 1.0:
        parser().error("--trace-sample-ratio must be between 0 and 1")
    if not args.kube and bool(args.prefill) != bool(args.decode):
        parser().error("--prefill and --decode come together: a prefill needs a decode to hand its KV to")
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
