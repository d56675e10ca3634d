"""The router follows the cluster's engines on a real apiserver: its backend set follows
each change of an EndpointSlice (or, with --discovery pods, a Pod), and only ready
endpoints of its own cluster count.

EndpointSlice validation rejects loopback addresses, so for that test the engines run
in a network namespace of the test's own, reached over a veth pair with addresses from
198.18.0.0/15 (reserved for benchmarking networks). The Pod test uses loopback.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from loopback import CONSUMER, PRODUCER, free_port, simulator

from pdcluster.io.kube import Kube
from pdcluster.router.flags import parser
from pdcluster.router.main import RouterService

pytestmark = pytest.mark.cluster

CLUSTER = "c1"
SIM = str(Path(sys.executable).parent / "pdcluster-engine-sim")
WaitUntil = Callable[..., Awaitable[Any]]


def labels(role: str, cluster: str = CLUSTER) -> dict[str, str]:
    return {"pdcluster.io/cluster": cluster, "pdcluster.io/role": role}


@contextlib.asynccontextmanager
async def router(namespace: str, kubeconfig: str, *args: str) -> AsyncIterator[tuple[RouterService, str]]:
    port = free_port()
    argv = ["--host", "127.0.0.1", "--port", str(port), "--kube", "--namespace", namespace, "--cluster", CLUSTER,
            "--kubeconfig", kubeconfig, *args]  # fmt: skip
    service = RouterService(parser().parse_args(argv), None)
    await service.start()
    try:
        yield service, f"http://127.0.0.1:{port}"
    finally:
        await service.stop()


async def follows(wait_until: WaitUntil, predicate: Callable[[], Any], what: str) -> None:
    """Waits for the router's view to change. The deadline only ends a broken test: how
    soon the change shows depends on the machine, and is no part of what is checked."""
    await wait_until(predicate, interval=0.02, message=what)


async def ready_status(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/ready") as resp:
        return resp.status


async def complete(http: aiohttp.ClientSession, url: str) -> int:
    async with http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3}) as resp:
        return (await resp.json())["usage"]["completion_tokens"] if resp.status == 200 else -resp.status


# ------------------------------------------------------------------------ EndpointSlices
@pytest.fixture
def netns() -> Iterator[tuple[str, list[str]]]:
    """A network namespace with three addresses, reachable from here over a veth pair."""
    if os.geteuid() != 0:
        pytest.skip("creating a network namespace needs root")
    name = f"pdrt{uuid.uuid4().hex[:6]}"
    net = f"198.18.{random.randrange(256)}"
    inner = [f"{net}.2", f"{net}.3", f"{net}.4"]
    setup = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", f"{name}h", "type", "veth", "peer", "name", f"{name}n"],
        ["ip", "link", "set", f"{name}n", "netns", name],
        ["ip", "addr", "add", f"{net}.1/29", "dev", f"{name}h"],
        ["ip", "link", "set", f"{name}h", "up"],
        *(["ip", "netns", "exec", name, "ip", "addr", "add", f"{ip}/29", "dev", f"{name}n"] for ip in inner),
        ["ip", "netns", "exec", name, "ip", "link", "set", f"{name}n", "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for command in setup:
            subprocess.run(command, check=True, capture_output=True)
        yield name, inner
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot create a network namespace here: {e}")
    finally:
        subprocess.run(["ip", "link", "del", f"{name}h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextlib.contextmanager
def sim_in(netns: str, ip: str, kv_config: str) -> Iterator[tuple[int, int]]:
    """An engine simulator inside the namespace; yields (API port, bootstrap port)."""
    port, bootstrap = random.randrange(20000, 30000), random.randrange(30000, 40000)
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, SIM, "serve", "m", "--host", ip, "--port", str(port), "--sim-profile", "zero",
         "--kv-transfer-config", kv_config],
        env={**os.environ, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield port, bootstrap
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def healthy(http: aiohttp.ClientSession, url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError):
        async with http.get(f"{url}/health") as resp:
            return resp.status == 200
    return False


def endpoint_slice(
    namespace: str,
    name: str,
    role: str,
    endpoints: list[tuple[str, bool]],
    ports: dict[str, int],
    cluster: str = CLUSTER,
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": f"{cluster}-{role}", **labels(role, cluster)},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints],
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports.items()],
    }


def headless_service(namespace: str, role: str, ports: dict[str, int]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{CLUSTER}-{role}", "namespace": namespace, "labels": labels(role)},
        "spec": {"clusterIP": "None", "ports": [{"name": n, "port": p} for n, p in ports.items()]},
    }


async def test_router_follows_endpoint_slices(
    kube: Kube, namespace: str, wait_until: WaitUntil, local_cluster: Any, netns: tuple[str, list[str]]
) -> None:
    ns_name, (prefill_ip, decode_ip, decode2_ip) = netns
    with (
        sim_in(ns_name, prefill_ip, PRODUCER) as (p_port, p_bootstrap),
        sim_in(ns_name, decode_ip, CONSUMER) as (d_port, _),
        sim_in(ns_name, decode2_ip, CONSUMER) as (d2_port, _),
    ):
        prefill_ports = {"http": p_port, "bootstrap": p_bootstrap}
        await kube.create(headless_service(namespace, "prefill", prefill_ports))
        await kube.create(headless_service(namespace, "decode", {"http": d_port}))
        prefill_url, decode_url = f"http://{prefill_ip}:{p_port}", f"http://{decode_ip}:{d_port}"
        decode2_url = f"http://{decode2_ip}:{d2_port}"
        async with (
            aiohttp.ClientSession() as http,
            router(namespace, local_cluster.kubeconfig) as (service, url),
        ):
            for engine in (prefill_url, decode_url, decode2_url):
                await wait_until(lambda engine=engine: healthy(http, engine), message=f"{engine} healthy")
            pool = service.pool
            assert pool is not None and await ready_status(http, url) == 503

            def decodes() -> set[str]:
                return {u.url for u in pool.decode}

            await kube.create(
                endpoint_slice(namespace, "p-1", "prefill", [(prefill_ip, True)], prefill_ports)
            )
            await kube.create(
                endpoint_slice(
                    namespace, "d-1", "decode", [(decode_ip, True), (decode2_ip, False)], {"http": d_port}
                )
            )
            # Another cluster's slice in the same namespace is not ours.
            await kube.create(
                endpoint_slice(
                    namespace, "x-1", "decode", [(decode2_ip, True)], {"http": d2_port}, cluster="other"
                )
            )
            await follows(wait_until, lambda: [u.url for u in pool.prefill] == [prefill_url], "prefill added")
            await follows(wait_until, lambda: decodes() == {decode_url}, "ready decode added")
            assert await ready_status(http, url) == 200
            assert await complete(http, url) == 3

            # A second decode (its own port, so its own slice) turns up ready.
            await kube.create(
                endpoint_slice(namespace, "d-2", "decode", [(decode2_ip, True)], {"http": d2_port})
            )
            await follows(wait_until, lambda: decodes() == {decode_url, decode2_url}, "second decode added")
            # The first turns not ready, then the prefill's slice goes away.
            await kube.merge_patch(
                "discovery.k8s.io/v1", "EndpointSlice", "d-1", namespace,
                {"endpoints": [{"addresses": [decode_ip], "conditions": {"ready": False}}]},
            )  # fmt: skip
            await follows(wait_until, lambda: decodes() == {decode2_url}, "not-ready decode removed")
            assert await complete(http, url) == 3
            await kube.delete("discovery.k8s.io/v1", "EndpointSlice", "p-1", namespace)
            await follows(wait_until, lambda: not pool.prefill, "prefill removed")
            assert await ready_status(http, url) == 503


# ------------------------------------------------------------------------ Pods
def unmanaged_pod(namespace: str, name: str, role: str, ports: dict[str, int]) -> dict[str, Any]:
    """A pod bound to a node that does not exist, so no kubelet (kwok, the pod runner)
    touches it and the test writes its status."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(role)},
        "spec": {
            "nodeName": "no-such-node",
            "containers": [
                {"name": "engine", "image": "pdcluster/engine-sim",
                 "ports": [{"name": n, "containerPort": p} for n, p in ports.items()]}
            ],
        },
    }  # fmt: skip


