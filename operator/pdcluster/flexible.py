"""The flexible pool's one rule, shared by the router that applies it and the status
that reports it: of n ready engines in pool order, the first `prefill_engines` act as
prefill and the rest as decode, at least one of each; a lone engine serves requests
whole (a kv_both engine can). A change of that number is a flip: engines change role by
routing alone, no pod restarts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pdcluster import constants as C

if TYPE_CHECKING:
    from pdcluster.api.v1alpha1 import AutoscalingState, PDClusterSpec, RoleFlips


def assignment(spec: PDClusterSpec, state: AutoscalingState | None) -> tuple[int, int]:
    """(engines to act as prefill, engines in the pool): the law's split where it sizes the
    pool (autoscaling in `auto` mode, once it has decided), else prefill.replicas of
    prefill.replicas + decode.replicas."""
    from pdcluster.api.v1alpha1 import AutoscalingMode

    a = spec.autoscaling
    decided = state is not None and state.prefill is not None and state.decode is not None
    if a.enabled and a.mode == AutoscalingMode.auto and decided:
        return state.prefill, state.prefill + state.decode
    return spec.prefill.replicas, spec.prefill.replicas + spec.decode.replicas


def prefill_engines(spec: PDClusterSpec, state: AutoscalingState | None = None) -> int:
    """How many engines of the flexible pool are to act as prefill (`assignment`)."""
    return assignment(spec, state)[0]


def acting(engines: int, prefill_engines: int) -> tuple[int, int]:
    """(prefill, decode) engines of a flexible pool of `engines` as the law counts them: a
    lone engine computes every prompt, so it counts as prefill (`acting_roles`)."""
    return (1, 0) if engines == 1 else split(engines, prefill_engines)


def split(engines: int, prefill_engines: int) -> tuple[int, int]:
    """(prefill, decode) engines of a flexible pool of `engines` ready ones; (0, 0) for
    fewer than two, which cannot hand KV over."""
    if engines < 2:
        return 0, 0
    prefill = min(max(prefill_engines, 1), engines - 1)
    return prefill, engines - prefill


def record_flip(
    spec: PDClusterSpec, state: AutoscalingState | None, previous: RoleFlips | None, now: str
) -> RoleFlips:
    """The assignment this reconcile applies, counting the engines it moves against the
    last one recorded; the first assignment moves none. Engines act as prefill in pool
    order, so a change of the count by k moves k engines, whatever the pool's size."""
    from pdcluster.api.v1alpha1 import RoleFlips

    wanted, engines = assignment(spec, state)
    if previous is None:
        return RoleFlips(prefill_engines=wanted)
    moved = wanted - previous.prefill_engines
    if moved == 0:
        return previous
    way = "decode -> prefill" if moved > 0 else "prefill -> decode"
    noun = "engine" if abs(moved) == 1 else "engines"
    return RoleFlips(
        prefill_engines=wanted,
        flips=previous.flips + abs(moved),
        last_flip=f"{abs(moved)} {noun} {way}: prefill engines {previous.prefill_engines} -> {wanted} of {engines}",
        last_flip_time=now,
    )


def flip_event(previous: RoleFlips | None, current: RoleFlips | None) -> tuple[str, str] | None:
    """(reason, message) of the Normal event for a flip this reconcile recorded."""
    if current is None or previous is None or current.flips == previous.flips or current.last_flip is None:
        return None
    return "RolesFlipped", current.last_flip


def _ordinal(pod: Mapping[str, Any]) -> int:
    tail = pod["metadata"]["name"].rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    deleting = (pod.get("metadata") or {}).get("deletionTimestamp")
    return not deleting and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def acting_roles(pods: Iterable[Mapping[str, Any]], prefill_engines: int) -> dict[str, str | None]:
    """Each pool pod's role as the routers apply the rule (router/membership.py): of the
    ready pods in ordinal order the first `prefill_engines` prefill, the rest decode; None
    for a pod not ready. A lone engine serves requests whole and is filed as prefill: it
    computes every prompt, and the router's series show its streams."""
    pool = [p for p in pods if (p["metadata"].get("labels") or {}).get(C.LABEL_ROLE) == C.ROLE_FLEXIBLE]
    ready = sorted((p for p in pool if _ready(p)), key=lambda p: (_ordinal(p), p["metadata"]["name"]))
    prefill, _ = split(len(ready), prefill_engines)
    roles: dict[str, str | None] = {p["metadata"]["name"]: None for p in pool}
    if len(ready) == 1:
        roles[ready[0]["metadata"]["name"]] = C.ROLE_PREFILL
    if len(ready) >= 2:
        for n, pod in enumerate(ready):
            roles[pod["metadata"]["name"]] = C.ROLE_PREFILL if n < prefill else C.ROLE_DECODE
    return roles


def relabels(pods: Iterable[Mapping[str, Any]], prefill_engines: int) -> dict[str, str | None]:
    """The pods whose acting-role label differs from `acting_roles`, with the value to set
    (None: remove it)."""
    pods = list(pods)
    wanted = acting_roles(pods, prefill_engines)
    now = {p["metadata"]["name"]: (p["metadata"].get("labels") or {}).get(C.LABEL_ACTING_ROLE) for p in pods}
    return {name: role for name, role in wanted.items() if now.get(name) != role}
