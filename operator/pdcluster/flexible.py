"""The flexible pool's one rule, shared by the router that applies it and the status
that reports it: of n ready engines in pool order, the first `prefill_engines` act as
prefill and the rest as decode, at least one of each; a lone engine serves requests
whole (a kv_both engine can)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.api.v1alpha1 import PDClusterSpec


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
