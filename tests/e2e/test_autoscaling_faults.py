"""The autoscaler under faults, with the real operator, Prometheus scraping the router and
engine simulators, and the control law: Prometheus going away, and a scale-up that
cannot schedule because the nodes have no free GPUs."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any

import pytest
from harness import OperatorProcess, StreamLoad, condition

from localcluster import State, start_component, stop_component
from pdcluster import constants as C
from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster

BUDGET = 10  # GPUs; one per engine pod


def autoscaled(sim_cluster: Any, name: str) -> dict[str, Any]:
    """The demo spec, autoscaled quickly. The ITL target is below one decode step of the
    profile (~6 ms), so under any traffic decode is short of engines and scales up."""
    doc = sim_cluster(
        name,
        prefill={"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
        decode={"replicas": 1, "minReplicas": 1, "maxReplicas": 8},
    )
    doc["spec"]["autoscaling"] = {
        "enabled": True,
        "mode": "auto",
        "slo": {"ttftMs": 60000, "itlMs": 3, "quantile": "p90"},
        "gpuBudget": BUDGET,
        "intervalSeconds": 5,
        "windowSeconds": 15,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 600,
        "cooldownSeconds": 0,
        "maxStep": 2,
        "scaleUpTimeoutSeconds": 30,
    }
    return doc


async def replicas(kube: Kube, namespace: str, name: str) -> tuple[int, int]:
    """(prefill, decode) replicas of the StatefulSets, as the operator wrote them."""
    out = []
    for role in C.ENGINE_ROLES:
        sts = await kube.get("apps/v1", "StatefulSet", f"{name}-{role}", namespace)
        out.append(sts["spec"]["replicas"] if sts else 0)
    return out[0], out[1]


async def router_url(kube: Kube, namespace: str, name: str) -> str:
    svc = await kube.get("v1", "Service", f"{name}-router", namespace)
    return f"http://{svc['spec']['clusterIP']}:8000"


# ------------------------------------------------------------------ 3. Prometheus down
async def test_prometheus_outage_holds_then_recovers(
    kube: Kube,
    namespace: str,
    local_cluster: State,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
) -> None:
    await pdc.apply(autoscaled(sim_cluster, "blind"))

    async def autoscaling(status: str, reason: str | None = None) -> dict[str, Any] | None:
        c = condition(await pdc.get("blind"), "Autoscaling")
        return c if c and c["status"] == status and reason in (None, c["reason"]) else None

    await wait_until(lambda: pdc.is_true("blind", "Ready"), timeout=180, message="Ready")
    await wait_until(lambda: autoscaling("True"), timeout=60, message="the control law runs on metrics")
    assert await replicas(kube, namespace, "blind") == (1, 1)

    await asyncio.to_thread(stop_component, local_cluster.name, "prometheus")
    try:
        async with StreamLoad(await router_url(kube, namespace, "blind"), 4, 50) as load:
            held = await wait_until(
                lambda: autoscaling("False", "MetricsUnavailable"), timeout=60, message="condition says why"
            )
            # Several runs of the control law under traffic that would scale decode up: all
            # of them hold, and the replicas stay.
            holds, scales = await operator.decisions("blind", "hold"), await operator.decisions("blind", "scale")

            async def held_several_times() -> bool:
                return await operator.decisions("blind", "hold") >= holds + 4

            await wait_until(held_several_times, timeout=120, interval=1, message="four holds")
            assert await operator.decisions("blind", "scale") == scales
            assert await replicas(kube, namespace, "blind") == (1, 1)
            decision = (await pdc.get("blind"))["status"]["autoscaling"]["lastDecision"]
            assert decision["action"] == "hold" and "metrics unavailable" in decision["reason"], decision
    finally:
        await asyncio.to_thread(start_component, local_cluster.name, "prometheus")
    assert not load.failures(), load.failures()[:3]

    async with StreamLoad(await router_url(kube, namespace, "blind"), 4, 50) as load:
        await wait_until(lambda: autoscaling("True"), timeout=90, message="metrics again")

        async def scaled_up() -> bool:
            return (await replicas(kube, namespace, "blind"))[1] > 1

        await wait_until(scaled_up, timeout=90, message="decode scales up once Prometheus is back")
    assert not load.failures(), load.failures()[:3]
    print("while Prometheus was down:", held["message"])
    print("decision:", decision["reason"])
    assert operator.failures() == []


# ------------------------------------------------------------------ 7. a scale-up that cannot schedule
def gpu_hog(name: str, namespace: str, gpus: int) -> dict[str, Any]:
    """A pod that holds GPUs on a node (its image cannot run here, but the scheduler has
    bound it, so its GPUs are taken)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "containers": [
                {
                    "name": "hog",
                    "image": "vllm/vllm-openai:v0.32.0",
                    "resources": {"limits": {"nvidia.com/gpu": gpus}},
                }
            ],
            "terminationGracePeriodSeconds": 0,
        },
    }


