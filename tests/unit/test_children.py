"""The children cache reconcile reads instead of the apiserver, and what a worker treats
as a transient failure (a warning and a retry, no traceback)."""

from __future__ import annotations

from datetime import UTC, datetime

import aiohttp
from fakekube import FakeKube
from test_reconcile import pdcluster

from pdcluster import constants as C
from pdcluster.children import Children, owner_of
from pdcluster.controller import transient
from pdcluster.io.events import EventRecorder
from pdcluster.io.kube import ApiError
from pdcluster.reconcile import Context, reconcile


def owned(kind: str, name: str, owner: str = "c") -> dict:
    ref = {"apiVersion": C.API_VERSION, "kind": C.KIND, "name": owner, "uid": "u"}
    return {"kind": kind, "metadata": {"name": name, "namespace": "ns", "ownerReferences": [ref]}}


def test_a_child_is_found_by_its_owner_and_name() -> None:
    sts = owned("StatefulSet", "c-prefill")
    children = Children()
    children.indexes = {"StatefulSet": {("ns", "c"): [sts, owned("StatefulSet", "c-decode")]}}
    assert children.get("StatefulSet", "ns", "c", "c-prefill") is sts
    assert children.get("StatefulSet", "ns", "c", "c-router") is None
    assert children.get("StatefulSet", "ns", "other", "c-prefill") is None
    assert children.covers("StatefulSet") and not children.covers("Secret")
    assert owner_of(sts) == "c" and owner_of({"metadata": {}}) is None


async def test_a_reconcile_at_rest_reads_nothing_from_the_apiserver() -> None:
    kube = FakeKube()
    body = pdcluster(kube)
    ctx = Context(kube=kube, events=EventRecorder(kube), clock=lambda: datetime(2026, 12, 1, tzinfo=UTC))  # type: ignore[arg-type]
    await reconcile(ctx, body)
    by_kind: dict[str, dict] = {}
    for (kind, ns, _), stored in kube.objects.items():
        obj = kube._live(stored)
        owner = owner_of(obj) if obj["metadata"].get("ownerReferences") else None
        if owner:
            by_kind.setdefault(kind, {}).setdefault((ns, owner), []).append(obj)
    ctx.children = Children()
    ctx.children.indexes = by_kind
    reads = []
    original = kube.get

    async def counted(*args: object, **kwargs: object) -> object:
        reads.append(args[:3])
        return await original(*args, **kwargs)  # type: ignore[arg-type]

    kube.get = counted  # type: ignore[method-assign]
    kube.writes.clear()
    await reconcile(ctx, kube.live(C.KIND, "c") or body)
    assert reads == [] and kube.writes == []


def test_transient_failures_are_retried_quietly() -> None:
    assert transient(ApiError(503, "ServiceUnavailable", "storage is (re)initializing"))
    assert transient(ApiError(429, "TooManyRequests", "slow down"))
    assert transient(TimeoutError()) and transient(aiohttp.ClientConnectionError("reset"))
    assert not transient(ApiError(422, "Invalid", "spec.replicas: must be >= 0"))
    assert not transient(KeyError("metadata"))
