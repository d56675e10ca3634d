"""Colocated mode in the local cluster with the operator, the router and engine
simulators as real pods: one pool serves every request whole through the router, and
switching the same PDCluster to disaggregated (and back) replaces the pools without a
failed request once each is Ready."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from harness import OperatorProcess, StreamLoad, converged

from pdcluster import constants as C
from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster


async def pods_of(kube: Kube, namespace: str, name: str, role: str) -> list[dict[str, Any]]:
    selector = f"{C.LABEL_CLUSTER}={name},{C.LABEL_ROLE}={role}"
    return await kube.list("v1", "Pod", namespace, label_selector=selector)


async def served(http: aiohttp.ClientSession, pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The client requests this engine received (the simulator's --sim-record)."""
    async with http.get(f"http://{pod['status']['podIP']}:8000/sim/requests") as r:
        return [rec for rec in await r.json() if rec["headers"].get("X-Request-Id", "").startswith("load-")]


async def test_a_colocated_pool_serves_through_the_router_and_modes_switch(
    kube: Kube, namespace: str, operator: OperatorProcess, pdc: Any, sim_cluster: Any, wait_until: Any
) -> None:
    doc = sim_cluster("colo", mode="colocated", colocated={"replicas": 2})
    doc["spec"]["engine"]["args"] = [*doc["spec"]["engine"]["args"], "--sim-record=10000"]
    await pdc.apply(doc)
    await wait_until(lambda: converged(kube, pdc, "colo"), timeout=180, message="colocated Ready")
    status = (await pdc.get("colo"))["status"]
    assert status["colocated"]["ready"] == 2 and "ratio" not in status
    assert await kube.get("apps/v1", "StatefulSet", "colo-prefill", namespace) is None

    svc = await kube.get("v1", "Service", "colo-router", namespace)
    url = f"http://{svc['spec']['clusterIP']}:8000"
    async with StreamLoad(url, 4, 20) as load, aiohttp.ClientSession() as http:
        engines = await pods_of(kube, namespace, "colo", C.ROLE_COLOCATED)

        async def both_serve() -> bool:
            return all([await served(http, pod) for pod in engines])

        await wait_until(both_serve, timeout=60, message="both colocated engines serve")
        records = [r for pod in engines for r in await served(http, pod)]
        outcomes = await load.stop()
    assert outcomes and all(o.ok for o in outcomes), [o for o in outcomes if not o.ok][:5]
    assert all("kv_transfer_params" not in r["body"] for r in records), "whole requests, no hand-off"

    # Disaggregated: the colocated pool goes (the operator prunes it), prefill and decode come.
    await pdc.apply(sim_cluster("colo", mode="disaggregated"))
    await wait_until(lambda: converged(kube, pdc, "colo"), timeout=180, message="disaggregated Ready")
    assert await kube.get("apps/v1", "StatefulSet", "colo-colocated", namespace) is None
    assert (await pdc.get("colo"))["status"]["ratio"] == "1:1"
    assert f"Deleted {namespace}/colo-colocated StatefulSet" in operator.log()

    async def completed(load: StreamLoad) -> bool:
        return sum(o.ok for o in load.outcomes) >= 5

    async with StreamLoad(url, 2, 20) as load:
        await wait_until(lambda: completed(load), timeout=60, message="PD requests complete")
        outcomes = await load.stop()
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok][:5]
