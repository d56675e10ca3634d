"""The operator's Kubernetes client against the two Python clients it could use instead.

io/kube.py keeps a thin aiohttp client for requests and the `kubernetes` package only for
configuration and authentication. This measures why, side by side in one run against the
local cluster's real apiserver: the same work done by

- `ours`: pdcluster.io.kube.Kube (aiohttp, orjson, plain dicts), 8 requests in flight;
- `kubernetes_asyncio`: its generated AppsV1Api on its aiohttp client, 8 in flight
  (installed by this script into a folder of its own: in the project's environment kopf
  would import it too, and every operator started from there would carry its models);
- `kubernetes`: the official synchronous client, 8 threads.

Each client runs in its own process (so CPU and peak RSS are the client's alone) and in
its own namespace, and the clients take turns round by round. The work is the operator's:
server-side apply of N engine StatefulSets as the operator renders them (suspended, so no
pod starts), the same applies again unchanged, N merge patches, ten LISTs of the N, and a
watch that replays 2N events. Printed per client: CPU per operation (microseconds; the
medians of the rounds), operations per second, and peak RSS. Typed clients are used as
their documentation shows: responses become model objects.

    .venv/bin/python benchmarks/kube_client.py [--count 300] [--rounds 3] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "e2e" / "local")]

import yaml  # noqa: E402

from localcluster import cluster, nodes, paths  # noqa: E402
from pdcluster import constants as C  # noqa: E402
from pdcluster.api.v1alpha1 import PDClusterSpec  # noqa: E402
from pdcluster.io.kube import Kube, KubeConfig  # noqa: E402
from pdcluster.render import Owner, Replicas, render_all  # noqa: E402

CLIENTS = ("ours", "kubernetes_asyncio", "kubernetes")
PHASES = ("apply (create)", "apply (unchanged)", "merge patch", "list", "watch event")
IN_FLIGHT = 8
LISTS = 10
MANAGER = "kube-client-bench"
KUBERNETES_ASYNCIO = "36.1.0"


def kubernetes_asyncio_dir() -> Path:
    """kubernetes_asyncio alone (its dependencies are the `kubernetes` package's, already here)."""
    target = paths.cache_dir() / "bench" / f"kubernetes_asyncio-{KUBERNETES_ASYNCIO}"
    if not (target / "kubernetes_asyncio").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
             f"kubernetes_asyncio=={KUBERNETES_ASYNCIO}"],
            check=True,
        )  # fmt: skip
    return target


def statefulsets(namespace: str, count: int) -> list[dict[str, Any]]:
    """N prefill StatefulSets as the operator renders them for examples/pdcluster-sim.yaml."""
    example = yaml.safe_load((REPO / "examples" / "pdcluster-sim.yaml").read_text())
    spec = PDClusterSpec.model_validate({**example["spec"], "suspend": True})
    out = []
    for i in range(count):
        owner = Owner(name=f"c{i}", namespace=namespace, uid="unused")
        children = render_all(spec, owner, Replicas.choose(spec, None))
        sts = next(
            o for o in children if o["kind"] == "StatefulSet" and C.ROLE_PREFILL in o["metadata"]["name"]
        )
        del sts["metadata"]["ownerReferences"]  # no PDCluster stands behind them here
        out.append(sts)
    return out


def annotation_patch(i: int) -> dict[str, Any]:
    return {"metadata": {"annotations": {"bench.pdcluster.io/round": str(i)}}}


async def gather_limited(calls: Iterable[Callable[[], Awaitable[Any]]]) -> None:
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with gate:
            await call()

    await asyncio.gather(*(one(c) for c in calls))


