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
- Reconciling, Stalled: kstatus's pair (sigs.k8s.io/cli-utils pkg/kstatus, "abnormal-true"),
               which Flux and kstatus-based tools read: Reconciling while a workload is
               short of its desired state; Stalled once none came closer to it for
               `spec.progressDeadlineSeconds`, with a stuck pod's own reason (podstate.py),
               or at once on a problem that blocks the spec (a missing Secret, a refused apply).
               Never both True: kstatus takes the first True of the two in list order.
- ModelReady:  present with model.source cache; True once the download Job has filled the
               cache (its size and time in the message and in status.model), False while it
               runs or after it failed (with the error its pod ended with: modelready.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

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
    StartupStatus,
)
from pdcluster.timestamps import parse, time_s

ConditionFields = tuple[bool, str, str]  # (status, reason, message)


@dataclass(frozen=True)
class Problem:
    reason: str  # CamelCase, e.g. SecretNotFound
    message: str  # what to fix
    blocks: bool = True  # the spec cannot be carried out until a person acts (not a mere warning)


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
    startups: dict[str, StartupStatus | None] = field(default_factory=dict)  # role -> measured start-up
    stuck: list[Problem] = field(default_factory=list)  # why pods are not Ready (podstate.pod_problem)
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
        desired=desired,
        replicas=replicas,
        ready=ready,
        updated=updated,
        gpus=replicas * gpus_per_pod,
        startup=obs.startups.get(role),
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
    autoscaling: AutoscalingState | None,
    prefill: RoleStatus,
    decode: RoleStatus,
    colocated: RoleStatus | None,
    flexible_pool: RoleStatus | None,
) -> str | None:
    if colocated is not None:
        return None
    if flexible_pool is not None:  # the split the routers apply to the ready engines
        return "{}:{}".format(*flexible.acting(flexible_pool.ready, flexible.prefill_engines(spec, autoscaling)))
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
    flexible_pool = seen.pools[C.ROLE_FLEXIBLE][0] if C.ROLE_FLEXIBLE in seen.pools else None
    ttft, itl = obs.latency_p99_ms
    progress = _progress(spec, generation, obs, seen, previous, now)
    return PDClusterStatus(
        observed_generation=generation,
        conditions=_conditions(spec, obs, seen, previous.conditions, progress, generation),
        prefill=prefill,
        decode=decode,
        colocated=colocated,
        flexible=flexible_pool,
        roles=None
        if flexible_pool is None
        else flexible.record_flip(spec, autoscaling, previous.roles, time_s(now)),
        ratio=_ratio(spec, autoscaling, prefill, decode, colocated, flexible_pool),
        router=ComponentStatus(replicas=seen.router.replicas, ready=seen.router.ready),
        mooncake=ComponentStatus(replicas=seen.master.replicas, ready=seen.master.ready),
        ttft_p99_ms=ttft if ttft is not None else previous.ttft_p99_ms,
        itl_p99_ms=itl if itl is not None else previous.itl_p99_ms,
        autoscaling=autoscaling,
        last_progress_time=progress.last,
        model=obs.model[1] if obs.model is not None else None,
        rollout=obs.rollout,
    )


class _Progress(NamedTuple):
    """How far workloads came towards their desired state, for the progress deadline."""

    now: str
    moving: bool  # some workload is short of its desired state (and changes are applied)
    last: str | None  # when one last came closer; None when none is moving
    stalled: bool  # moving, and nothing came closer for spec.progressDeadlineSeconds


def _marks(seen: _Components | PDClusterStatus) -> dict[str, tuple[int, ...]]:
    """What moves when a workload comes closer to its desired state: pods desired,
    created, updated and Ready."""
    if isinstance(seen, _Components):
        pools = {role: s for role, (s, _) in seen.pools.items()}
        router, master = seen.router, seen.master
    else:
        pools = {role: getattr(seen, role) for role in (*C.ENGINE_ROLES, C.ROLE_COLOCATED, C.ROLE_FLEXIBLE)}
        router, master = seen.router, seen.mooncake
    marks = {role: (s.desired, s.replicas, s.updated, s.ready) for role, s in pools.items() if s is not None}
    return {**marks, "router": (router.replicas, router.ready), "master": (master.replicas, master.ready)}