async def test_unschedulable_scale_up_times_out_within_budget(
    kube: Kube,
    namespace: str,
    local_cluster: State,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
) -> None:
    nodes = local_cluster.nodes
    total = nodes["gpu_nodes"] * nodes["gpus_per_node"]
    # Leave 4 GPUs free: one prefill and three decode engines fit, a fourth decode does not.
    hogs = []
    left = total - 4
    while left > 0:
        gpus = min(left, nodes["gpus_per_node"])
        hogs.append(await kube.create(gpu_hog(f"hog-{len(hogs)}", namespace, gpus)))
        left -= gpus

    async def hogs_bound() -> bool:
        pods = [await kube.get("v1", "Pod", h["metadata"]["name"], namespace) for h in hogs]
        return all(p["spec"].get("nodeName") for p in pods)

    await wait_until(hogs_bound, timeout=60, message="GPU hogs scheduled")

    seen: list[tuple[int, int]] = []

    async def watch_budget() -> None:
        while True:
            seen.append(await replicas(kube, namespace, "stuck"))
            await asyncio.sleep(0.5)

    await pdc.apply(autoscaled(sim_cluster, "stuck"))
    sampler = asyncio.create_task(watch_budget())
    try:
        await wait_until(lambda: pdc.is_true("stuck", "Ready"), timeout=180, message="Ready")
        async with StreamLoad(await router_url(kube, namespace, "stuck"), 4, 50) as load:

            async def beyond_free_gpus() -> bool:
                body = await pdc.get("stuck")
                return body["status"]["decode"]["desired"] > 4 - body["status"]["prefill"]["desired"]

            await wait_until(beyond_free_gpus, timeout=120, message="decode scaled beyond the free GPUs")
            stuck_at = time.monotonic()

            async def fell_back() -> dict[str, Any]:
                body = await pdc.get("stuck")
                state = body["status"].get("autoscaling") or {}
                assert "decode" in (state.get("blockedUntil") or {}), state.get("lastDecision")
                return body

            body = await wait_until(fell_back, timeout=90, message="fallback to the pods that run")
            noticed_after = time.monotonic() - stuck_at
            reason = body["status"]["autoscaling"]["lastDecision"]["reason"]
            assert "not ready after" in reason and "unschedulable" in reason, reason
            # It fell back for its scale-up timeout (30 s), once that had passed by its own
            # clock; how soon after is the operator's pacing, not checked here.
            waited = re.search(r"not ready after (\d+) s", reason)
            assert waited and int(waited[1]) >= 30 and "scale-up for 30 s" in reason, reason
            # ... and fell back to the decode pods that run.
            assert body["status"]["decode"]["desired"] == body["status"]["decode"]["ready"] < 4

            # The timeout does not wedge the autoscaler: once GPUs are free and the block
            # is over, it scales decode up again and the new pods run.
            for h in hogs:
                await kube.delete("v1", "Pod", h["metadata"]["name"], namespace, grace_period=0)

            async def grew() -> bool:
                body = await pdc.get("stuck")
                return body["status"]["decode"]["ready"] >= 5

            await wait_until(grew, timeout=180, message="decode grows once GPUs are free")
        assert not load.failures(), load.failures()[:3]
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    over = [s for s in seen if s[0] + s[1] > BUDGET]
    assert not over, f"GPU budget {BUDGET} exceeded: {over[:5]}"
    print(f"fell back {noticed_after:.0f} s after scaling beyond the free GPUs: {reason}")
    print("replica counts seen:", sorted(set(seen)))
    assert operator.failures() == []
