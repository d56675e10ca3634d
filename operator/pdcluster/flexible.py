"""The flexible pool's one rule, shared by the router that applies it and the status
that reports it: of n ready engines in pool order, the first `prefill_engines` act as
prefill and the rest as decode, at least one of each; a lone engine serves requests
whole (a kv_both engine can). A change of that number is a flip: engines change role by
routing alone, no pod restarts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.api.v1alpha1 import PDClusterSpec, RoleFlips


def prefill_engines(spec: PDClusterSpec) -> int:
    """How many engines of the flexible pool are to act as prefill: prefill.replicas (the
    pool holds prefill.replicas + decode.replicas engines)."""
    return spec.prefill.replicas


def split(engines: int, prefill_engines: int) -> tuple[int, int]:
    """(prefill, decode) engines of a flexible pool of `engines` ready ones; (0, 0) for
    fewer than two, which cannot hand KV over."""
    if engines < 2:
        return 0, 0
    prefill = min(max(prefill_engines, 1), engines - 1)
    return prefill, engines - prefill


def record_flip(spec: PDClusterSpec, previous: RoleFlips | None, now: str) -> RoleFlips:
    """The assignment this reconcile applies, counting the engines it moves against the
    last one recorded; the first assignment moves none."""
    from pdcluster.api.v1alpha1 import RoleFlips

    wanted = prefill_engines(spec)
    if previous is None:
        return RoleFlips(prefill_engines=wanted)
    moved = wanted - previous.prefill_engines
    if moved == 0:
        return previous
    engines = spec.prefill.replicas + spec.decode.replicas
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
