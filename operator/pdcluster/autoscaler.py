"""The autoscaler hook of reconcile: Prometheus -> control.decide -> state in status.

It runs the pure control law at most once per `autoscaling.intervalSeconds` per cluster
and returns the state reconcile stores in status (and, in `auto` mode, renders replicas
from). Everything it remembers across runs is in that state, so a restarted operator
continues where it stopped; the in-memory schedule only avoids querying more often.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import aiohttp

from pdcluster import constants as C
from pdcluster import metrics, perf
from pdcluster.api.v1alpha1 import AutoscalingMode, PDClusterSpec, PDClusterStatus, RoleStatus
from pdcluster.control import Observed, RoleObserved, decide
from pdcluster.control.modefit import mode_fit
from pdcluster.io.kube import Kube
from pdcluster.io.prometheus import Prometheus, PrometheusUnavailable
from pdcluster.reconcile import AutoscaleResult
from pdcluster.render import Owner
from pdcluster.timestamps import parse

log = logging.getLogger(__name__)


def _unschedulable(pods: list[dict]) -> int:
    count = 0
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        for cond in pod.get("status", {}).get("conditions") or []:
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                count += 1
    return count


def _held(status: PDClusterStatus, kind: str) -> tuple[bool, str, str] | None:
    """A condition as the last run of the autoscaler left it."""
    c = next((c for c in status.conditions if c.type == kind), None)
    return (c.status == "True", c.reason, c.message) if c else None


class ProfileError(Exception):
    """The spec names a profile that cannot be had; the message says which and why."""


class PrometheusAutoscaler:
    def __init__(self, kube: Kube, default_url: str | None, *, timeout_s: float = 5.0):
        self.kube = kube
        self.default_url = default_url
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _prometheus(self, url: str) -> Prometheus:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return Prometheus(url, self._session, timeout_s=self.timeout_s)

    async def _observed(self, spec: PDClusterSpec, owner: Owner, status: PDClusterStatus) -> Observed:
        none = RoleObserved(0, 0, 0)
        roles = dict.fromkeys((*C.ENGINE_ROLES, C.ROLE_COLOCATED), none)
        for role in spec.engine_roles:
            pods = await self.kube.list(
                "v1",
                "Pod",
                owner.namespace,
                label_selector=f"{C.LABEL_CLUSTER}={owner.name},{C.LABEL_ROLE}={role}",
            )
            s = getattr(status, role) or RoleStatus()
            roles[role] = RoleObserved(
                desired=s.desired, replicas=s.replicas, ready=s.ready, unschedulable=_unschedulable(pods)
            )
        return Observed(**roles)

    async def _prior(self, spec: PDClusterSpec, owner: Owner) -> perf.Profile | None:
        """The latency profile the spec names, the capacity model's prior; None: none."""
        a = spec.autoscaling
        if a.profile_config_map:
            where = f"autoscaling.profileConfigMap {owner.namespace}/{a.profile_config_map}"
            cm = await self.kube.get("v1", "ConfigMap", a.profile_config_map, owner.namespace)
            if cm is None:
                raise ProfileError(f"{where} not found")
            text = (cm.get("data") or {}).get(perf.PROFILE_KEY)
            if text is None:
                raise ProfileError(f"{where} has no {perf.PROFILE_KEY}")
            try:
                return perf.from_json(text)
            except ValueError as e:
                raise ProfileError(f"{where}: {e}") from None
        if a.profile:
            try:  # the schema cannot know the profile names: an unknown one holds
                return perf.load(a.profile)
            except (KeyError, OSError) as e:
                raise ProfileError(f"autoscaling.profile: {e.args[0] if e.args else e}") from None
        return None

    async def step(
        self, spec: PDClusterSpec, owner: Owner, status: PDClusterStatus, now: datetime
    ) -> AutoscaleResult:
        a = spec.autoscaling
        state = status.autoscaling
        held, fit = (_held(status, kind) for kind in ("Autoscaling", "ModeFit"))
        due = state is None or not state.last_run_time
        if not due and now - parse(state.last_run_time) < timedelta(seconds=a.interval_seconds):
            return AutoscaleResult(state, held, (status.ttft_p99_ms, status.itl_p99_ms), mode_fit=fit)
        try:
            prior = await self._prior(spec, owner)
        except ProfileError as e:
            return AutoscaleResult(
                state,
                (False, "UnknownProfile", f"{e}; holding replicas"),
                (status.ttft_p99_ms, status.itl_p99_ms),
                mode_fit=fit,
            )
        url = a.prometheus_url or self.default_url
        events: list[tuple[str, str, str]] = []
        latency: tuple[int | None, int | None] = (None, None)
        snapshot = None
        if not url:
            condition = (
                False,
                "NoPrometheus",
                "set spec.autoscaling.prometheusUrl or the operator's --prometheus-url",
            )
        else:
            prom = self._prometheus(url)
            try:
                snapshot = await prom.snapshot(
                    owner.namespace, owner.name, a.window_seconds, a.slo.quantile.fraction
                )
                latency = await prom.router_p99_ms(owner.namespace, owner.name, a.window_seconds)
            except PrometheusUnavailable as e:
                condition = (
                    False,
                    "MetricsUnavailable",
                    f"Prometheus cannot be queried ({e}); holding replicas",
                )
            else:
                if snapshot is None:
                    condition = (
                        False,
                        "NoMetrics",
                        f"Prometheus at {url} has no series of this cluster yet; holding replicas",
                    )
                else:
                    condition = None
        observed = await self._observed(spec, owner, status)
        new_state, decision = decide(spec, snapshot, state, observed, now, profile=prior)
        if condition is None:
            recommend = "recommend: " if a.mode == AutoscalingMode.recommend else ""
            condition = (True, decision.cause, recommend + decision.summary)
        metrics.DECISIONS.labels(owner.namespace, owner.name, decision.action, decision.cause).inc()
        counts = ("prefill", "decode", "colocated")
        changed = state is None or any(getattr(new_state, r) != getattr(state, r) for r in counts)
        if decision.action in ("scale", "recommend") and changed:
            reason = "Scaled" if decision.action == "scale" else "Recommended"
            events.append(("Normal", reason, decision.summary))
        if snapshot is not None and snapshot.request_rate > 0:  # else the last advice stands
            before, fit = fit, mode_fit(spec.mode, a.profile, snapshot.mean_input_tokens, a.slo.itl_ms)
            if fit is not None and not fit[0] and (before is None or before[0]):
                events.append(("Normal", "ModeAdvice", fit[2]))
        return AutoscaleResult(new_state, condition, latency, events, mode_fit=fit)
