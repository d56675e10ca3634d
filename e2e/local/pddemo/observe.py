"""What the cluster says: the PDCluster's status (replicas, readiness, the autoscaler's
decisions) and the router's latency and load in Prometheus."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import Decision
from pdcluster.io.kube import Kube
from pdcluster.io.prometheus import Prometheus, PrometheusUnavailable


@dataclass
class Snapshot:
    roles: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (desired, ready)
    ready: str = "?"
    ttft_ms: float | None = None
    itl_ms: float | None = None
    requests_rate: float | None = None
    last_decision: Decision | None = None


def read_status(status: dict[str, Any]) -> Snapshot:
    """The PDCluster's status as the view shows it (no latency yet)."""
    s = Snapshot()
    for role in C.ENGINE_ROLES:
        r = status.get(role) or {}
        s.roles[role] = (r.get("desired", 0), r.get("ready", 0))
    ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
    s.ready = ready["status"] if ready else "?"
    last = (status.get("autoscaling") or {}).get("lastDecision")
    s.last_decision = Decision.model_validate(last) if last else None
    return s


def is_new_scaling(decision: Decision | None, previous: Decision | None) -> bool:
    """A decision that changed replicas (or would have, in recommend mode) and was not seen
    yet: the autoscaler overwrites lastDecision at each run, holds included."""
    if decision is None or decision.action == "hold":
        return False
    return previous is None or decision.time != previous.time


class Observer:
    """Polls the PDCluster's status and the router's figures in Prometheus."""

    def __init__(
        self, kube: Kube, prometheus_url: str, namespace: str, name: str, quantile: float, window_s: int
    ) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.quantile, self.window_s = quantile, window_s
        self._http = aiohttp.ClientSession()
        self.prometheus = Prometheus(prometheus_url, self._http)
        self.snapshot = Snapshot()
        self.decisions: list[Decision] = []  # every scaling decision seen, oldest first

    async def close(self) -> None:
        await self._http.close()

    async def poll(self) -> Snapshot:
        obj = await self.kube.get(C.API_VERSION, C.KIND, self.name, self.namespace) or {}
        s = read_status(obj.get("status") or {})
        try:
            figures = await self.prometheus.watched(self.namespace, self.name, self.window_s, self.quantile)
        except PrometheusUnavailable:
            figures = {}  # the status still shows; latency waits for Prometheus
        s.ttft_ms, s.itl_ms = figures.get("ttft_ms"), figures.get("itl_ms")
        s.requests_rate = figures.get("requests_rate")
        if is_new_scaling(s.last_decision, self.decisions[-1] if self.decisions else None):
            self.decisions.append(s.last_decision)
        self.snapshot = s
        return s

    def settled(self, spec: dict[str, Any]) -> bool:
        """Scaled and back to the smallest cluster after the load: nothing more to show."""
        at_minimum = all(
            self.snapshot.roles.get(role, (0, 0)) == (spec[role].get("minReplicas", 1),) * 2
            for role in C.ENGINE_ROLES
        )
        return at_minimum and bool(self.decisions)
