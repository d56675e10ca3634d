"""Child names, labels and the owner reference: the vocabulary every builder shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdcluster import __version__
from pdcluster import constants as C

if TYPE_CHECKING:
    from pdcluster.api.v1alpha1 import SecretKeyRef


@dataclass(frozen=True)
class Owner:
    """The PDCluster the children belong to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(meta["name"], meta.get("namespace", "default"), meta.get("uid", ""))

    def child(self, role: str) -> str:
        return f"{self.name}-{role}"

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": C.API_VERSION,
            "kind": C.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def selector(owner: Owner, role: str) -> dict[str, str]:
    """Labels that select one role's pods; immutable once a workload exists."""
    return {C.LABEL_CLUSTER: owner.name, C.LABEL_ROLE: role}


def labels(owner: Owner, role: str) -> dict[str, str]:
    """Labels for pods and objects. No version label here: putting the operator's
    version into pod templates would roll every engine on each operator upgrade."""
    return {
        C.LABEL_NAME: C.APP_NAME,
        C.LABEL_INSTANCE: owner.name,
        C.LABEL_COMPONENT: role,
        C.LABEL_PART_OF: C.APP_NAME,
        C.LABEL_MANAGED_BY: C.MANAGED_BY,
        **selector(owner, role),
    }


def metadata(owner: Owner, role: str, name: str | None = None, **extra: Any) -> dict[str, Any]:
    meta = {
        "name": name or owner.child(role),
        "namespace": owner.namespace,
        "labels": {**labels(owner, role), C.LABEL_VERSION: __version__},
        "ownerReferences": [owner.reference()],
    }
    meta.update(extra)
    return meta


def scrape_annotations(port: int, path: str = "/metrics") -> dict[str, str]:
    return {C.ANNOTATION_SCRAPE: "true", C.ANNOTATION_SCRAPE_PORT: str(port), C.ANNOTATION_SCRAPE_PATH: path}


def env_field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def env_secret(name: str, ref: SecretKeyRef) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


# The OpenTelemetry SDK (vLLM's) and the router both read the export's headers from here.
TRACES_HEADERS_ENV = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"


def restricted_pod() -> dict[str, Any]:
    """Pod security context meeting the Kubernetes "restricted" Pod Security Standard."""
    return {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def restricted_container(*, read_only_root: bool = True) -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
