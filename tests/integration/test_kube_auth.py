"""Authentication as users have it, against the local apiserver: an exec credential
plugin (as EKS', GKE's and AKS' kubeconfigs use) hands the client its token."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from localcluster.kubeconfig import request_token
from pdcluster.io.kube import Kube, KubeConfig

pytestmark = pytest.mark.cluster


async def test_an_exec_plugin_token_authenticates(kube: Kube, namespace: str, tmp_path: Path) -> None:
    sa = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "exec-user", "namespace": namespace},
    }
    await kube.create(sa)
    token = await request_token(kube, namespace, "exec-user", expiration_seconds=3600)
    plugin = tmp_path / "credential-plugin"
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": token},
    }
    plugin.write_text(f"#!{sys.executable}\nprint({json.dumps(json.dumps(credential))})\n")
    plugin.chmod(0o755)
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": str(plugin),
            "interactiveMode": "Never",
        }
    }
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {"server": kube.config.server, "certificate-authority": kube.config.ca_file},
            }
        ],
        "users": [{"name": "plugin", "user": user}],
        "contexts": [
            {"name": "local", "context": {"cluster": "local", "user": "plugin", "namespace": namespace}}
        ],
        "current-context": "local",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))

    async with Kube(KubeConfig.from_file(path)) as client:
        review = await client.request(
            "POST",
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        )
    assert review["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:exec-user"
    assert client.config.namespace == namespace
