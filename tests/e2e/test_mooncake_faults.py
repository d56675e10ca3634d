"""The Mooncake master restarted under a running PDCluster: the engine simulators pass
their KV bytes through a real Mooncake store (`--sim-mooncake-master`), so they are
clients of the master as vLLM's Mooncake store connector is."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import OperatorProcess, condition, converged
from prometheus_client.parser import text_string_to_metric_families

from pdcluster import constants as C
from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster


async def master_metrics(
    http: aiohttp.ClientSession, kube: Kube, namespace: str, name: str
) -> dict[str, float]:
    """The metrics of the ready master pod ({} while there is none)."""
    pods = await kube.list(
        "v1",
        "Pod",
        namespace,
        label_selector=f"{C.LABEL_CLUSTER}={name},{C.LABEL_ROLE}={C.ROLE_MOONCAKE_MASTER}",
    )
    for pod in pods:
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])
        )
        if ready and not pod["metadata"].get("deletionTimestamp"):
            async with http.get(f"http://{pod['status']['podIP']}:9003/metrics") as r:
                text = await r.text()
            return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return {}


async def test_mooncake_master_restart(
    kube: Kube,
    namespace: str,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
) -> None:
    doc = sim_cluster("kv")
    doc["spec"]["engine"]["args"] = [
        *doc["spec"]["engine"]["args"],
        f"--sim-mooncake-master=kv-{C.ROLE_MOONCAKE_MASTER}:50051",  # the master's Service
    ]
    await pdc.apply(doc)

    await wait_until(lambda: converged(kube, pdc, "kv"), timeout=180, message="Ready")
    svc = await kube.get("v1", "Service", "kv-router", namespace)
    url = f"http://{svc['spec']['clusterIP']}:8000/v1/completions"

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def complete(n: int) -> list[int]:
            async def one(i: int) -> int:
                async with http.post(url, json={"prompt": f"story {i} " * 200, "max_tokens": 4}) as r:
                    await r.read()
                    return r.status

            return await asyncio.gather(*(one(i) for i in range(n)))

        async def stored_by_master(at_least: float) -> dict[str, float]:
            m = await master_metrics(http, kube, namespace, "kv")
            both_mounted = m.get("master_total_capacity_bytes", 0) >= 2 * 64 * 2**20
            return m if both_mounted and m.get("master_put_end_requests_total", 0) >= at_least else {}

        async def both_mounted() -> bool:
            m = await master_metrics(http, kube, namespace, "kv")
            return m.get("master_total_capacity_bytes", 0) >= 2 * 64 * 2**20

        # Engines start beside the master and connect once it answers: a request served
        # before that passes no KV through it.
        await wait_until(both_mounted, timeout=60, message="both engines mounted their segments")
        assert await complete(5) == [200] * 5
        await wait_until(lambda: stored_by_master(5), timeout=30, message="KV passed through the master")

        # Watch what the PDCluster reports while the master is away.
        seen: list[tuple[str, str]] = []

        async def record() -> None:
            async for event, obj in kube.watch(C.API_VERSION, C.KIND, namespace):
                for item in obj["items"] if event == "SYNC" else [obj]:
                    c = condition(item, "Ready")
                    if c and (c["status"], c["message"]) not in seen[-1:]:
                        seen.append((c["status"], c["message"]))

        watcher = asyncio.create_task(record())
        old = await master_metrics(http, kube, namespace, "kv")
        masters = await kube.list(
            "v1", "Pod", namespace, label_selector=f"{C.LABEL_ROLE}={C.ROLE_MOONCAKE_MASTER}"
        )
        await kube.delete("v1", "Pod", masters[0]["metadata"]["name"], namespace)
        # Serving does not depend on the master: requests during the restart complete.
        during = await complete(5)

        # A fresh master (its counters start at zero) to which both engines re-mounted
        # their segments and through which new KV passes.
        async def fresh() -> bool:
            m = await master_metrics(http, kube, namespace, "kv")
            return (
                bool(m)
                and m.get("master_put_start_requests_total", 0) < old["master_put_start_requests_total"]
            )

        await wait_until(fresh, timeout=120, message="a new master pod is Ready")
        await wait_until(lambda: converged(kube, pdc, "kv"), timeout=120, message="Ready again")
        assert await complete(5) == [200] * 5
        new = await wait_until(
            lambda: stored_by_master(1), timeout=60, message="engines reconnected to the new master"
        )
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

    print("Ready condition during the restart:", *seen, sep="\n  ")
    print("new master:", {k: v for k, v in new.items() if "mount" in k or "capacity" in k or "put_end" in k})
    assert during == [200] * 5
    assert any(status == "False" and "mooncake master" in message for status, message in seen), seen
    assert seen[-1][0] == "True"
    assert operator.failures() == []


@contextlib.contextmanager
def etcd(bin_dir: str, data: Path) -> Iterator[str]:
    """An etcd of its own on loopback for the masters to elect through; yields host:port."""
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [f"{bin_dir}/etcd", "--data-dir", str(data),
         "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{client}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def master_roles(http: aiohttp.ClientSession, kube: Kube, namespace: str, name: str) -> dict[str, str]:
    """Pod name -> role ("leader", "standby") of every running master pod that answers."""
    pods = await kube.list(
        "v1",
        "Pod",
        namespace,
        label_selector=f"{C.LABEL_CLUSTER}={name},{C.LABEL_ROLE}={C.ROLE_MOONCAKE_MASTER}",
    )
    roles = {}
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if not ip or pod["metadata"].get("deletionTimestamp"):
            continue
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with http.get(f"http://{ip}:9003/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                roles[pod["metadata"]["name"]] = (await r.json(content_type=None))["role"]
    return roles


async def test_a_standby_master_takes_over(
    kube: Kube,
    namespace: str,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
    local_cluster: Any,
    tmp_path: Path,
) -> None:
    """Two masters elect a leader through etcd; engines (simulators running the store
    connector) and the router find it. The leader's pod is deleted: the standby leads,
    requests keep completing, the PDCluster stays Ready, and prompts are served from the
    store again once written anew (a failover keeps no contents)."""
    with etcd(local_cluster.bin_dir, tmp_path / "etcd") as endpoint:
        mooncake = {
            "image": C.DEFAULT_MOONCAKE_IMAGE,
            "store": {"enabled": True, "engineSegmentSize": "64Mi", "engineBufferSize": "16Mi"},
            "highAvailability": {"enabled": True, "replicas": 2, "etcdEndpoints": [endpoint]},
        }
        await pdc.apply(sim_cluster("ha", mooncake=mooncake))

        await wait_until(lambda: converged(kube, pdc, "ha"), timeout=180, message="Ready")
        svc = await kube.get("v1", "Service", "ha-router", namespace)
        base = f"http://{svc['spec']['clusterIP']}:8000"
        system = "You answer questions about the storage fleet. " * 200  # about 2,300 tokens

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

            async def complete(question: str) -> int:
                body = {"prompt": system + question, "max_tokens": 4, "ignore_eos": True}
                async with http.post(f"{base}/v1/completions", json=body) as r:
                    await r.read()
                    return r.status

            async def hits() -> float:
                async with http.get(f"{base}/metrics") as r:
                    text = await r.text()
                return sum(
                    s.value
                    for f in text_string_to_metric_families(text)
                    for s in f.samples
                    if s.name == "pdcluster_router_store_lookups_total" and s.labels.get("outcome") == "hit"
                )

            async def served_from_store(before: float) -> bool:
                """A repeat of the system prompt is a hit (the blocks are written just after the
                first answer, so the first repeats may still miss)."""
                assert await complete("And once more?") == 200
                return await hits() > before

            roles = await wait_until(
                lambda: _one_leader(http, kube, namespace), timeout=60, message="one leader, one standby"
            )
            assert await complete("What is stored?") == 200
            await wait_until(
                lambda: served_from_store(0), timeout=60, message="a hit through the first leader"
            )

            seen: list[str] = []

            async def record() -> None:
                async for event, obj in kube.watch(C.API_VERSION, C.KIND, namespace):
                    for item in obj["items"] if event == "SYNC" else [obj]:
                        c = condition(item, "Ready")
                        if c and item["metadata"]["name"] == "ha" and c["status"] not in seen[-1:]:
                            seen.append(c["status"])

            watcher = asyncio.create_task(record())
            leader = next(name for name, role in roles.items() if role == "leader")
            await kube.delete("v1", "Pod", leader, namespace)
            during = [await complete(f"During the failover, question {i}?") for i in range(5)]
            new_roles = await wait_until(
                lambda: _one_leader(http, kube, namespace, not_named=leader),
                timeout=120,
                message="the standby leads",
            )
            before = await hits()
            await wait_until(
                lambda: served_from_store(before), timeout=90, message="a hit through the new leader"
            )
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await kube.delete(C.API_VERSION, C.KIND, "ha", namespace)

    print("roles before:", roles, "after:", new_roles, "Ready during:", seen)
    assert during == [200] * 5
    assert "False" not in seen, seen  # the standby was Ready all along
    assert operator.failures() == []


async def _one_leader(
    http: aiohttp.ClientSession, kube: Kube, namespace: str, not_named: str = ""
) -> dict[str, str] | None:
    roles = await master_roles(http, kube, namespace, "ha")
    leaders = [name for name, role in roles.items() if role == "leader"]
    if len(leaders) == 1 and leaders[0] != not_named:
        return roles
    return None
