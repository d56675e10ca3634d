"""A router pod deleted under streaming load, as a node drain or a lost node does: the
default two routers sit on different nodes behind their Service and a budget of one,
and no new request fails. The client retries a connection error once (a connection
refused, or closed before any answer), as clients behind a Service do; a stream cut
after its answer began counts as failed."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
from harness import OperatorProcess, Outcome, converged, counter, is_ready, stream_completion

from pdcluster import constants as C
from pdcluster import observability as obs
from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster

NAME = "rha"
CONCURRENCY = 6
MAX_TOKENS = 40
# aiohttp's errors for a connection that gave no answer: refused, reset or closed before
# the response head. A failure while the body streams is a ClientPayloadError.
RETRYABLE = ("ClientConnectorError", "ServerDisconnectedError", "ClientOSError")


class RetryingLoad:
    """`CONCURRENCY` clients streaming back to back; a connection error is retried once."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.outcomes: list[Outcome] = []
        self.retried: list[str] = []
        self._stop = asyncio.Event()
        self._seq = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def _client(self, http: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            self._seq += 1
            request_id = f"ha-{self._seq}"
            outcome = await stream_completion(http, self.url, request_id, MAX_TOKENS)
            if outcome.status == 0 and outcome.error.startswith(RETRYABLE):
                self.retried.append(outcome.error)
                outcome = await stream_completion(http, self.url, request_id + "-retry", MAX_TOKENS)
            self.outcomes.append(outcome)

    @contextlib.asynccontextmanager
    async def running(self) -> Any:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            self._tasks = [asyncio.create_task(self._client(http)) for _ in range(CONCURRENCY)]
            try:
                yield self
            finally:
                self._stop.set()
                await asyncio.gather(*self._tasks)


async def router_pods(kube: Kube, namespace: str) -> list[dict[str, Any]]:
    pods = await kube.list(
        "v1", "Pod", namespace, label_selector=f"{C.LABEL_CLUSTER}={NAME},{C.LABEL_ROLE}={C.ROLE_ROUTER}"
    )
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


async def requests_served(pod: dict[str, Any]) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"http://{pod['status']['podIP']}:8000/metrics") as r:
        return counter(await r.text(), obs.ROUTER_REQUESTS + "_total")


async def test_a_router_pod_deleted_under_load_fails_no_request(
    kube: Kube, namespace: str, operator: OperatorProcess, pdc: Any, sim_cluster: Any, wait_until: Any
) -> None:
    await pdc.apply(sim_cluster(NAME))
    await wait_until(lambda: converged(kube, pdc, NAME), timeout=180, message="Ready")

    async def two_ready() -> list[dict[str, Any]] | None:
        pods = await router_pods(kube, namespace)
        return pods if len(pods) == 2 and all(is_ready(p) for p in pods) else None

    pods = await wait_until(two_ready, timeout=120, message="two router pods Ready")
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert len(nodes) == 2, f"both routers on {nodes}: the preferred anti-affinity did not spread them"

    async def budget_allows_one() -> bool:
        pdb = await kube.get("policy/v1", "PodDisruptionBudget", f"{NAME}-router", namespace)
        status = (pdb or {}).get("status") or {}
        return status.get("currentHealthy") == 2 and status.get("disruptionsAllowed") == 1

    await wait_until(budget_allows_one, timeout=60, message="the router budget allows one disruption")

    svc = await kube.get("v1", "Service", f"{NAME}-router", namespace)
    load = RetryingLoad(f"http://{svc['spec']['clusterIP']}:8000")
    async with load.running():
        await wait_until(lambda: len(load.outcomes) >= 12, timeout=60, message="requests complete before")
        # Both routers take requests; the one deleted is the one that served the most.
        served = {p["metadata"]["name"]: await requests_served(p) for p in pods}
        assert all(served.values()), served
        victim = next(p for p in pods if p["metadata"]["name"] == max(served, key=served.get))["metadata"]
        await kube.delete("v1", "Pod", victim["name"], namespace, uid=victim["uid"])

        async def replaced() -> bool:
            now = await router_pods(kube, namespace)
            names = {p["metadata"]["name"] for p in now}
            return victim["name"] not in names and len(now) == 2 and all(is_ready(p) for p in now)

        await wait_until(replaced, timeout=120, message="a new router pod Ready in the deleted one's place")
        after = len(load.outcomes)
        await wait_until(lambda: len(load.outcomes) >= after + 12, timeout=60, message="requests complete after")

    failures = [o for o in load.outcomes if not o.ok]
    assert not failures, failures[:5]
    print(f"{len(load.outcomes)} streams, 0 failed, {len(load.retried)} retried after a connection error")
    await wait_until(lambda: converged(kube, pdc, NAME), timeout=120, message="converged")
    assert operator.failures() == []