def _progress(
    spec: PDClusterSpec,
    generation: int | None,
    obs: Observation,
    seen: _Components,
    previous: PDClusterStatus,
    now: datetime,
) -> _Progress:
    now_s = time_s(now)
    moving = not spec.paused and bool(seen.unsettled() or obs.rollout)
    if not moving:
        return _Progress(now_s, False, None, False)
    before = _marks(previous)
    came_closer = any(before.get(name, mark) != mark for name, mark in _marks(seen).items())
    if previous.last_progress_time is None or previous.observed_generation != generation or came_closer:
        return _Progress(now_s, True, now_s, False)
    waited = (now - parse(previous.last_progress_time)).total_seconds()
    return _Progress(now_s, True, previous.last_progress_time, waited > spec.progress_deadline_seconds)


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
    progress: _Progress,
    generation: int | None,
) -> list[Condition]:
    """Ready, Progressing, Degraded, Reconciling and Stalled always; the others when there
    is something to say."""
    progressing = _progressing(spec, obs, seen)
    stalled = _stalled(spec, obs, seen, progress)
    judged: list[tuple[str, ConditionFields]] = [
        ("Ready", _ready(spec, seen)),
        ("Progressing", progressing),
        ("Degraded", _degraded(obs)),
        ("Reconciling", _reconciling(progressing, progress, stalled)),
        ("Stalled", stalled),
    ]
    optional = (
        ("Autoscaling", obs.autoscaling),
        ("ModeFit", obs.mode_fit),
        ("KVTransfer", kv_transfer(obs.kv_verdicts)),
        ("ModelReady", obs.model[0] if obs.model is not None else None),
    )
    judged += [(type_, fields) for type_, fields in optional if fields is not None]
    return [
        _condition(previous, type_, ok, reason, message, progress.now, generation)
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


def _reconciling(
    progressing: ConditionFields, progress: _Progress, stalled: ConditionFields
) -> ConditionFields:
    """kstatus's InProgress: Progressing's verdict, False once Stalled is True."""
    if stalled[0]:
        return False, "Stalled", "see the Stalled condition"
    if progress.moving:
        return True, progressing[1], progressing[2]
    return False, progressing[1], progressing[2]


MAX_STUCK_NAMED = 3  # pods whose reason the Stalled message quotes


def _stalled(
    spec: PDClusterSpec, obs: Observation, seen: _Components, progress: _Progress
) -> ConditionFields:
    """kstatus's Failed: True with a stuck pod's own reason (the first found, pools first)."""
    deadline = spec.progress_deadline_seconds
    blocking = [p for p in obs.problems if p.blocks]
    if blocking:  # an error, not slowness: no deadline to wait for
        said = "; ".join(p.message for p in blocking[:MAX_STUCK_NAMED])
        return True, blocking[0].reason, f"the spec cannot be carried out: {said}"
    if not progress.stalled:
        if progress.moving:
            return False, "WithinDeadline", f"last progress at {progress.last}; the deadline is {deadline}s"
        return False, "AsExpected", "every workload is at its desired state"
    said = f"no progress for over {deadline}s (since {progress.last})"
    causes = obs.stuck or obs.problems  # the pods' own reasons, else what Degraded says
    if not causes:
        return True, "ProgressDeadlineExceeded", f"{said}: waiting for {', '.join(seen.unsettled())}"
    quoted = "; ".join(p.message for p in causes[:MAX_STUCK_NAMED])
    more = len(causes) - MAX_STUCK_NAMED
    return True, causes[0].reason, f"{said}: {quoted}" + (f"; and {more} more" if more > 0 else "")


def _degraded(obs: Observation) -> ConditionFields:
    if obs.problems:
        return True, obs.problems[0].reason, "; ".join(p.message for p in obs.problems)
    return False, "AsExpected", "no problems found"


def stalled_warning(
    previous: PDClusterStatus, status: PDClusterStatus, problems: list[Problem]
) -> tuple[str, str] | None:
    """(reason, message) of the Warning event when Stalled turns True or changes reason;
    None when Degraded's warning says the same already."""
    stalled = next((c for c in status.conditions if c.type == "Stalled"), None)
    if stalled is None or stalled.status != "True" or (problems and problems[0].reason == stalled.reason):
        return None
    before = next((c for c in previous.conditions if c.type == "Stalled"), None)
    if before is not None and before.status == "True" and before.reason == stalled.reason:
        return None
    return stalled.reason, stalled.message
