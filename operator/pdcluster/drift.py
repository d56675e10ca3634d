"""Does a live object still hold everything we would apply? (pure)

At rest the operator must not write. Server-side apply of an unchanged object is still a
PATCH, so before applying we check that every field we render is present in the live
object with an equal value. Extra live fields (defaults, other managers' fields, status)
are fine; a missing or different one is drift and triggers an apply.

A field we stopped rendering is still in the live object, so that check alone never
sees a removal. Each applied object therefore carries a hash of what we rendered
(`stamp`): when the rendering changes, so does the hash, the apply happens, and
server-side apply prunes what our field manager set before and no longer sends.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from pdcluster import constants as C
from pdcluster.api.base import quantity


def _empty(value: Any) -> bool:
    """Values the apiserver leaves out of a stored object (Go's omitempty)."""
    return value is None or value is False or (not isinstance(value, bool) and value in ({}, [], "", 0))


def differences(desired: Any, live: Any, path: str = "") -> list[str]:
    """Paths where `live` does not hold `desired`; empty when in sync."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return [] if _empty(desired) and live is None else [path or "/"]
        out: list[str] = []
        for key, want in desired.items():
            if key in live:
                out += differences(want, live[key], f"{path}.{key}")
            elif not _empty(want):
                out.append(f"{path}.{key}")
        return out
    if isinstance(desired, list):
        if not isinstance(live, list):
            return [] if _empty(desired) and live is None else [path]
        if len(desired) != len(live):
            return [path]
        out = []
        for i, (want, have) in enumerate(zip(desired, live, strict=True)):
            out += differences(want, have, f"{path}[{i}]")
        return out
    if desired == live or str(desired) == str(live):
        return []
    a, b = quantity(desired), quantity(live)
    if a is not None and b is not None and a == b:
        return []
    return [path]


def stamp(desired: dict[str, Any]) -> dict[str, Any]:
    """`desired` with the hash of its own content in an annotation."""
    digest = hashlib.sha256(orjson.dumps(desired, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
    meta = desired.get("metadata", {})
    annotations = {**meta.get("annotations", {}), C.ANNOTATION_RENDERED: digest}
    return {**desired, "metadata": {**meta, "annotations": annotations}}


def in_sync(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    if live is None:
        return False
    meta = desired.get("metadata", {})
    live_meta = live.get("metadata", {})
    for key in ("labels", "annotations", "ownerReferences"):
        if key in meta and differences(meta[key], live_meta.get(key)):
            return False
    body = {k: v for k, v in desired.items() if k not in ("metadata", "apiVersion", "kind")}
    return not differences(body, live)


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: removed keys become
    null, so a status field that disappears is really deleted."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch
