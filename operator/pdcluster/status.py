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
    PDClusterSpec,
    PDClusterStatus,
    RoleStatus,
)
from pdcluster.timestamps import time_s


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


def kv_transfer(verdicts: dict[str, str] | None) -> tuple[bool, str, str] | None:
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
    pools = {role: _role_status(obs, role, spec.role(role).gpus) for role in spec.engine_roles}
    prefill = pools.get(C.ROLE_PREFILL, (RoleStatus(), True))[0]
    decode = pools.get(C.ROLE_DECODE, (RoleStatus(), True))[0]
    colocated = pools[C.ROLE_COLOCATED][0] if C.ROLE_COLOCATED in pools else None
    flexible = pools[C.ROLE_FLEXIBLE][0] if C.ROLE_FLEXIBLE in pools else None
    router, router_settled = _role_status(obs, C.ROLE_ROUTER, 0)
    master, master_settled = _role_status(obs, C.ROLE_MOONCAKE_MASTER, 0)

    components = {
        **{role: status for role, (status, _) in pools.items()},
        "router": router,
        "mooncake master": master,
    }
    missing = [name for name, s in components.items() if s.desired > 0 and s.ready == 0]
    if spec.suspend:
        ready, ready_reason, ready_msg = (
            False,
            "Suspended",
            "spec.suspend is true: pools and router are scaled to zero",
        )
    elif missing:
        ready, ready_reason, ready_msg = (
            False,
            "ComponentsUnavailable",
            f"no ready pods yet: {', '.join(missing)}",
        )
    else:
        ready, ready_reason, ready_msg = (
            True,
            "AllComponentsReady",
            ", ".join(f"{s.ready} {role}" for role, (s, _) in pools.items())
            + f", {router.ready} router pods ready",
        )

    moving = [
        name
        for name, settled in (
            *((role, settled) for role, (_, settled) in pools.items()),
            ("router", router_settled),
            ("mooncake master", master_settled),
        )
        if not settled
    ]
    if spec.paused:
        progressing, prog_reason, prog_msg = False, "Paused", "spec.paused is true: changes are not applied"
    elif obs.rollout:
        progressing, prog_reason, prog_msg = True, "RollingOut", f"prefill and decode together: {obs.rollout}"
    elif moving:
        progressing, prog_reason, prog_msg = (
            True,
            "Reconciling",
            f"waiting for {', '.join(moving)} to reach the desired state",
        )
    else:
        progressing, prog_reason, prog_msg = False, "Stable", "all workloads match the desired state"

    if obs.problems:
        first = obs.problems[0]
        degraded, deg_reason = True, first.reason
        deg_msg = "; ".join(p.message for p in obs.problems)
    else:
        degraded, deg_reason, deg_msg = False, "AsExpected", "no problems found"

    now_s = time_s(now)
    prev = previous.conditions
    conditions = [
        _condition(prev, "Ready", ready, ready_reason, ready_msg, now_s, generation),
        _condition(prev, "Progressing", progressing, prog_reason, prog_msg, now_s, generation),
        _condition(prev, "Degraded", degraded, deg_reason, deg_msg, now_s, generation),
    ]
    if obs.autoscaling is not None:
        ok, reason, message = obs.autoscaling
        conditions.append(_condition(prev, "Autoscaling", ok, reason, message, now_s, generation))
    if obs.mode_fit is not None:
        ok, reason, message = obs.mode_fit
        conditions.append(_condition(prev, "ModeFit", ok, reason, message, now_s, generation))
    handoff = kv_transfer(obs.kv_verdicts)
    if handoff is not None:
        ok, reason, message = handoff
        conditions.append(_condition(prev, "KVTransfer", ok, reason, message, now_s, generation))

    ttft, itl = obs.latency_p99_ms
    return PDClusterStatus(
        observed_generation=generation,
        conditions=conditions,
        prefill=prefill,
        decode=decode,
        colocated=colocated,
        flexible=flexible,
        ratio=_ratio(spec, prefill, decode, colocated, flexible),
        router=ComponentStatus(replicas=router.replicas, ready=router.ready),
        mooncake=ComponentStatus(replicas=master.replicas, ready=master.ready),
        ttft_p99_ms=ttft if ttft is not None else previous.ttft_p99_ms,
        itl_p99_ms=itl if itl is not None else previous.itl_p99_ms,
        autoscaling=autoscaling,
        rollout=obs.rollout,
    )