class Meter:
    """Wall and process CPU (every thread) per phase."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}

    def start(self) -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def stop(self, phase: str, started: tuple[float, float], ops: int) -> None:
        wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
        self.phases[phase] = {"ops": ops, "wall_s": wall, "cpu_s": cpu}


async def run_ours(kubeconfig: str, namespace: str, objs: list[dict[str, Any]], meter: Meter) -> None:
    async with Kube(KubeConfig.from_file(kubeconfig)) as kube:
        path = f"/apis/apps/v1/namespaces/{namespace}/statefulsets"
        rv = (await kube.request("GET", path))["metadata"]["resourceVersion"]
        for phase in PHASES[:2]:
            t = meter.start()
            await gather_limited(lambda o=o: kube.apply(o, field_manager=MANAGER) for o in objs)
            meter.stop(phase, t, len(objs))
        t = meter.start()
        await gather_limited(
            lambda i=i, o=o: kube.merge_patch("apps/v1", "StatefulSet", o["metadata"]["name"], namespace, annotation_patch(i))
            for i, o in enumerate(objs)
        )  # fmt: skip
        meter.stop("merge patch", t, len(objs))
        t = meter.start()
        for _ in range(LISTS):
            assert len(await kube.list("apps/v1", "StatefulSet", namespace)) == len(objs)
        meter.stop("list", t, LISTS)
        t = meter.start()
        seen = 0
        async for _ in kube.watch("apps/v1", "StatefulSet", namespace, resource_version=rv):
            seen += 1
            if seen == 2 * len(objs):
                break
        meter.stop("watch event", t, seen)


async def run_kubernetes_asyncio(
    kubeconfig: str, namespace: str, objs: list[dict[str, Any]], meter: Meter
) -> None:
    sys.path.insert(0, str(kubernetes_asyncio_dir()))
    from kubernetes_asyncio import client, config, watch

    await config.load_kube_config(config_file=kubeconfig)
    async with client.ApiClient() as api:
        apps = client.AppsV1Api(api)
        rv = (await apps.list_namespaced_stateful_set(namespace)).metadata.resource_version
        for phase in PHASES[:2]:
            t = meter.start()
            await gather_limited(
                lambda o=o: apps.patch_namespaced_stateful_set(
                    o["metadata"]["name"], namespace, o, field_manager=MANAGER, force=True,
                    _content_type="application/apply-patch+yaml",
                )
                for o in objs
            )  # fmt: skip
            meter.stop(phase, t, len(objs))
        t = meter.start()
        await gather_limited(
            lambda i=i, o=o: apps.patch_namespaced_stateful_set(
                o["metadata"]["name"], namespace, annotation_patch(i), _content_type="application/merge-patch+json"
            )
            for i, o in enumerate(objs)
        )  # fmt: skip
        meter.stop("merge patch", t, len(objs))
        t = meter.start()
        for _ in range(LISTS):
            assert len((await apps.list_namespaced_stateful_set(namespace)).items) == len(objs)
        meter.stop("list", t, LISTS)
        t = meter.start()
        seen = 0
        w = watch.Watch()
        async for _ in w.stream(
            apps.list_namespaced_stateful_set, namespace, resource_version=rv, timeout_seconds=120
        ):
            seen += 1
            if seen == 2 * len(objs):
                w.stop()
                break
        meter.stop("watch event", t, seen)


def run_kubernetes(kubeconfig: str, namespace: str, objs: list[dict[str, Any]], meter: Meter) -> None:
    from kubernetes import client, config, watch

    config.load_kube_config(config_file=kubeconfig)
    apps = client.AppsV1Api()
    rv = apps.list_namespaced_stateful_set(namespace).metadata.resource_version
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        for phase in PHASES[:2]:
            t = meter.start()
            list(pool.map(
                lambda o: apps.patch_namespaced_stateful_set(
                    o["metadata"]["name"], namespace, o, field_manager=MANAGER, force=True,
                    _content_type="application/apply-patch+yaml",
                ),
                objs,
            ))  # fmt: skip
            meter.stop(phase, t, len(objs))
        t = meter.start()
        list(pool.map(
            lambda io: apps.patch_namespaced_stateful_set(
                io[1]["metadata"]["name"], namespace, annotation_patch(io[0]),
                _content_type="application/merge-patch+json",
            ),
            enumerate(objs),
        ))  # fmt: skip
        meter.stop("merge patch", t, len(objs))
    t = meter.start()
    for _ in range(LISTS):
        assert len(apps.list_namespaced_stateful_set(namespace).items) == len(objs)
    meter.stop("list", t, LISTS)
    t = meter.start()
    seen = 0
    w = watch.Watch()
    for _ in w.stream(apps.list_namespaced_stateful_set, namespace, resource_version=rv, timeout_seconds=120):
        seen += 1
        if seen == 2 * len(objs):
            w.stop()
            break
    meter.stop("watch event", t, seen)


def child(name: str, kubeconfig: str, namespace: str, count: int) -> None:
    """One client's run, in this process alone: prints its figures as JSON."""
    objs = statefulsets(namespace, count)
    meter = Meter()
    if name == "kubernetes":
        run_kubernetes(kubeconfig, namespace, objs, meter)
    else:
        runner = run_ours if name == "ours" else run_kubernetes_asyncio
        asyncio.run(runner(kubeconfig, namespace, objs, meter))
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"phases": meter.phases, "rss_mib": rss_mib}))


async def make_namespace(state: cluster.State, name: str) -> None:
    async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
        await kube.apply(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, field_manager=MANAGER
        )


def table(results: dict[str, list[dict[str, Any]]]) -> None:
    def median(client: str, phase: str, key: str) -> float:
        return statistics.median(r["phases"][phase][key] / r["phases"][phase]["ops"] for r in results[client])

    print("CPU per operation, microseconds (median of the rounds; in parentheses: times ours)")
    print("| client | " + " | ".join(PHASES) + " | peak RSS |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for client in CLIENTS:
        cells = []
        for phase in PHASES:
            us, base = median(client, phase, "cpu_s") * 1e6, median("ours", phase, "cpu_s") * 1e6
            cells.append(f"{us:.0f}" + ("" if client == "ours" else f" ({us / base:.1f}x)"))
        rss = statistics.median(r["rss_mib"] for r in results[client])
        print(f"| {client} | " + " | ".join(cells) + f" | {rss:.0f} MiB |")
    print("\nOperations per second (wall; the apiserver shares the cores)")
    print("| client | " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    for client in CLIENTS:
        print(f"| {client} | " + " | ".join(f"{1 / median(client, p, 'wall_s'):.0f}" for p in PHASES) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--count", type=int, default=300, help="StatefulSets per client and round (default: %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cluster", default="bench-client", help="local cluster name (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="leave the cluster up")
    p.add_argument("--child", nargs=3, metavar=("CLIENT", "KUBECONFIG", "NAMESPACE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2], args.count)
        return
    kubernetes_asyncio_dir()  # installed before anything is measured
    state = cluster.up(args.cluster, nodes.NodePool(gpu_nodes=1, cpu_nodes=1))
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in CLIENTS}
    try:
        for r in range(args.rounds):
            for client in CLIENTS[r % len(CLIENTS) :] + CLIENTS[: r % len(CLIENTS)]:
                namespace = f"bench-{client.replace('_', '-')}-{r}"
                asyncio.run(make_namespace(state, namespace))
                out = subprocess.run(
                    [sys.executable, __file__, "--count", str(args.count), "--child", client, state.kubeconfig, namespace],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                results[client].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1} {client}: {results[client][-1]}", file=sys.stderr)
    finally:
        if not args.keep:
            cluster.down(args.cluster)
    print(
        f"{args.count} StatefulSets per client and round, {args.rounds} rounds, {IN_FLIGHT} requests in flight"
    )
    table(results)


if __name__ == "__main__":
    main()
