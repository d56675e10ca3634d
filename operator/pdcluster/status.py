"""Pure status: what was observed in, the PDCluster status out.

Conditions follow Kubernetes conventions and are what GitOps tools read:
- Ready:       every component serves (>= 1 ready pod each); False while suspended.
- Progressing: a rollout or scale is under way (workloads not yet at their desired state);
               `RollingOut` while prefill and decode move to a new engine revision.
- Degraded:    something needs a person (an apply error, a missing Secret, a scale-up
               that cannot schedule); the message says what to fix.
- Autoscaling: present when autoscaling is on; False when the control law is holding
               because it cannot trust its inputs (e.g. Prometheus is down).
- KVTransfer:  present once a router has probed a prefill -> decode pair; False names
               each pair whose KV hand-off failed (router/probe.py), which takes no traffic.
- ModeFit:     present when autoscaling sees traffic and its profile ships a crossover
               sweep; False when the other serving mode would serve that traffic clearly
               better per GPU (control/modefit.py).
- ModelReady:  present with model.source cache; True once the download Job has filled the
               cache (its size and time in the message and in status.model), False while it
               runs or after it failed (with the error its pod ended with: modelready.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pdcluster import constants as C
from pdcluster import flexible
from pdcluster.api.v1alpha1 import (
    AutoscalingState,
    ComponentStatus,
    Condition,
    ModelStatus,
    PDClusterSpec,
    PDClusterStatus,
    RoleStatus,
)
from pdcluster.timestamps import time_s

ConditionFields = tuple[bool, str, str]  # (status, reason, message)


@dataclass(frozen=True)
class Problem:
    reason: str  # CamelCase, e.g. SecretNotFound
    message: str  # what to fix


@dataclass
class Observation:
    """What one reconcile saw and did."""

    workloads: dict[str, dict[str, Any] | None]  # role -> StatefulSet/Deployment as read back
    desired: dict[str, int]  # role -> replicas rendered
    problems: list[Problem] = field(default_factory=list)
    autoscaling: tuple[bool, str, str] | None = None  # (ok, reason, message)
    latency_p99_ms: tuple[int | None, int | None] = (None, None)  # router TTFT, ITL
    kv_verdicts: dict[str, str] | None = None  # the router-state ConfigMap's data
    rollout: str | None = None  # a coordinated rollout's progress (rollout.py)
    mode_fit: tuple[bool, str, str] | None = None  # (fits, reason, message)
    model: tuple[ConditionFields, ModelStatus] | None = None  # the model cache (modelready.py)


def kv_transfer(verdicts: dict[str, str] | None) -> ConditionFields | None:
    """(ok, reason, message) from every router's verdicts; None before any probe."""
    failed: dict[tuple[str, str], str] = {}
    passed = 0
    for text in (verdicts or {}).values():
        try:
            entry = json.loads(text)
            passed = max(passed, int(entry.get("passed", 0)))
            for pair in entry.get("failed") or []:
                failed[(str(pair["prefill"]), str(pair["decode"]))] = str(pair.get("reason", ""))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue  # not ours to judge: a router of another version, or a hand edit
    if failed:
        named = "; ".join(f"{p} -> {d}: {why}" for (p, d), why in sorted(failed.items()))
        return False, "HandOffFailed", f"{len(failed)} pair(s) out of rotation: {named}"
    if passed:
        return True, "Verified", f"{passed} prefill -> decode pair(s) verified: decode loads prefill's KV"
    return None


def _workload_counts(obj: dict[str, Any] | None) -> tuple[int, int, int, bool]:
    """(replicas, ready, updated, settled) from a StatefulSet or Deployment."""
    if not obj:
        return 0, 0, 0, False
    st = obj.get("status") or {}
    replicas = st.get("replicas", 0)
    ready = st.get("readyReplicas", 0)
    updated = st.get("updatedReplicas", 0)
    seen = st.get("observedGeneration", 0) >= obj.get("metadata", {}).get("generation", 1)
    if obj.get("kind") == "StatefulSet" and st.get("currentRevision") != st.get("updateRevision"):
        seen = False
    return replicas, ready, updated, seen


def _role_status(obs: Observation, role: str, gpus_per_pod: int) -> tuple[RoleStatus, bool]:
    replicas, ready, updated, seen = _workload_counts(obs.workloads.get(role))
    desired = obs.desired.get(role, 0)
    settled = seen and replicas == desired and ready == desired and updated >= desired
    return RoleStatus(
        desired=desired, replicas=replicas, ready=ready, updated=updated, gpus=replicas * gpus_per_pod
    ), settled


