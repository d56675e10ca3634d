"""A role spanning nodes in the local cluster: the LeaderWorkerSet controller (built from
its Go module, webhooks included) runs each prefill replica as a group of two engine
simulator pods in vLLM's multi-node mode. The leader serves once its worker joined, the
router sends to leaders only, the operator counts groups, and a group whose worker dies
is recreated whole."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from harness import StreamLoad, converged

from pdcluster import constants as C
from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster

GROUP = {"replicas": 1, "minReplicas": 1, "maxReplicas": 2, "tensorParallelSize": 4, "gpusPerNode": 2}


async def prefill_pods(kube: Kube, namespace: str) -> dict[str, dict[str, Any]]:
    selector = f"{C.LABEL_CLUSTER}=mn,{C.LABEL_ROLE}={C.ROLE_PREFILL}"
    pods = await kube.list("v1", "Pod", namespace, label_selector=selector)
    return {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}


def ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def running(pod: dict[str, Any]) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return bool(statuses) and all("running" in (s.get("state") or {}) for s in statuses)


async def test_a_role_spanning_nodes_runs_as_leaderworkerset_groups(
    kube: Kube, namespace: str, operator: Any, pdc: Any, sim_cluster: Any, wait_until: Any
) -> None:
    doc = sim_cluster("mn", prefill=GROUP, decode={"replicas": 1, "tensorParallelSize": 2})
    await pdc.apply(doc)
    await wait_until(lambda: converged(kube, pdc, "mn"), timeout=180, message="multi-node PDCluster Ready")
    lws = await kube.get(C.LWS_API_VERSION, "LeaderWorkerSet", "mn-prefill", namespace)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    # The leaders' StatefulSet is the LeaderWorkerSet's, not the operator's.
    leaders = await kube.get("apps/v1", "StatefulSet", "mn-prefill", namespace)
    assert [r["kind"] for r in leaders["metadata"]["ownerReferences"]] == ["LeaderWorkerSet"]

    pods = await prefill_pods(kube, namespace)
    assert sorted(pods) == ["mn-prefill-0", "mn-prefill-0-1"]
    leader, worker = pods["mn-prefill-0"], pods["mn-prefill-0-1"]
    assert leader["metadata"]["labels"][C.LABEL_LWS_WORKER_INDEX] == "0"
    assert worker["metadata"]["labels"][C.LABEL_LWS_WORKER_INDEX] == "1"
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert (
        env["LWS_LEADER_ADDRESS"] == f"mn-prefill-0.mn-prefill.{namespace}" and env["LWS_WORKER_INDEX"] == "1"
    )
    assert "--headless" in worker["spec"]["containers"][0]["args"]
    # The simulated leader serves only once every node of its group joined (enginesim/nodes.py).
    assert ready(leader) and running(worker)
    status = (await pdc.get("mn"))["status"]
    assert (status["prefill"]["ready"], status["prefill"]["gpus"]) == (1, 4)

    svc = await kube.get("v1", "Service", "mn-router", namespace)
    url = f"http://{svc['spec']['clusterIP']}:8000"
    async with StreamLoad(url, 2, 8) as load:
        await wait_until(
            lambda: len(load.outcomes) >= 10, timeout=60, message="10 requests through the router"
        )
        outcomes = await load.stop()
    assert outcomes and all(o.ok for o in outcomes), [o for o in outcomes if not o.ok][:5]

    # Two groups: the operator scales the LeaderWorkerSet and counts groups, not pods.
    await pdc.apply(
        sim_cluster("mn", prefill={**GROUP, "replicas": 2}, decode={"replicas": 1, "tensorParallelSize": 2})
    )
    await wait_until(lambda: converged(kube, pdc, "mn"), timeout=180, message="two prefill groups Ready")
    assert sorted(await prefill_pods(kube, namespace)) == [
        "mn-prefill-0", "mn-prefill-0-1", "mn-prefill-1", "mn-prefill-1-1",
    ]  # fmt: skip
    assert (await pdc.get("mn"))["status"]["prefill"]["ready"] == 2

    # A worker that dies takes its group down: the whole group is recreated and serves again.
    before = (await prefill_pods(kube, namespace))["mn-prefill-1"]["metadata"]["uid"]
    await kube.delete("v1", "Pod", "mn-prefill-1-1", namespace)

    async def recreated() -> bool:
        pods = await prefill_pods(kube, namespace)
        leader = pods.get("mn-prefill-1")
        return bool(leader and leader["metadata"]["uid"] != before and ready(leader))

    await wait_until(recreated, timeout=120, message="group 1 recreated with a new leader")
    await wait_until(lambda: converged(kube, pdc, "mn"), timeout=120, message="Ready again")
    async with aiohttp.ClientSession() as http:
        body = {"model": "llama-3.1-8b", "prompt": "after the restart", "max_tokens": 4}
        async with http.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
