"""The children of every PDCluster as the watches see them, so that a reconcile reads
them from memory instead of asking the apiserver one by one.

One list+watch per child kind (and watched namespace), on the operator's
`app.kubernetes.io/managed-by` label: each event updates the cache and wakes the
PDCluster that owns the object. Workers start only once every watch has listed
(`synced`), so no reconcile sees a half-filled cache and takes an existing child for a
missing one. These are plain watches of ours rather than kopf indexes: kopf runs a
handler pipeline per event (diff bases, loggers, keyword arguments) that, for the
twelve thousand children of a thousand PDClusters, was most of the operator's CPU.

Each child is kept as compressed JSON without `managedFields`, which nothing here reads
and which doubles a server-side-applied object: about 1 KB instead of the 30 KB or so
the same object takes as Python dicts. A reconcile decompresses and parses only the
dozen it reads (some 10 us each).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp
import orjson

from pdcluster import constants as C
from pdcluster.io.kube import ApiError, Kube

log = logging.getLogger(__name__)

# (group, version, plural) -> kind, for every kind the operator renders.
KINDS = {
    ("apps", "v1", "statefulsets"): "StatefulSet",
    ("apps", "v1", "deployments"): "Deployment",
    ("", "v1", "services"): "Service",
    ("", "v1", "configmaps"): "ConfigMap",
    ("", "v1", "serviceaccounts"): "ServiceAccount",
    ("policy", "v1", "poddisruptionbudgets"): "PodDisruptionBudget",
    ("networking.k8s.io", "v1", "networkpolicies"): "NetworkPolicy",
    ("rbac.authorization.k8s.io", "v1", "roles"): "Role",
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): "RoleBinding",
    # The model cache's download Job (model.source cache): its end starts the engines.
    ("batch", "v1", "jobs"): "Job",
    # Roles spanning nodes; a cluster without the LeaderWorkerSet API answers 404 (see _watch).
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"): "LeaderWorkerSet",
    # HPA/KEDA scaling a role in `external` mode must take effect at once.
    (C.GROUP, C.VERSION, C.SCALER_PLURAL): C.SCALER_KIND,
    # Not rendered (the workloads' own children), never pruned: read for engine start-up
    # times and for why a pod is stuck (podstate.py).
    ("", "v1", "pods"): "Pod",
}
API_VERSIONS = {
    kind: f"{group}/{version}" if group else version for (group, version, _), kind in KINDS.items()
}
RETRY_SECONDS = 2.0
MAX_RETRY_SECONDS = 30.0

# kind -> (namespace, owning PDCluster) -> child name -> entry()
Index = dict[str, dict[tuple[str, str], dict[str, bytes]]]


def owner_of(body: Mapping[str, Any], kind: str | None = None) -> str | None:
    if kind == "Pod":  # owned by its workload; the cluster label names the PDCluster
        return ((body["metadata"].get("labels") or {}).get(C.LABEL_CLUSTER)) or None
    for ref in body["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == C.KIND and ref.get("apiVersion", "").startswith(f"{C.GROUP}/"):
            return str(ref["name"])
    return None


def entry(kind: str, body: Mapping[str, Any]) -> bytes:
    """What the cache keeps of one child: its body as compressed JSON, less managedFields,
    with its kind (the items of a list carry none; status reads a StatefulSet's)."""
    meta = {key: value for key, value in body["metadata"].items() if key != "managedFields"}
    typed = {"apiVersion": API_VERSIONS[kind], "kind": kind, **body, "metadata": meta}
    if kind == "Pod":
        typed.pop("spec", None)  # an engine pod's spec is most of it, and only status is read
    return zlib.compress(orjson.dumps(typed), 1)


class Children:
    def __init__(self) -> None:
        self.indexes: Index = {kind: {} for kind in KINDS.values()}
        self.synced = asyncio.Event()  # every watch has listed once

    # ------------------------------------------------------------------ reads
    def covers(self, kind: str) -> bool:
        return kind in self.indexes

    def get(self, kind: str, namespace: str, owner: str, name: str) -> dict[str, Any] | None:
        found = self.indexes[kind].get((namespace, owner), {}).get(name)
        return None if found is None else orjson.loads(zlib.decompress(found))

    def owned(self, namespace: str, owner: str) -> list[tuple[str, str, str]]:
        """(kind, name, apiVersion) of every cached child of one PDCluster, its pods aside."""
        return [
            (kind, name, API_VERSIONS[kind])
            for kind, index in self.indexes.items()
            if kind != "Pod"
            for name in index.get((namespace, owner), {})
        ]

    def pods(self, namespace: str, owner: str) -> list[dict[str, Any]]:
        """The pods of one PDCluster's workloads (metadata and status)."""
        found = self.indexes["Pod"].get((namespace, owner), {})
        return [orjson.loads(zlib.decompress(body)) for body in found.values()]

    # ------------------------------------------------------------------ writes
    def put(self, kind: str, body: Mapping[str, Any]) -> tuple[str, str] | None:
        """Cache one child; returns its owner's key (None: not a PDCluster's)."""
        owner = owner_of(body, kind)
        if owner is None:
            return None
        key = (body["metadata"]["namespace"], owner)
        self.indexes[kind].setdefault(key, {})[body["metadata"]["name"]] = entry(kind, body)
        return key

    def drop(self, kind: str, body: Mapping[str, Any]) -> tuple[str, str] | None:
        owner = owner_of(body, kind)
        if owner is None:
            return None
        key = (body["metadata"]["namespace"], owner)
        children = self.indexes[kind].get(key, {})
        children.pop(body["metadata"]["name"], None)
        if not children:
            self.indexes[kind].pop(key, None)
        return key

    def replace(
        self, kind: str, namespace: str | None, items: Iterable[Mapping[str, Any]]
    ) -> set[tuple[str, str]]:
        """A (re)list of one kind in one namespace (None: all): the owners it touched."""
        index = self.indexes[kind]
        before = {key for key in index if namespace is None or key[0] == namespace}
        for key in before:
            del index[key]
        after = {key for item in items if (key := self.put(kind, item)) is not None}
        return before | after

    # ------------------------------------------------------------------ watches
    async def run(self, kube: Kube, namespaces: list[str], wake: Callable[[str, str], None]) -> None:
        """Watch every child kind in `namespaces` (empty: cluster-wide) until cancelled."""
        scopes: list[str | None] = list(namespaces) or [None]
        listed = asyncio.Semaphore(0)
        watches = [
            asyncio.create_task(self._watch(kube, kind, namespace, wake, listed), name=f"watch {kind}")
            for kind in KINDS.values()
            for namespace in scopes
        ]
        try:
            for _ in watches:
                await listed.acquire()
            self.synced.set()
            await asyncio.gather(*watches)
        finally:
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)

    async def _watch(
        self,
        kube: Kube,
        kind: str,
        namespace: str | None,
        wake: Callable[[str, str], None],
        listed: asyncio.Semaphore,
    ) -> None:
        selector = f"{C.LABEL_MANAGED_BY}={C.MANAGED_BY}"
        first = True
        retry = RETRY_SECONDS
        while True:
            try:
                async for event, obj in kube.watch(
                    API_VERSIONS[kind], kind, namespace, label_selector=selector
                ):
                    if event == "SYNC":
                        retry = RETRY_SECONDS  # listed: the apiserver answers again
                        owners = self.replace(kind, namespace, obj["items"])
                        if first:
                            first = False
                            listed.release()
                    else:
                        key = self.drop(kind, obj) if event == "DELETED" else self.put(kind, obj)
                        owners = {key} if key is not None else set()
                    for owner in owners:
                        wake(*owner)
            except (ApiError, aiohttp.ClientError, TimeoutError) as e:
                absent = isinstance(e, ApiError) and e.status in (403, 404)
                if first and absent:
                    # Not allowed or not served (an RBAC or a cluster without the kind):
                    # the rest of the operator works without it; applying such a child
                    # fails and says so in the Degraded condition.
                    first = False
                    listed.release()
                    log.warning("%s watch failed (%s); listing again now and then", kind, e)
                elif not absent:  # still absent: said once, and the Degraded condition says the rest
                    log.warning("%s watch failed (%s); listing again in %gs", kind, e, retry)
                await asyncio.sleep(retry)
                retry = min(retry * 2, MAX_RETRY_SECONDS)


async def cluster_pods(
    children: Children | None, kube: Kube, namespace: str, owner: str
) -> list[dict[str, Any]]:
    """One PDCluster's pods, from the watch cache when there is one."""
    if children is not None and children.covers("Pod"):
        return children.pods(namespace, owner)
    return await kube.list("v1", "Pod", namespace, label_selector=f"{C.LABEL_CLUSTER}={owner}")