def _condition(
    previous: list[Condition],
    type_: str,
    ok: bool,
    reason: str,
    message: str,
    now: str,
    generation: int | None,
) -> Condition:
    status = "True" if ok else "False"
    old = next((c for c in previous if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status else now
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def _ratio(
    spec: PDClusterSpec,
    prefill: RoleStatus,
    decode: RoleStatus,
    colocated: RoleStatus | None,
    flexible_pool: RoleStatus | None,
) -> str | None:
    if colocated is not None:
        return None
    if flexible_pool is not None:  # the split the routers apply to the ready engines
        return "{}:{}".format(*flexible.split(flexible_pool.ready, flexible.prefill_engines(spec)))
    return f"{prefill.ready}:{decode.ready}"


def compute_status(
    spec: PDClusterSpec,
    generation: int | None,
    obs: Observation,
    previous: PDClusterStatus | None,
    autoscaling: AutoscalingState | None,
    now: datetime,
) -> PDClusterStatus:
    previous = previous or PDClusterStatus()
    seen = _observe_components(spec, obs)
    prefill = seen.pools.get(C.ROLE_PREFILL, (RoleStatus(), True))[0]
    decode = seen.pools.get(C.ROLE_DECODE, (RoleStatus(), True))[0]
    colocated = seen.pools[C.ROLE_COLOCATED][0] if C.ROLE_COLOCATED in seen.pools else None
    flexible = seen.pools[C.ROLE_FLEXIBLE][0] if C.ROLE_FLEXIBLE in seen.pools else None
    ttft, itl = obs.latency_p99_ms
    return PDClusterStatus(
        observed_generation=generation,
        conditions=_conditions(spec, obs, seen, previous.conditions, time_s(now), generation),
        prefill=prefill,
        decode=decode,
        colocated=colocated,
        flexible=flexible,
        ratio=_ratio(spec, prefill, decode, colocated, flexible),
        router=ComponentStatus(replicas=seen.router.replicas, ready=seen.router.ready),
        mooncake=ComponentStatus(replicas=seen.master.replicas, ready=seen.master.ready),
        ttft_p99_ms=ttft if ttft is not None else previous.ttft_p99_ms,
        itl_p99_ms=itl if itl is not None else previous.itl_p99_ms,
        autoscaling=autoscaling,
        model=obs.model[1] if obs.model is not None else None,
        rollout=obs.rollout,
    )


@dataclass(frozen=True)
class _Components:
    """Every component's counts, and whether it has reached its desired state."""

    pools: dict[str, tuple[RoleStatus, bool]]  # engine role -> (status, settled)
    router: RoleStatus
    router_settled: bool
    master: RoleStatus
    master_settled: bool

    def statuses(self) -> dict[str, RoleStatus]:
        return {
            **{role: status for role, (status, _) in self.pools.items()},
            "router": self.router,
            "mooncake master": self.master,
        }

    def unsettled(self) -> list[str]:
        return [
            name
            for name, settled in (
                *((role, settled) for role, (_, settled) in self.pools.items()),
                ("router", self.router_settled),
                ("mooncake master", self.master_settled),
            )
            if not settled
        ]


def _observe_components(spec: PDClusterSpec, obs: Observation) -> _Components:
    pools = {role: _role_status(obs, role, spec.role(role).gpus) for role in spec.engine_roles}
    router, router_settled = _role_status(obs, C.ROLE_ROUTER, 0)
    master, master_settled = _role_status(obs, C.ROLE_MOONCAKE_MASTER, 0)
    return _Components(pools, router, router_settled, master, master_settled)


def _conditions(
    spec: PDClusterSpec,
    obs: Observation,
    seen: _Components,
    previous: list[Condition],
    now_s: str,
    generation: int | None,
) -> list[Condition]:
    """Ready, Progressing and Degraded always; the others when there is something to say."""
    judged: list[tuple[str, ConditionFields]] = [
        ("Ready", _ready(spec, seen)),
        ("Progressing", _progressing(spec, obs, seen)),
        ("Degraded", _degraded(obs)),
    ]
    optional = (
        ("Autoscaling", obs.autoscaling),
        ("ModeFit", obs.mode_fit),
        ("KVTransfer", kv_transfer(obs.kv_verdicts)),
        ("ModelReady", obs.model[0] if obs.model is not None else None),
    )
    judged += [(type_, fields) for type_, fields in optional if fields is not None]
    return [
        _condition(previous, type_, ok, reason, message, now_s, generation)
        for type_, (ok, reason, message) in judged
    ]


def _ready(spec: PDClusterSpec, seen: _Components) -> ConditionFields:
    missing = [name for name, s in seen.statuses().items() if s.desired > 0 and s.ready == 0]
    if spec.suspend:
        return False, "Suspended", "spec.suspend is true: pools and router are scaled to zero"
    if missing:
        return False, "ComponentsUnavailable", f"no ready pods yet: {', '.join(missing)}"
    return (
        True,
        "AllComponentsReady",
        ", ".join(f"{s.ready} {role}" for role, (s, _) in seen.pools.items())
        + f", {seen.router.ready} router pods ready",
    )


def _progressing(spec: PDClusterSpec, obs: Observation, seen: _Components) -> ConditionFields:
    moving = seen.unsettled()
    if spec.paused:
        return False, "Paused", "spec.paused is true: changes are not applied"
    if obs.rollout:
        return True, "RollingOut", f"prefill and decode together: {obs.rollout}"
    if moving:
        return True, "Reconciling", f"waiting for {', '.join(moving)} to reach the desired state"
    return False, "Stable", "all workloads match the desired state"


def _degraded(obs: Observation) -> ConditionFields:
    if obs.problems:
        return True, obs.problems[0].reason, "; ".join(p.message for p in obs.problems)
    return False, "AsExpected", "no problems found"
