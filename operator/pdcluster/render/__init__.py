"""Pure rendering: a PDCluster spec (and the replica counts decided elsewhere) in,
Kubernetes manifests out. No I/O, no clock, no kopf."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster import constants as C
from pdcluster import flexible
from pdcluster.api.v1alpha1 import AutoscalingMode, AutoscalingState, PDClusterSpec, ServingMode
from pdcluster.render.engine import build_role
from pdcluster.render.model import build_model
from pdcluster.render.mooncake import build_mooncake
from pdcluster.render.names import Owner
from pdcluster.render.network import build_network_policies
from pdcluster.render.router import build_router

__all__ = ["Owner", "Replicas", "apply_stage", "render_all"]


@dataclass(frozen=True)
class Replicas:
    prefill: int
    decode: int
    colocated: int = 0
    flexible: int = 0
    flexible_prefill: int = 0  # of the flexible pool's engines, how many the routers make prefill

    def of(self, role: str) -> int:
        counts = {
            C.ROLE_PREFILL: self.prefill,
            C.ROLE_DECODE: self.decode,
            C.ROLE_COLOCATED: self.colocated,
            C.ROLE_FLEXIBLE: self.flexible,
        }
        if role not in counts:
            raise ValueError(f"no engine role {role!r} (prefill, decode, colocated or flexible)")
        return counts[role]

    @classmethod
    def choose(
        cls, spec: PDClusterSpec, state: AutoscalingState | None, external: dict[str, int] | None = None
    ) -> Replicas:
        """The one place role replica counts come from: zero when suspended; the
        autoscaler's decision (kept in status) in `auto` mode; the PDRoleScalers in
        `external` mode; otherwise the spec. The spec is never rewritten, so GitOps tools
        never see it drift, and each mode has exactly one writer."""
        if spec.suspend:
            return cls(0, 0)
        a = spec.autoscaling
        source: dict[str, int | None] = {}
        if a.enabled and a.mode == AutoscalingMode.auto and state is not None:
            source = {role: _decided(state, role) for role in spec.engine_roles}
        elif a.enabled and a.mode == AutoscalingMode.external and external is not None:
            source = external
        counts: dict[str, int] = {}
        for role in spec.engine_roles:  # a pool this mode does not run has none
            r = spec.role(role)
            wanted = source.get(role)
            counts[role] = r.replicas if wanted is None else min(max(wanted, r.min_replicas), r.max_replicas)
        prefill = flexible.prefill_engines(spec, state) if spec.mode == ServingMode.flexible else 0
        return cls(*(counts.get(role, 0) for role in (*C.ENGINE_ROLES, C.ROLE_COLOCATED, C.ROLE_FLEXIBLE)), prefill)


def _decided(state: AutoscalingState, role: str) -> int | None:
    """The law's count for a role's workload; a flexible pool holds both roles' engines."""
    if role == C.ROLE_FLEXIBLE:
        return None if state.prefill is None or state.decode is None else state.prefill + state.decode
    return getattr(state, role)


def render_all(
    spec: PDClusterSpec, owner: Owner, replicas: Replicas, partitions: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """Every child of one PDCluster, in apply order (config and services before workloads).
    `partitions`: the engine StatefulSets' rollout partitions (rollout.py), 0 if absent."""
    objects = build_model(spec, owner) + build_mooncake(spec, owner, suspended=spec.suspend)
    for role in spec.engine_roles:
        objects += build_role(spec, owner, role, replicas.of(role), (partitions or {}).get(role, 0))
    objects += build_router(spec, owner, suspended=spec.suspend, prefill_engines=replicas.flexible_prefill)
    objects += build_network_policies(spec, owner)
    _pull_secrets(objects, [{"name": ref.name} for ref in spec.image_pull_secrets])
    return sorted(objects, key=apply_stage)


def pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs of a workload: a template's, or a LeaderWorkerSet's leader and worker."""
    spec = obj.get("spec") or {}
    if "template" in spec:
        return [spec["template"]["spec"]]
    group = spec.get("leaderWorkerTemplate") or {}
    return [t["spec"] for t in (group.get("leaderTemplate"), group.get("workerTemplate")) if t]


def _pull_secrets(objects: list[dict[str, Any]], refs: list[dict[str, str]]) -> None:
    """Every pod the operator renders pulls with the same secrets: one place for all kinds."""
    if refs:
        for obj in objects:
            for pod in pod_specs(obj):
                pod["imagePullSecrets"] = refs


# What must exist before what: a Role before its binding, Services and network policies
# before the pods they serve or admit; workloads last.
_STAGES = {
    "ConfigMap": 0,
    "ServiceAccount": 0,
    "Role": 1,
    "RoleBinding": 2,
    "Service": 3,
    "PodDisruptionBudget": 4,
    "NetworkPolicy": 4,
    "PersistentVolumeClaim": 4,  # before the Job and the engines that mount it
}


def apply_stage(obj: dict[str, Any]) -> int:
    """Objects of one stage may be applied together; stages go in order."""
    return _STAGES.get(obj["kind"], 5)