async def set_ready(kube: Kube, namespace: str, name: str, ip: str, ready: bool) -> None:
    status = {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    await kube.merge_patch("v1", "Pod", name, namespace, {"status": status}, subresource="status")


async def test_router_follows_pods(
    kube: Kube, namespace: str, wait_until: WaitUntil, local_cluster: Any
) -> None:
    # Addresses outside the pod ranges the local cluster hands out.
    async with (
        simulator(
            "--sim-profile", "zero", "--kv-transfer-config", PRODUCER, model="m", host="127.1.254.1"
        ) as p,
        simulator(
            "--sim-profile", "zero", "--kv-transfer-config", CONSUMER, model="m", host="127.1.254.2"
        ) as d,
        aiohttp.ClientSession() as http,
        router(namespace, local_cluster.kubeconfig, "--discovery", "pods") as (service, url),
    ):
        pool = service.pool
        assert pool is not None
        await kube.create(
            unmanaged_pod(
                namespace, "p-0", "prefill", {"http": p.config.port, "bootstrap": p.config.bootstrap_port}
            )
        )
        await kube.create(unmanaged_pod(namespace, "d-0", "decode", {"http": d.config.port}))
        # The watch delivers events in order: once the router has seen a pod created after
        # the engines, it has seen the engines too.
        await kube.create(unmanaged_pod(namespace, "r-0", "router", {}))
        await follows(wait_until, lambda: "r-0" in pool.routers, "a later pod seen")
        assert not pool.prefill and not pool.decode, "pods that are not Ready do not count"
        await set_ready(kube, namespace, "p-0", "127.1.254.1", True)
        await set_ready(kube, namespace, "d-0", "127.1.254.2", True)
        await follows(wait_until, lambda: pool.ready, "ready pods added")
        assert await complete(http, url) == 3
        await set_ready(kube, namespace, "d-0", "127.1.254.2", False)
        await follows(wait_until, lambda: not pool.decode, "unready pod removed")
        assert await ready_status(http, url) == 503
