"""A StatefulSet pod deleted by force, and its successor of the same name: the pod runner
must run the successor once its predecessor's processes are gone (as a kubelet keys pods
by uid), with no request lost through the router. Force deletion is what an operator does
to the pods of a lost node."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from harness import OperatorProcess, StreamLoad, converged, is_ready

from pdcluster import constants as C
from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster

NAME = "succ"
REPLICAS = 2
SCHEDULING_SLACK_S = 30.0  # from the delete to the successor's first probe: controller, scheduler, runner


async def startup_budget(kube: Kube, namespace: str, role: str) -> float:
    """How long the engine's startup probe lets a pod take to start, plus scheduling."""
    sts = await kube.get("apps/v1", "StatefulSet", f"{NAME}-{role}", namespace)
    probe = next(c for c in sts["spec"]["template"]["spec"]["containers"] if "startupProbe" in c)["startupProbe"]
    probe_s = probe.get("initialDelaySeconds", 0) + probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10)
    return probe_s + SCHEDULING_SLACK_S


class ReadyDips:
    """The lowest ready count the PDCluster's status reported for each role while watched."""

    def __init__(self, kube: Kube, namespace: str):
        self.kube, self.namespace = kube, namespace
        self.lowest = {C.ROLE_PREFILL: REPLICAS, C.ROLE_DECODE: REPLICAS}
        self._task: asyncio.Task[None] | None = None

    async def _follow(self) -> None:
        async for kind, obj in self.kube.watch(C.API_VERSION, C.KIND, self.namespace):
            items = obj["items"] if kind == "SYNC" else [obj]
            for body in items:
                if body["metadata"]["name"] != NAME:
                    continue
                for role in self.lowest:
                    ready = ((body.get("status") or {}).get(role) or {}).get("ready", REPLICAS)
                    self.lowest[role] = min(self.lowest[role], ready)

    async def __aenter__(self) -> ReadyDips:
        self._task = asyncio.create_task(self._follow())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def test_successors_of_deleted_pods_run_and_no_request_is_lost(
    kube: Kube,
    namespace: str,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
) -> None:
    roles = {"replicas": REPLICAS, "minReplicas": 1, "maxReplicas": 4}
    await pdc.apply(sim_cluster(NAME, prefill=roles, decode=roles))
    await wait_until(lambda: converged(kube, pdc, NAME), timeout=180, message="Ready")
    budget = max([await startup_budget(kube, namespace, role) for role in (C.ROLE_PREFILL, C.ROLE_DECODE)])

    async def pod(name: str) -> dict[str, Any] | None:
        return await kube.get("v1", "Pod", name, namespace)

    async def uid(name: str) -> str:
        return (await pod(name))["metadata"]["uid"]

    async def delete(name: str, *, force: bool) -> str:
        """Deletes the pod and returns the uid it had."""
        old = await uid(name)
        await kube.delete("v1", "Pod", name, namespace, grace_period=0 if force else None, uid=old)
        return old

    async def successor_ready(name: str, old: str) -> dict[str, Any] | None:
        new = await pod(name)
        return new if new and new["metadata"]["uid"] != old and is_ready(new) else None

    svc = await kube.get("v1", "Service", f"{NAME}-router", namespace)
    router = f"http://{svc['spec']['clusterIP']}:8000"
    successors: list[dict[str, Any]] = []
    async with ReadyDips(kube, namespace) as dips, StreamLoad(router, 6, 40) as load:
        # A prefill and a decode pod together, by force, while requests stream.
        await wait_until(lambda: len(load.outcomes) >= 12, timeout=60, message="requests complete before")
        gone = {name: await delete(name, force=True) for name in (f"{NAME}-prefill-0", f"{NAME}-decode-0")}
        for name, old in gone.items():
            successors.append(await wait_until(lambda n=name, o=old: successor_ready(n, o), timeout=budget,
                                               message=f"{name}'s successor Ready"))
        await wait_until(lambda: min(dips.lowest.values()) < REPLICAS and all(
            v < REPLICAS for v in dips.lowest.values()), timeout=30, message="status showed both roles' dip")
        await wait_until(lambda: converged(kube, pdc, NAME), timeout=120, message="back to Ready")

        # A graceful delete.
        old = await delete(f"{NAME}-decode-1", force=False)
        successors.append(await wait_until(lambda: successor_ready(f"{NAME}-decode-1", old), timeout=budget + 60,
                                           message="decode-1's successor Ready"))

        # Two force deletes of one pod in a row: the second hits a successor still starting.
        first = await delete(f"{NAME}-prefill-1", force=True)

        async def recreated() -> str | None:
            new = await pod(f"{NAME}-prefill-1")
            return new["metadata"]["uid"] if new and new["metadata"]["uid"] != first else None

        second = await wait_until(recreated, timeout=60, message="prefill-1 recreated")
        await kube.delete("v1", "Pod", f"{NAME}-prefill-1", namespace, grace_period=0, uid=second)
        successors.append(await wait_until(lambda: successor_ready(f"{NAME}-prefill-1", second), timeout=budget,
                                           message="prefill-1's second successor Ready"))
        sent_after = len(load.outcomes)
        await wait_until(lambda: len(load.outcomes) >= sent_after + 12, timeout=60, message="requests complete after")
        outcomes = await load.stop()

    failures = load.failures()
    assert not failures, failures[:5]
    # A successor that started while its predecessor still held the port or its volumes
    # crash-looped; one that waited for it started once.
    for new in successors:
        current = await pod(new["metadata"]["name"])
        restarts = {s["name"]: s["restartCount"] for s in current["status"]["containerStatuses"]}
        assert all(count == 0 for count in restarts.values()), (new["metadata"]["name"], restarts)
    print(f"{len(outcomes)} streams, 0 failed; lowest ready in status: {dips.lowest}")
    await wait_until(lambda: converged(kube, pdc, NAME), timeout=120, message="converged")
    assert operator.failures() == []
