"""`pdcluster-operator`: run the operator against any kubeconfig (or in-cluster)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Any

import kopf
import prometheus_client

from pdcluster import add_version_flag, images
from pdcluster.autoscaler import PrometheusAutoscaler
from pdcluster.children import Children
from pdcluster.controller import Controller
from pdcluster.follow import follow
from pdcluster.handlers import register
from pdcluster.io.events import EventRecorder
from pdcluster.io.kube import Kube, KubeConfig
from pdcluster.io.lease import LeaderElector
from pdcluster.io.prometheus_auth import OperatorCredentials, parse_header
from pdcluster.reconcile import Context

log = logging.getLogger("pdcluster")

# kopf stops its watches (a few seconds for the events queued) and cancels what it started.
KOPF_EXIT_SECONDS = 10.0
RELEASE_SECONDS = 3.0  # handing the Lease on saves the next leader its expiry; not worth more


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdcluster-operator", description=__doc__)
    add_version_flag(p)
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig path (default: $KUBECONFIG, in-cluster, ~/.kube/config)",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch only this namespace (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    p.add_argument(
        "--prometheus-url",
        default=os.environ.get("PDCLUSTER_PROMETHEUS_URL"),
        help="Prometheus for autoscaling",
    )
    _prometheus_auth_flags(p)
    _image_flags(p)
    p.add_argument(
        "--resync-seconds", type=float, default=30.0, help="reconcile every cluster at least this often"
    )
    p.add_argument("--metrics-port", type=int, default=8080, help="operator /metrics; 0 disables")
    p.add_argument("--health-port", type=int, default=8081, help="liveness endpoint /healthz; 0 disables")
    p.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--leader-election-namespace", default=os.environ.get("POD_NAMESPACE"))
    p.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=10.0,
        help="at SIGTERM, how long reconciles in flight may finish before they are cancelled "
        "(keep well inside the pod's terminationGracePeriodSeconds)",
    )
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def _prometheus_auth_flags(p: argparse.ArgumentParser) -> None:
    """Credentials for --prometheus-url (never sent to a URL a PDCluster names itself)."""
    env = os.environ.get
    for flag, what in (
        ("bearer-token-file", "a bearer token, re-read at every query round"),
        ("username-file", "basic auth: the user name"),
        ("password-file", "basic auth: the password"),
        ("ca-file", "PEM CA bundle to verify an https Prometheus with"),
    ):
        variable = "PDCLUSTER_PROMETHEUS_" + flag.upper().replace("-", "_")
        p.add_argument(f"--prometheus-{flag}", default=env(variable), help=f"{what} (env {variable})")
    p.add_argument(
        "--prometheus-header",
        action="append",
        type=parse_header,
        default=[],
        metavar="NAME=VALUE",
        help="extra header for Prometheus, e.g. X-Scope-OrgID=tenant-1 (repeatable)",
    )


def _image_flags(p: argparse.ArgumentParser) -> None:
    """What a PDCluster that names no image runs (the chart sets these from its values)."""
    for kind in (images.ENGINE, images.ENGINE_SIM, images.ROUTER, images.MOONCAKE):
        variable = f"PDCLUSTER_{kind.upper().replace('-', '_')}_IMAGE"
        p.add_argument(
            f"--{kind}-image",
            default=os.environ.get(variable),
            help=f"default {kind} image (env {variable}; built in: {images.BUILT_IN[kind]})",
        )
    p.add_argument(
        "--image-pull-secret",
        action="append",
        default=[s for s in os.environ.get("PDCLUSTER_IMAGE_PULL_SECRETS", "").split(",") if s],
        metavar="NAME",
        help="Secret for pulling images on every pod a PDCluster without imagePullSecrets runs "
        "(repeatable; env PDCLUSTER_IMAGE_PULL_SECRETS, comma-separated)",
    )


def configure_images(args: argparse.Namespace) -> None:
    kinds = (images.ENGINE, images.ENGINE_SIM, images.ROUTER, images.MOONCAKE)
    images.configure(
        {kind: getattr(args, f"{kind.replace('-', '_')}_image") for kind in kinds}, args.image_pull_secret
    )


def operator_credentials(args: argparse.Namespace) -> OperatorCredentials:
    def path(value: str | None) -> Path | None:
        return Path(value) if value else None

    return OperatorCredentials(
        bearer_token_file=path(args.prometheus_bearer_token_file),
        username_file=path(args.prometheus_username_file),
        password_file=path(args.prometheus_password_file),
        ca_file=path(args.prometheus_ca_file),
        headers=dict(args.prometheus_header),
    )


async def run(args: argparse.Namespace) -> None:
    config = KubeConfig.load(args.kubeconfig)
    registry = kopf.OperatorRegistry()
    # The children's watches get a client of their own: they hold their connections for good.
    async with Kube(config) as kube, Kube(config) as watcher:
        elector = None
        if args.leader_election:
            elector = LeaderElector(kube, args.leader_election_namespace or config.namespace)
        autoscaler = PrometheusAutoscaler(
            kube, args.prometheus_url, default_credentials=operator_credentials(args)
        )
        children = Children()
        context = Context(kube=kube, events=EventRecorder(kube), autoscaler=autoscaler, children=children)
        controller = Controller(context, resync=args.resync_seconds, elector=elector, synced=children.synced)
        register(registry, controller, config)
        stop = asyncio.Event()
        _stop_on_signals(stop)
        tasks = [
            asyncio.create_task(children.run(watcher, args.namespace, controller.wake)),
            asyncio.create_task(follow(watcher, args.namespace, controller)),
        ]
        if elector:
            tasks.append(asyncio.create_task(elector.run()))
        for task in tasks:  # one that fails stops the operator (its error is raised below)
            task.add_done_callback(lambda t: None if t.cancelled() or t.exception() is None else stop.set())
        kopf_stop, kopf_ready = asyncio.Event(), asyncio.Event()
        operator = asyncio.create_task(
            kopf.operator(
                registry=registry,
                standalone=True,  # leader election is ours (a Lease); no kopf peering
                clusterwide=not args.namespace,
                namespaces=args.namespace,
                liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
                stop_flag=kopf_stop,
                ready_flag=kopf_ready,
            )
        )
        operator.add_done_callback(lambda _: stop.set())
        signals = asyncio.create_task(_take_back_signals(kopf_ready, stop))
        try:
            await stop.wait()
            log.info("stopping: no new reconciles; %.0fs for those in flight", args.shutdown_grace_seconds)
            # Workers first: kopf would let them run on while it stops, then cancel them.
            await controller.close(grace=args.shutdown_grace_seconds)
        finally:
            signals.cancel()
            kopf_stop.set()
            await _stop(operator, controller, tasks, elector, autoscaler)


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def _take_back_signals(kopf_ready: asyncio.Event, stop: asyncio.Event) -> None:
    """kopf installs its own SIGINT/SIGTERM handlers as it starts (replacing ours); once it
    is up they are ours again, so that a signal stops the reconciles before kopf stops."""
    await kopf_ready.wait()
    _stop_on_signals(stop)


async def _stop(
    operator: asyncio.Task[None],
    controller: Controller,
    tasks: list[asyncio.Task[Any]],
    elector: LeaderElector | None,
    autoscaler: PrometheusAutoscaler,
) -> None:
    """kopf's own stop (its watches, then the tasks it started), then ours, each bounded:
    an apiserver that does not answer must not hold the exit. The first error of kopf or
    of our tasks is raised."""
    try:
        await asyncio.wait_for(asyncio.shield(operator), KOPF_EXIT_SECONDS)
    except TimeoutError:
        log.warning("kopf did not stop within %.0fs; cancelling it", KOPF_EXIT_SECONDS)
        operator.cancel()
        await asyncio.wait([operator], timeout=KOPF_EXIT_SECONDS)
    except Exception:
        pass  # raised below, once ours are stopped too
    await controller.close()
    for t in tasks:
        t.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    if elector:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(elector.release(), RELEASE_SECONDS)
    await autoscaler.close()
    if operator.done() and not operator.cancelled():
        outcomes.insert(0, operator.exception())
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_images(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.metrics_port:
        prometheus_client.start_http_server(args.metrics_port)
    # The stdlib loop, not uvloop: the operator's traffic is a few TLS calls a second to
    # the apiserver, and uvloop's TLS transport logs "Fatal error on SSL protocol" when a
    # closed connection still has data to flush (MagicStack/uvloop#506, open).
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
