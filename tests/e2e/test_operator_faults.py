"""The operator under faults, against the local control plane: killed mid-reconcile, the
apiserver restarted under it, and someone else editing its children. Each scenario ends
with the children exactly as rendered (nothing lost, duplicated or orphaned)."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import OperatorProcess, converged, start_operator

from localcluster import State, restart
from pdcluster import constants as C
from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster


async def completion(ip: str, prompt: str = "hello") -> int:
    body = {"prompt": prompt, "max_tokens": 4}
    async with aiohttp.ClientSession() as http, http.post(f"http://{ip}:8000/v1/completions", json=body) as r:
        await r.read()
        return r.status


# ------------------------------------------------------------------ 1. SIGKILL mid-reconcile
def _variant(rng: random.Random, sim_cluster: Any, suspend: bool) -> dict[str, Any]:
    """The demo spec with a random choice in fields that touch most children (both
    StatefulSets, the Mooncake ConfigMap, Deployment and Service, the router)."""
    doc = sim_cluster("churn")
    doc["spec"]["suspend"] = suspend
    doc["spec"]["prefill"]["replicas"] = rng.choice([1, 2])
    doc["spec"]["engine"]["args"] = [*doc["spec"]["engine"]["args"], f"--sim-seed={rng.randrange(1000)}"]
    doc["spec"]["mooncake"]["rpcPort"] = rng.choice([50051, 50052])
    doc["spec"]["router"]["requestTimeoutSeconds"] = rng.choice([300, 600])
    return doc


async def _kill_at_random_point(op: OperatorProcess, namespace: str, rng: random.Random) -> str:
    """SIGKILL after the k-th child write of this run (k random), or after a random delay."""
    applied = re.compile(rf" (Created|Updated) {re.escape(namespace)}/")
    start = len(op.log())
    if rng.random() < 0.7:
        k = rng.randint(1, 8)
        writes, last_change, deadline = 0, time.monotonic(), time.monotonic() + 30  # slow starts
        while writes < k and op.proc.poll() is None and time.monotonic() < deadline:
            # Fewer writes to do than k: kill once the reconcile has gone quiet.
            if writes and time.monotonic() - last_change > 2.0:
                break
            await asyncio.sleep(0.05)
            now = len(applied.findall(op.log()[start:]))
            if now != writes:
                writes, last_change = now, time.monotonic()
        await asyncio.sleep(rng.uniform(0, 0.05))
        point = f"after write {k}"
    else:
        delay = rng.uniform(0.5, 4.0)
        await asyncio.sleep(delay)
        point = f"after {delay:.1f}s"
    op.kill(signal.SIGKILL)
    return f"{point} ({len(applied.findall(op.log()[start:]))} writes done)"


async def test_sigkill_mid_reconcile_converges(
    kube: Kube,
    namespace: str,
    local_cluster: State,
    crd: None,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    log = tmp_path / "operator.log"
    extra = f"--prometheus-url={local_cluster.prometheus_url}"
    deletable = [
        ("apps/v1", "StatefulSet", "decode"),
        ("v1", "Service", "router"),
        ("v1", "ConfigMap", "mooncake"),
        ("apps/v1", "Deployment", "mooncake-master"),
    ]
    points = []
    # Suspended while the operator is being killed: every child is written, no pods churn.
    for _ in range(20):
        await pdc.apply(_variant(rng, sim_cluster, suspend=True))
        # Someone deleted a few children meanwhile: they must come back exactly once.
        for api_version, kind, suffix in rng.sample(deletable, rng.randint(0, 2)):
            await kube.delete(api_version, kind, f"churn-{suffix}", namespace)
        op = start_operator(local_cluster.kubeconfig, namespace, log, extra)
        points.append(await _kill_at_random_point(op, namespace, rng))
    print("killed", *points, sep="\n  ")

    final = _variant(rng, sim_cluster, suspend=False)
    await pdc.apply(final)
    op = start_operator(local_cluster.kubeconfig, namespace, log, extra)
    try:
        await wait_until(lambda: converged(kube, pdc, "churn"), timeout=180, message="converged after kills")
        body = await pdc.get("churn")
        assert body["status"]["prefill"]["ready"] == final["spec"]["prefill"]["replicas"]
        router = await kube.get("v1", "Service", "churn-router", namespace)
        assert await completion(router["spec"]["clusterIP"]) == 200
        assert op.failures() == []
    finally:
        op.kill(signal.SIGTERM)


# ------------------------------------------------------------------ 2. apiserver restart
async def test_apiserver_restart(
    kube: Kube,
    namespace: str,
    local_cluster: State,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
) -> None:
    await pdc.apply(sim_cluster("steady"))
    await wait_until(lambda: converged(kube, pdc, "steady"), timeout=180, message="Ready before the restart")

    await asyncio.to_thread(restart, local_cluster.name, "kube-apiserver")

    # The watches reconnected: a spec change is seen (the worker reconciles only what
    # the PDCluster watch delivered) and a child's drift is repaired (child watch).
    await pdc.apply(sim_cluster("steady", prefill={"replicas": 2, "minReplicas": 1, "maxReplicas": 6}))
    await kube.merge_patch("apps/v1", "StatefulSet", "steady-decode", namespace, {"spec": {"replicas": 2}})

    async def scaled() -> bool:
        body = await pdc.get("steady")
        return await converged(kube, pdc, "steady") and body["status"]["prefill"]["ready"] == 2

    await wait_until(scaled, timeout=180, message="converged with 2 prefill pods after the restart")
    assert operator.proc.poll() is None
    router = await kube.get("v1", "Service", "steady-router", namespace)
    assert await completion(router["spec"]["clusterIP"]) == 200
    # The router's own pod watch reconnected too: it routes to both prefill pods.
    pods = await kube.list(
        "v1", "Pod", namespace, label_selector=f"{C.LABEL_CLUSTER}=steady,{C.LABEL_ROLE}=router"
    )
    async with aiohttp.ClientSession() as http:

        async def both_prefills() -> bool:
            async with http.get(f"http://{pods[0]['status']['podIP']}:8000/backends") as r:
                return len((await r.json())["prefill_instances"]) == 2

        await wait_until(both_prefills, timeout=30, message="router sees both prefill pods")


# ------------------------------------------------------------------ 8. drift, no write storm
async def test_foreign_edits_are_reverted_without_a_write_storm(
    kube: Kube,
    namespace: str,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
) -> None:
    await pdc.apply(sim_cluster("drift"))
    await wait_until(lambda: converged(kube, pdc, "drift"), timeout=180, message="Ready")
    sts = "drift-decode"

    def operator_writes() -> int:
        return len(re.findall(rf"Updated {re.escape(namespace)}/{sts} StatefulSet", operator.log()))

    before = operator_writes()
    # Another controller (an HPA, a person with kubectl) keeps setting replicas and a
    # template field the operator owns, five times a second apart.
    intruder_writes = 0
    for i in range(5):
        patch = {
            "spec": {
                "replicas": 3,
                "template": {"metadata": {"annotations": {"prometheus.io/port": str(9000 + i)}}},
            }
        }
        await kube.merge_patch("apps/v1", "StatefulSet", sts, namespace, patch)
        intruder_writes += 1
        await asyncio.sleep(1.0)

    await wait_until(lambda: converged(kube, pdc, "drift"), timeout=180, message="edits reverted")
    fixes = operator_writes() - before
    # Each foreign write costs at most one write back; nothing amplifies it.
    assert 1 <= fixes <= intruder_writes, fixes

    # At rest again: no write to the StatefulSet or the PDCluster over several resyncs.
    versions = [
        (await kube.get("apps/v1", "StatefulSet", sts, namespace))["metadata"]["resourceVersion"],
        (await pdc.get("drift"))["metadata"]["resourceVersion"],
    ]
    # Three of the operator's reconciles (its resyncs come every 5 s), counted, not timed.
    start = await operator.reconciles()

    async def three_reconciles() -> bool:
        return await operator.reconciles() >= start + 3

    await wait_until(three_reconciles, timeout=60, interval=0.5, message="three reconciles at rest")
    assert [
        (await kube.get("apps/v1", "StatefulSet", sts, namespace))["metadata"]["resourceVersion"],
        (await pdc.get("drift"))["metadata"]["resourceVersion"],
    ] == versions
    assert operator_writes() - before == fixes
    assert operator.failures() == []
    print(f"{intruder_writes} foreign writes, {fixes} written back, none over three reconciles at rest")
