"""`pdcluster-operator`: run the operator against any kubeconfig (or in-cluster)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import kopf
import prometheus_client

from pdcluster import add_version_flag, images
from pdcluster.autoscaler import PrometheusAutoscaler
from pdcluster.children import Children
from pdcluster.controller import Controller
from pdcluster.handlers import register
from pdcluster.io.events import EventRecorder
from pdcluster.io.kube import Kube, KubeConfig
from pdcluster.io.lease import LeaderElector
from pdcluster.io.prometheus_auth import OperatorCredentials, parse_header
from pdcluster.reconcile import Context

log = logging.getLogger("pdcluster")


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
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        tasks = [asyncio.create_task(children.run(watcher, args.namespace, controller.wake))]
        if elector:
            tasks.append(asyncio.create_task(elector.run()))
        for task in tasks:  # one that fails stops the operator (its error is raised below)
            task.add_done_callback(lambda t: None if t.cancelled() or t.exception() is None else stop.set())
        try:
            await kopf.operator(
                registry=registry,
                standalone=True,  # leader election is ours (a Lease); no kopf peering
                clusterwide=not args.namespace,
                namespaces=args.namespace,
                liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
                stop_flag=stop,
            )
        finally:
            await controller.close()
            for t in tasks:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            if elector:
                await elector.release()
            await autoscaler.close()


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
