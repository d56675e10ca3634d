"""The autoscaler hook of reconcile: Prometheus -> control.decide -> state in status.

It runs the pure control law at most once per `autoscaling.intervalSeconds` per cluster
and returns the state reconcile stores in status (and, in `auto` mode, renders replicas
from). Everything it remembers across runs is in that state, so a restarted operator
continues where it stopped; the in-memory schedule only avoids querying more often.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import NamedTuple

import aiohttp

from pdcluster import constants as C
from pdcluster import flexible, metrics, perf, slo
from pdcluster.api.v1alpha1 import (
    AutoscalingMode,
    AutoscalingState,
    Decision,
    PDClusterSpec,
    PDClusterStatus,
    RoleStatus,
    ServingMode,
)
from pdcluster.control import MetricsSnapshot, Observed, RoleObserved, decide
from pdcluster.control.modefit import mode_fit
from pdcluster.io.kube import Kube
from pdcluster.io.prometheus import NO_CREDENTIALS, Credentials, Prometheus, PrometheusUnavailable
from pdcluster.io.prometheus_auth import CredentialsUnavailable, OperatorCredentials, from_spec
from pdcluster.reconcile import AutoscaleResult
from pdcluster.render import Owner
from pdcluster.timestamps import parse

log = logging.getLogger(__name__)

Condition = tuple[bool, str, str]  # (status, reason, message)
Event = tuple[str, str, str]  # (type, reason, message)


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


def flexible_observed(spec: PDClusterSpec, status: PDClusterStatus, pods: list[dict]) -> Observed:
    """A flexible pool as the law sees two roles: the engines the routers make each role
    act as (ready ones in pool order, flexible.acting), the split last decided, and pods
    that cannot schedule counted against the role still short of its engines."""
    pool = status.flexible or RoleStatus()
    prefill, total = flexible.assignment(spec, status.autoscaling)
    ready = flexible.acting(pool.ready, prefill)
    made = flexible.acting(pool.replicas, prefill)
    stuck = _unschedulable(pods)
    short_prefill = stuck if ready[0] < prefill else 0
    startup = float(pool.startup.median_seconds) if pool.startup else None
    return Observed(
        RoleObserved(prefill, made[0], ready[0], short_prefill, startup),
        RoleObserved(total - prefill, made[1], ready[1], stuck - short_prefill, startup),
    )


def _held(status: PDClusterStatus, kind: str) -> Condition | None:
    """A condition as the last run of the autoscaler left it."""
    c = next((c for c in status.conditions if c.type == kind), None)
    return (c.status == "True", c.reason, c.message) if c else None


class ProfileError(Exception):
    """The spec names a profile that cannot be had; the message says which and why."""


class PrometheusAutoscaler:
    def __init__(
        self,
        kube: Kube,
        default_url: str | None,
        *,
        timeout_s: float = 5.0,
        default_credentials: OperatorCredentials | None = None,
    ):
        self.kube = kube
        self.default_url = default_url
        self.timeout_s = timeout_s
        self.default_credentials = default_credentials or OperatorCredentials()
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _prometheus(self, url: str, creds: Credentials) -> Prometheus:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return Prometheus(url, self._session, timeout_s=self.timeout_s, creds=creds)

    async def _credentials(self, spec: PDClusterSpec, owner: Owner) -> Credentials:
        """The spec's own; else the operator's, for the operator's URL only
        (io/prometheus_auth.py says why)."""
        a = spec.autoscaling
        if a.prometheus_auth is not None:
            return await from_spec(self.kube, owner.namespace, a.prometheus_auth)
        return NO_CREDENTIALS if a.prometheus_url else self.default_credentials.load()

    async def _observed(self, spec: PDClusterSpec, owner: Owner, status: PDClusterStatus) -> Observed:
        if spec.mode == ServingMode.flexible:
            return flexible_observed(spec, status, await self._pods(owner, C.ROLE_FLEXIBLE))
        none = RoleObserved(0, 0, 0)
        roles = dict.fromkeys((*C.ENGINE_ROLES, C.ROLE_COLOCATED), none)
        for role in spec.engine_roles:
            pods = await self._pods(owner, role)
            s = getattr(status, role) or RoleStatus()
            roles[role] = RoleObserved(
                desired=s.desired,
                replicas=s.replicas,
                ready=s.ready,
                unschedulable=_unschedulable(pods),
                startup_s=float(s.startup.median_seconds) if s.startup else None,
            )
        return Observed(**roles)

    async def _pods(self, owner: Owner, role: str) -> list[dict]:
        selector = f"{C.LABEL_CLUSTER}={owner.name},{C.LABEL_ROLE}={role}"
        return await self.kube.list("v1", "Pod", owner.namespace, label_selector=selector)

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
        stored_latency = (status.ttft_p99_ms, status.itl_p99_ms)
        due = state is None or not state.last_run_time
        if not due and now - parse(state.last_run_time) < timedelta(seconds=a.interval_seconds):
            return AutoscaleResult(state, held, stored_latency, mode_fit=fit)
        try:
            prior = await self._prior(spec, owner)
        except ProfileError as e:
            return AutoscaleResult(
                state, (False, "UnknownProfile", f"{e}; holding replicas"), stored_latency, mode_fit=fit
            )
        read = await self._read_metrics(spec, owner)
        observed = await self._observed(spec, owner, status)
        new_state, decision = decide(spec, read.snapshot, state, observed, now, profile=prior)
        reading = slo.of_snapshot(a, read.snapshot, colocated=spec.mode == ServingMode.colocated)
        new_state = new_state.model_copy(update={"slo": reading.status()})
        condition = read.problem
        if condition is None:
            recommend = "recommend: " if a.mode == AutoscalingMode.recommend else ""
            condition = (True, decision.cause, recommend + decision.summary)
        metrics.DECISIONS.labels(owner.namespace, owner.name, decision.action, decision.cause).inc()
        events = _scaling_events(spec, state, new_state, decision)
        fit, advice = _mode_advice(spec, read.snapshot, fit)
        return AutoscaleResult(new_state, condition, read.latency_p99_ms, events + advice, mode_fit=fit)

    async def _read_metrics(self, spec: PDClusterSpec, owner: Owner) -> _MetricsRead:
        """The window's metrics and the router's p99s, or why there are none."""
        a = spec.autoscaling
        url = a.prometheus_url or self.default_url
        if not url:
            return _MetricsRead(
                None,
                (None, None),
                (
                    False,
                    "NoPrometheus",
                    "set spec.autoscaling.prometheusUrl or the operator's --prometheus-url",
                ),
            )
        try:
            creds = await self._credentials(spec, owner)
        except CredentialsUnavailable as e:
            problem = (False, "PrometheusCredentials", f"{e}; holding replicas")
            return _MetricsRead(None, (None, None), problem)
        prom = self._prometheus(url, creds)
        snapshot = None
        try:
            snapshot = await prom.snapshot(
                owner.namespace, owner.name, a.window_seconds, a.slo.quantile.fraction
            )
            latency = await prom.router_p99_ms(owner.namespace, owner.name, a.window_seconds)
        except PrometheusUnavailable as e:
            # A snapshot read before the failure still goes to the law.
            problem = (False, "MetricsUnavailable", f"Prometheus cannot be queried ({e}); holding replicas")
            return _MetricsRead(snapshot, (None, None), problem)
        if snapshot is None:
            problem = (
                False,
                "NoMetrics",
                f"Prometheus at {url} has no series of this cluster yet; holding replicas",
            )
            return _MetricsRead(None, latency, problem)
        return _MetricsRead(snapshot, latency, None)


class _MetricsRead(NamedTuple):
    snapshot: MetricsSnapshot | None
    latency_p99_ms: tuple[int | None, int | None]  # (TTFT, ITL) at the router
    problem: Condition | None  # the Autoscaling condition when the metrics cannot be had


def _scaling_events(
    spec: PDClusterSpec, state: AutoscalingState | None, new_state: AutoscalingState, decision: Decision
) -> list[Event]:
    """One event when the law scaled or recommended new replica counts. A flexible pool's
    split alone moves by flips, which reconcile reports (RolesFlipped) as the routers get it."""
    counts = ("prefill", "decode", "colocated")
    changed = state is None or any(getattr(new_state, r) != getattr(state, r) for r in counts)
    if spec.mode == ServingMode.flexible and state is not None and decision.action == "scale":
        changed = _pool_size(new_state) != _pool_size(state)
    if decision.action in ("scale", "recommend") and changed:
        reason = "Scaled" if decision.action == "scale" else "Recommended"
        return [("Normal", reason, decision.summary)]
    return []


def _pool_size(state: AutoscalingState) -> int:
    return (state.prefill or 0) + (state.decode or 0)


def _mode_advice(
    spec: PDClusterSpec, snapshot: MetricsSnapshot | None, before: Condition | None
) -> tuple[Condition | None, list[Event]]:
    """The ModeFit condition, and an event when the serving mode stops fitting the traffic."""
    if snapshot is not None and snapshot.request_rate > 0:
        a = spec.autoscaling
        fit = mode_fit(spec.mode, a.profile, snapshot.mean_input_tokens, a.slo.itl_ms)
        if fit is not None and not fit[0] and (before is None or before[0]):
            return fit, [("Normal", "ModeAdvice", fit[2])]
        return fit, []
    return before, []  # without traffic the last advice stands
