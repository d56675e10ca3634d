"""The children of every PDCluster as the watches see them, so that a reconcile reads
them from memory instead of asking the apiserver one by one.

kopf keeps an index per child kind (`@kopf.index`, filled by the watches that already
run to wake PDClusters) and starts no handler before every kind's first list has been
indexed (kopf _core/reactor/processing.py: operator_indexed), so a worker never sees a
half-filled cache. Values are keyed by (namespace, owning PDCluster's name)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdcluster import constants as C

# (group, version, plural) -> kind, for every kind the operator renders.
KINDS = {
    ("apps", "v1", "statefulsets"): "StatefulSet",
    ("apps", "v1", "deployments"): "Deployment",
    ("", "v1", "services"): "Service",
    ("", "v1", "configmaps"): "ConfigMap",
    ("", "v1", "serviceaccounts"): "ServiceAccount",
    ("policy", "v1", "poddisruptionbudgets"): "PodDisruptionBudget",
    ("rbac.authorization.k8s.io", "v1", "roles"): "Role",
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): "RoleBinding",
    # HPA/KEDA scaling a role in `external` mode must take effect at once.
    (C.GROUP, C.VERSION, C.SCALER_PLURAL): C.SCALER_KIND,
}


def owner_of(body: Mapping[str, Any]) -> str | None:
    for ref in body["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == C.KIND and ref.get("apiVersion", "").startswith(f"{C.GROUP}/"):
            return str(ref["name"])
    return None


class Children:
    def __init__(self) -> None:
        self.indexes: dict[str, Mapping[Any, Any]] = {}  # kind -> kopf.Index

    def covers(self, kind: str) -> bool:
        return kind in self.indexes

    def get(self, kind: str, namespace: str, owner: str, name: str) -> dict[str, Any] | None:
        store = self.indexes[kind].get((namespace, owner)) or ()
        return next((body for body in store if body["metadata"]["name"] == name), None)
