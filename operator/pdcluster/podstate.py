"""Pure readings of a PDCluster's pods: how long each engine took to start, and why a pod
that is not Ready is stuck.

Start-up is a pod's creation to its first Ready condition: image pull, weights load and
warm-up. The kubelet keeps only the Ready condition's last transition, so a pod is
measured at the first reconcile that sees it Ready and kept in status; later readiness
flaps of that pod change nothing. A pod already Ready when it is first seen (pods that
predate the operator) counts with its Ready condition's current transition time.

A stuck pod's reason is the kubelet's or the scheduler's own (core/v1 ContainerStateWaiting
and PodScheduled reasons): `ImagePullBackOff`, `ErrImagePull`, `Unschedulable`,
`CrashLoopBackOff`, `OOMKilled` ..., with the image, the scheduler's message, or the
container's last log lines (its termination message; engines render
`terminationMessagePolicy: FallbackToLogsOnError`, so the kubelet puts the log's tail there).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec, PDClusterStatus, PodStartup, RoleStatus, StartupStatus
from pdcluster.status import Observation, Problem
from pdcluster.timestamps import parse

STARTUP_SAMPLES = 10  # the pods a role's median is taken over
LOG_LINES = 5  # of a crashed container's termination message, in the Stalled condition
# Waiting reasons of a container on its normal way to running: not a problem of their own.
STARTING = frozenset({"ContainerCreating", "PodInitializing"})

Pod = Mapping[str, Any]


def _condition(pod: Pod, type_: str) -> Mapping[str, Any] | None:
    return next(
        (c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == type_), None
    )


def is_ready(pod: Pod) -> bool:
    ready = _condition(pod, "Ready")
    return ready is not None and ready.get("status") == "True"


def startup_seconds(pod: Pod) -> int | None:
    """Creation to Ready in seconds; None while the pod is not Ready."""
    ready = _condition(pod, "Ready")
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    if ready is None or ready.get("status") != "True" or not created or not ready.get("lastTransitionTime"):
        return None
    return max(int((parse(ready["lastTransitionTime"]) - parse(created)).total_seconds()), 0)


def record_startups(previous: StartupStatus | None, pods: Iterable[Pod]) -> StartupStatus | None:
    """`previous` with the start-ups of the pods not measured yet. Once the window is full,
    pods created before its oldest sample count as measured (they were, or predate it)."""
    kept = list(previous.pods) if previous is not None else []
    seen = {(p.pod, p.created) for p in kept}
    oldest = kept[0].created if len(kept) >= STARTUP_SAMPLES else None
    new = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        name, created = meta.get("name", ""), meta.get("creationTimestamp", "")
        seconds = startup_seconds(pod)
        if seconds is None or (name, created) in seen:
            continue
        if oldest is not None and parse(created) < parse(oldest):
            continue
        new.append(PodStartup(pod=name, created=created, seconds=seconds))
    if not new:
        return previous
    recent = sorted(kept + new, key=lambda p: (parse(p.created), p.pod))[-STARTUP_SAMPLES:]
    median = round(statistics.median(p.seconds for p in recent))
    return StartupStatus(last_seconds=recent[-1].seconds, median_seconds=median, pods=recent)


def pod_problem(pod: Pod) -> Problem | None:
    """Why a pod that is not Ready is stuck, in the kubelet's or the scheduler's words;
    None for a Ready pod, one on its way out, or one still starting normally."""
    meta = pod.get("metadata") or {}
    if is_ready(pod) or meta.get("deletionTimestamp"):
        return None
    name = meta.get("name", "")
    scheduled = _condition(pod, "PodScheduled")
    if scheduled is not None and scheduled.get("status") == "False":
        reason = scheduled.get("reason") or "Unschedulable"
        return Problem(reason, f"pod {name}: {scheduled.get('message') or reason}")
    status = pod.get("status") or {}
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        found = _container_problem(name, container)
        if found is not None:
            return found
    return None


def _container_problem(pod: str, container: Mapping[str, Any]) -> Problem | None:
    where = f"pod {pod} container {container.get('name', '')}"
    state = container.get("state") or {}
    waiting = state.get("waiting") or {}
    terminated = state.get("terminated") or (container.get("lastState") or {}).get("terminated") or {}
    if terminated.get("reason") == "OOMKilled":
        restarts = container.get("restartCount", 0)
        return Problem("OOMKilled", f"{where}: killed for exceeding its memory limit ({restarts} restarts)")
    reason = waiting.get("reason")
    if not reason and container.get("restartCount", 0) and terminated.get("exitCode"):
        reason = "CrashLoopBackOff"  # between two back-offs: restarted, not Ready yet
    if not reason or reason in STARTING:
        return None
    if reason == "CrashLoopBackOff":
        code = terminated.get("exitCode")
        tail = _last_lines(terminated.get("message") or "")
        said = f"; last log lines: {tail}" if tail else ""
        return Problem(
            reason, f"{where}: exited with code {code} ({container.get('restartCount', 0)} restarts){said}"
        )
    image = container.get("image")
    detail = waiting.get("message") or reason
    return Problem(
        reason, f"{where}: {detail}" + (f" (image {image})" if image and image not in detail else "")
    )


def _last_lines(text: str) -> str:
    """The log's last lines on one line, as condition messages are shown."""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-LOG_LINES:])


def observe_pods(
    obs: Observation, spec: PDClusterSpec, previous: PDClusterStatus, pods: Iterable[Pod]
) -> None:
    """Fill `obs` with the engine start-ups measured so far and why pods are not Ready
    (engines first)."""
    by_role: dict[str, list[Pod]] = {}
    for pod in pods:
        by_role.setdefault(
            ((pod.get("metadata") or {}).get("labels") or {}).get(C.LABEL_ROLE, ""), []
        ).append(pod)
    for role in spec.engine_roles:
        before: RoleStatus | None = getattr(previous, role, None)
        obs.startups[role] = record_startups(before.startup if before else None, by_role.get(role, []))
    for role in (*spec.engine_roles, C.ROLE_ROUTER, C.ROLE_MOONCAKE_MASTER, C.ROLE_MOONCAKE_STORE):
        obs.stuck += [p for pod in by_role.get(role, []) if (p := pod_problem(pod)) is not None]
