"""What the cluster says: the PDCluster's status (replicas, readiness, the autoscaler's
decisions and SLO verdict) and the router's latency and load in Prometheus, read as the
control law reads them (pdcluster.slo)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdcluster import constants as C
from pdcluster import slo
from pdcluster.api.v1alpha1 import AutoscalingSpec, Decision, SLOStatus
from pdcluster.io.kube import Kube
from pdcluster.io.prometheus import Prometheus, PrometheusUnavailable

# The law's table is some thirty queries: read every few seconds (Prometheus scrapes
# every 2 s in the local cluster), the status every poll.
READ_EVERY_S = 5.0


@dataclass
class Snapshot:
    roles: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (desired, ready)
    ready: str = "?"
    reading: slo.Reading | None = None  # the router's window, judged as the law judges it
    requests_rate: float | None = None
    last_decision: Decision | None = None
    operator_slo: SLOStatus | None = None  # the law's own verdict on its last window


def read_status(status: dict[str, Any]) -> Snapshot:
    """The PDCluster's status as the view shows it (no latency yet)."""
    s = Snapshot()
    for role in C.ENGINE_ROLES:
        r = status.get(role) or {}
        s.roles[role] = (r.get("desired", 0), r.get("ready", 0))
    ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
    s.ready = ready["status"] if ready else "?"
    autoscaling = status.get("autoscaling") or {}
    last, verdict = autoscaling.get("lastDecision"), autoscaling.get("slo")
    s.last_decision = Decision.model_validate(last) if last else None
    s.operator_slo = SLOStatus.model_validate(verdict) if verdict else None
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
        self, kube: Kube, prometheus_url: str, namespace: str, name: str, auto: AutoscalingSpec, colocated: bool
    ) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.auto, self.colocated = auto, colocated
        self.quantile, self.window_s = auto.slo.quantile.fraction, auto.window_seconds
        self._http = aiohttp.ClientSession()
        self.prometheus = Prometheus(prometheus_url, self._http)
        self.snapshot = Snapshot()
        self.decisions: list[Decision] = []  # every scaling decision seen, oldest first
        self.verdicts: dict[str, int] = {}  # the live line's verdicts, counted per reading
        self._next_read = 0.0

    async def close(self) -> None:
        await self._http.close()

    async def poll(self) -> Snapshot:
        obj = await self.kube.get(C.API_VERSION, C.KIND, self.name, self.namespace) or {}
        s = read_status(obj.get("status") or {})
        s.reading, s.requests_rate = self.snapshot.reading, self.snapshot.requests_rate
        if time.monotonic() >= self._next_read:
            self._next_read = time.monotonic() + READ_EVERY_S
            await self._read_prometheus(s)
        if is_new_scaling(s.last_decision, self.decisions[-1] if self.decisions else None):
            self.decisions.append(s.last_decision)
        self.snapshot = s
        return s

    async def _read_prometheus(self, s: Snapshot) -> None:
        try:
            # The control law's own table, read as the operator reads it: the view judges
            # the same window the same way (pdcluster.slo).
            window = await self.prometheus.snapshot(self.namespace, self.name, self.window_s, self.quantile)
            figures = await self.prometheus.watched(self.namespace, self.name, self.window_s, self.quantile)
        except PrometheusUnavailable:
            window, figures = None, {}  # the status still shows; latency waits for Prometheus
        s.reading = slo.of_snapshot(self.auto, window, self.colocated)
        s.requests_rate = figures.get("requests_rate")
        if s.requests_rate:
            self.verdicts[s.reading.verdict] = self.verdicts.get(s.reading.verdict, 0) + 1
    def settled(self, spec: dict[str, Any]) -> bool:
        """Scaled and back to the smallest cluster after the load: nothing more to show."""
        at_minimum = all(
            self.snapshot.roles.get(role, (0, 0)) == (spec[role].get("minReplicas", 1),) * 2
            for role in C.ENGINE_ROLES
        )
        return at_minimum and bool(self.decisions)
