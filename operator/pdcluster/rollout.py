"""Coordinated rollouts: prefill and decode move to a new engine revision together.

A prefill and a decode engine can only hand KV to each other when they agree on what the
KV is: the model, the served name, the engine image and its arguments, the connector and
block settings, the hash seed. `render.engine.kv_revision` hashes exactly those into a pod label on
both roles; the router pairs only engines with equal labels (router/routing.py), so an
old prefill never hands KV to a new decode.

StatefulSets roll their roles independently, which alone could leave all of prefill on
the new revision and all of decode on the old one: no compatible pair, no service. So the
operator rolls one pod of each role first (`partition` = replicas - 1) and lets both roles
go on only once each has a new pod and all its pods are Ready: from then on both
revisions have a pair, and each role replaces one pod at a time. Pods that autoscaling
adds come at the new revision (ordinals above the partition), so new capacity serves the
new revision. Level-based: every input is the StatefulSets as they are. A role spanning
nodes is a LeaderWorkerSet, rolled the same way a group at a time (its partition counts
groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster import constants as C


@dataclass(frozen=True)
class Rollout:
    """Partitions to render, and what status says about the rollout."""

    partitions: dict[str, int]
    progress: str | None = None  # e.g. "prefill 1/2, decode 1/3 updated"


def _lws(obj: dict[str, Any]) -> bool:
    return obj.get("kind") == "LeaderWorkerSet"


def _template_revision(sts: dict[str, Any]) -> str | None:
    spec = sts.get("spec") or {}
    template = (
        (spec.get("leaderWorkerTemplate") or {}).get("workerTemplate") if _lws(sts) else spec.get("template")
    )
    labels = (template or {}).get("metadata", {}).get("labels") or {}
    return labels.get(C.LABEL_KV_REVISION)


def plan(revision: str, live: dict[str, dict[str, Any] | None], replicas: dict[str, int]) -> Rollout:
    """The partition of each engine role's StatefulSet for this reconcile."""
    gated = {role: max(replicas[role] - 1, 0) for role in C.ENGINE_ROLES}
    free = dict.fromkeys(C.ENGINE_ROLES, 0)
    existing = {role: sts for role, sts in live.items() if sts is not None}
    if len(existing) < len(C.ENGINE_ROLES):
        return Rollout(free)  # a new PDCluster: nothing to coordinate
    if any(_template_revision(sts) != revision for sts in existing.values()):
        # This apply brings the new revision: one pod of each role first.
        return Rollout(gated, _progress(existing, replicas, revision, starting=True))
    if any(_unobserved(sts) for sts in existing.values()):
        # The controller has not seen the last change: its revisions say nothing yet.
        held = {role: _partition(sts) for role, sts in existing.items()}
        return Rollout(held, _progress(existing, replicas, revision) if any(held.values()) else None)
    rolling = {role: sts for role, sts in existing.items() if _rolling(sts)}
    if not rolling:
        return Rollout(free)
    progress = _progress(existing, replicas, revision)
    if any(_updated(sts) >= 2 for sts in rolling.values()) or all(
        _updated(sts) >= 1 and _all_ready(sts, replicas[role]) for role, sts in rolling.items()
    ):
        return Rollout(free, progress)  # each revision has a ready pair: roll on
    return Rollout(gated, progress)


def _status(sts: dict[str, Any]) -> dict[str, Any]:
    return sts.get("status") or {}


def _unobserved(sts: dict[str, Any]) -> bool:
    return int(_status(sts).get("observedGeneration") or 0) < int(sts["metadata"].get("generation") or 0)


def _partition(sts: dict[str, Any]) -> int:
    spec = sts.get("spec") or {}
    if _lws(sts):
        update = (spec.get("rolloutStrategy") or {}).get("rollingUpdateConfiguration") or {}
        return int(update.get("partition") or 0)
    return int(((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition") or 0)


def _rolling(sts: dict[str, Any]) -> bool:
    status = _status(sts)
    if _lws(sts):  # a LeaderWorkerSet reports no revisions: groups not yet updated
        return _updated(sts) < int((sts.get("spec") or {}).get("replicas") or 0)
    return bool(status.get("updateRevision")) and status.get("currentRevision") != status.get(
        "updateRevision"
    )


def _updated(sts: dict[str, Any]) -> int:
    return int(_status(sts).get("updatedReplicas") or 0)


def _all_ready(sts: dict[str, Any], replicas: int) -> bool:
    return int(_status(sts).get("readyReplicas") or 0) >= replicas


def _progress(
    live: dict[str, dict[str, Any]], replicas: dict[str, int], revision: str, starting: bool = False
) -> str:
    parts = [f"{role} {0 if starting else _updated(live[role])}/{replicas[role]}" for role in C.ENGINE_ROLES]
    return f"{', '.join(parts)} at revision {revision}"
