"""Kubeconfig files: the admin's (client certificate) and any ServiceAccount's (a token
from the TokenRequest API), so a test can run the operator with exactly its RBAC."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pdcluster.io.kube import Kube


def write(path: Path, *, name: str, server: str, ca_file: Path, user: dict[str, Any], namespace: str = "default") -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o600)
    return path


async def request_token(
    kube: Kube, namespace: str, service_account: str, *, expiration_seconds: int = 86400,
    audiences: list[str] | None = None, bound_pod: dict[str, Any] | None = None,
) -> str:
    """A token for the ServiceAccount from its `token` subresource (TokenRequest)."""
    spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
    if audiences:
        spec["audiences"] = audiences
    if bound_pod is not None:
        meta = bound_pod["metadata"]
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
    answer = await kube.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    return answer["status"]["token"]


async def for_service_account(
    kube: Kube, path: Path, namespace: str, service_account: str, *, expiration_seconds: int = 86400
) -> Path:
    """Writes a kubeconfig that authenticates as system:serviceaccount:<namespace>:<name>."""
    token = await request_token(kube, namespace, service_account, expiration_seconds=expiration_seconds)
    ca = kube.config.ca_file
    assert ca is not None, "the admin kubeconfig names its CA file"
    return write(
        path, name=f"{namespace}-{service_account}", server=kube.config.server, ca_file=Path(ca),
        user={"token": token}, namespace=namespace,
    )
