"""KubeConfig from kubeconfigs as users have them (no server: what is read, and the
tokens an exec credential plugin hands out)."""

from __future__ import annotations

import base64
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml

from pdcluster.io.kube import KubeConfig

CA = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nnot parsed here\n-----END CERTIFICATE-----\n").decode()


def write(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def cluster(name: str = "c", server: str = "https://127.0.0.1:6443") -> dict:
    return {"name": name, "cluster": {"server": server, "certificate-authority-data": CA}}


def context(user: str, name: str = "ctx", namespace: str | None = None) -> dict:
    ctx = {"cluster": "c", "user": user, **({"namespace": namespace} if namespace else {})}
    return {"name": name, "context": ctx}


def kubeconfig(users: list[dict], contexts: list[dict], current: str = "ctx") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster()],
        "users": users,
        "contexts": contexts,
        "current-context": current,
    }


def plugin(tmp_path: Path, lifetime_s: float) -> Path:
    """An exec credential plugin handing out token-1, token-2, ... each valid `lifetime_s`."""
    script = tmp_path / "plugin.py"
    script.write_text(
        f"""#!{sys.executable}
import datetime, json, pathlib
count = pathlib.Path({str(tmp_path / "count")!r})
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds={lifetime_s})
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {{"token": f"token-{{n}}", "expirationTimestamp": expiry.strftime("%Y-%m-%dT%H:%M:%SZ")}}}}))
"""
    )
    script.chmod(0o755)
    return script


def test_a_token_user_in_a_namespace(tmp_path: Path) -> None:
    path = write(
        tmp_path / "config",
        kubeconfig([{"name": "u", "user": {"token": "abc"}}], [context("u", namespace="serving")]),
    )
    cfg = KubeConfig.from_file(path)
    assert (cfg.server, cfg.namespace, cfg.bearer()) == ("https://127.0.0.1:6443", "serving", "abc")
    assert cfg.ca_file and Path(cfg.ca_file).read_text().startswith("-----BEGIN CERTIFICATE-----")


def test_client_certificates_and_another_context(tmp_path: Path) -> None:
    cert, key = base64.b64encode(b"cert").decode(), base64.b64encode(b"key").decode()
    users = [
        {"name": "tok", "user": {"token": "abc"}},
        {"name": "cert", "user": {"client-certificate-data": cert, "client-key-data": key}},
    ]
    path = write(tmp_path / "config", kubeconfig(users, [context("tok"), context("cert", name="admin")]))
    cfg = KubeConfig.from_file(path, context="admin")
    assert cfg.bearer() is None and cfg.namespace == "default"
    assert cfg.cert_file and Path(cfg.cert_file).read_bytes() == b"cert"
    assert cfg.key_file and Path(cfg.key_file).read_bytes() == b"key"


def test_several_files_in_kubeconfig_merge(tmp_path: Path, monkeypatch) -> None:
    clusters = write(tmp_path / "clusters", {"apiVersion": "v1", "kind": "Config", "clusters": [cluster()]})
    rest = kubeconfig([{"name": "u", "user": {"token": "from-the-second-file"}}], [context("u")])
    del rest["clusters"]
    users = write(tmp_path / "users", rest)
    monkeypatch.setenv("KUBECONFIG", f"{users}{os.pathsep}{clusters}")
    cfg = KubeConfig.load()
    assert (cfg.server, cfg.bearer()) == ("https://127.0.0.1:6443", "from-the-second-file")


async def test_an_exec_plugin_is_asked_again_once_its_token_expires(
    tmp_path: Path, wait_until: Callable[..., Awaitable[Any]]
) -> None:
    exec_user = {
        "apiVersion": "client.authentication.k8s.io/v1",
        # The loader renews 5 minutes before expiry (kube_config.py EXPIRY_SKEW_PREVENTION_DELAY).
        "command": str(plugin(tmp_path, lifetime_s=5 * 60 + 1.5)),
        "interactiveMode": "Never",
    }
    path = write(
        tmp_path / "config", kubeconfig([{"name": "u", "user": {"exec": exec_user}}], [context("u")])
    )
    cfg = KubeConfig.from_file(path)
    assert cfg.bearer() == "token-1"
    assert cfg.bearer() == "token-1"  # still valid: the plugin is not run again
    # The plugin's token expires 1.5 s after it was issued (counting the renewal skew).
    await wait_until(lambda: cfg.bearer() != "token-1", timeout=10, message="a token renewed")
    assert cfg.bearer() == "token-2"


def test_in_cluster_the_service_account_token_is_read(tmp_path: Path, monkeypatch) -> None:
    from kubernetes.config import incluster_config

    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "ca.crt").write_text("ca")
    (tmp_path / "namespace").write_text("serving")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setattr("pdcluster.io.kube.SERVICE_ACCOUNT_DIR", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    cfg = KubeConfig.in_cluster()
    assert (cfg.server, cfg.namespace, cfg.bearer()) == ("https://127.0.0.1:443", "serving", "sa-token")


def test_bodies_with_integers_past_64_bits_still_reach_the_apiserver() -> None:
    """orjson refuses them; the apiserver is the one to say they are out of range."""
    from pdcluster.io.kube import _json, yaml_json

    body = {"spec": {"replicas": 2**70, "name": "ok"}}
    assert json.loads(_json(body)) == body
    assert json.loads(yaml_json(body)) == body
    assert yaml_json({"a": 1}) == b'{"a":1}'
