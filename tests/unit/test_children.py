"""The children cache reconcile reads instead of the apiserver, and what a worker treats
as a transient failure (a warning and a retry, no traceback)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

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
    return {"apiVersion": "apps/v1" if kind == "StatefulSet" else "v1", "kind": kind,
            "metadata": {"name": name, "namespace": "ns", "ownerReferences": [ref]}}  # fmt: skip


def test_a_child_is_found_by_its_owner_and_name() -> None:
    sts = owned("StatefulSet", "c-prefill")
    stored = {**sts, "metadata": {**sts["metadata"], "managedFields": [{"manager": C.FIELD_MANAGER}]}}
    children = Children()
    assert children.put("StatefulSet", stored) == ("ns", "c")
    children.put("StatefulSet", owned("StatefulSet", "c-decode"))
    assert children.put("StatefulSet", {"metadata": {"name": "loose", "namespace": "ns"}}) is None
    assert children.get("StatefulSet", "ns", "c", "c-prefill") == sts  # managedFields are not kept
    assert children.get("StatefulSet", "ns", "c", "c-router") is None
    assert children.get("StatefulSet", "ns", "other", "c-prefill") is None
    assert children.covers("StatefulSet") and not children.covers("Secret")
    assert owner_of(sts) == "c" and owner_of({"metadata": {}}) is None
    assert children.owned("ns", "c") == [
        ("StatefulSet", "c-prefill", "apps/v1"),
        ("StatefulSet", "c-decode", "apps/v1"),
    ]
    assert children.drop("StatefulSet", sts) == ("ns", "c")
    assert [name for _, name, _ in children.owned("ns", "c")] == ["c-decode"]


def test_pods_belong_to_their_cluster_label_keep_no_spec_and_are_never_pruned() -> None:
    labels = {C.LABEL_CLUSTER: "c", C.LABEL_ROLE: C.ROLE_DECODE}
    sts_ref = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "c-decode", "uid": "s"}
    pod = {
        "metadata": {"name": "c-decode-0", "namespace": "ns", "labels": labels, "ownerReferences": [sts_ref]},
        "spec": {"containers": [{"name": "engine", "args": ["--a"] * 100}]},
        "status": {"phase": "Running"},
    }
    children = Children()
    children.put("StatefulSet", owned("StatefulSet", "c-decode"))
    assert children.put("Pod", pod) == ("ns", "c")
    (cached,) = children.pods("ns", "c")
    assert "spec" not in cached and cached["status"] == pod["status"] and cached["kind"] == "Pod"
    assert children.owned("ns", "c") == [("StatefulSet", "c-decode", "apps/v1")]  # pods are not pruned
    assert children.pods("ns", "other") == []
    assert children.drop("Pod", pod) == ("ns", "c") and children.pods("ns", "c") == []


def test_a_relist_replaces_one_namespace_and_names_every_owner_it_touched() -> None:
    children = Children()
    children.put("Service", owned("Service", "a-router", owner="a"))
    elsewhere = owned("Service", "z-router", owner="z")
    elsewhere["metadata"]["namespace"] = "other"
    children.put("Service", elsewhere)
    touched = children.replace("Service", "ns", [owned("Service", "b-router", owner="b")])
    assert touched == {("ns", "a"), ("ns", "b")}  # a lost its child, b gained one: both reconcile
    assert children.get("Service", "ns", "a", "a-router") is None
    assert children.get("Service", "other", "z", "z-router") is not None
    # The items of a list carry no kind; status needs a StatefulSet's to read its revisions.
    listed = owned("StatefulSet", "b-prefill", owner="b")
    del listed["kind"]
    children.replace("StatefulSet", "ns", [listed])
    assert (children.get("StatefulSet", "ns", "b", "b-prefill") or {})["kind"] == "StatefulSet"


async def test_a_reconcile_at_rest_reads_nothing_from_the_apiserver() -> None:
    kube = FakeKube()
    body = pdcluster(kube)
    ctx = Context(kube=kube, events=EventRecorder(kube), clock=lambda: datetime(2026, 12, 1, tzinfo=UTC))  # type: ignore[arg-type]
    await reconcile(ctx, body)
    ctx.children = kube.children()
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


class _Apiserver:
    """Kube.watch as the operator sees it: a list, then events; one kind forbidden."""

    def __init__(self, forbidden: str, events: list[tuple[str, dict]]):
        self.forbidden, self.events, self.watched = forbidden, events, []

    async def watch(self, api_version: str, kind: str, namespace: str | None, *, label_selector: str):
        self.watched.append((kind, namespace, label_selector))
        if kind == self.forbidden:
            raise ApiError(403, "Forbidden", f"cannot list {kind}")
        yield "SYNC", {"items": []}
        for event, obj in self.events if kind == "StatefulSet" else []:
            yield event, obj
        await asyncio.Event().wait()  # a watch that stays open


async def test_the_watches_fill_the_cache_wake_owners_and_sync_without_a_forbidden_kind(
    wait_until: Callable[..., Awaitable[Any]],
) -> None:
    sts = owned("StatefulSet", "c-prefill")
    apiserver = _Apiserver("NetworkPolicy", [("ADDED", sts), ("MODIFIED", sts), ("DELETED", sts)])
    woken: list[tuple[str, str]] = []
    children = Children()
    task = asyncio.create_task(children.run(apiserver, ["ns"], lambda *owner: woken.append(owner)))  # type: ignore[arg-type]
    await asyncio.wait_for(children.synced.wait(), 5)  # a forbidden kind does not hold the rest back
    await wait_until(lambda: len(woken) >= 3, interval=0.01, message="three wake-ups")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert woken == [("ns", "c")] * 3 and children.get("StatefulSet", "ns", "c", "c-prefill") is None
    assert {(ns, sel) for _, ns, sel in apiserver.watched} == {("ns", f"{C.LABEL_MANAGED_BY}={C.MANAGED_BY}")}
