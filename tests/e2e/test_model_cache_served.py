"""The model cache (`model.source: cache`) on the real-vLLM local cluster: the operator's
claim is bound to a hostPath PersistentVolume (no provisioner runs here), its download
Job fetches the tiny model from a Hugging Face-compatible server on loopback
(`model.hubEndpoint`, hubserver.py), and real vLLM engines serve it from the claim.

What a user relies on: the first fill downloads every file once; scaling decode 1 -> 3
downloads nothing more (the server's request log); the engines serve with the hub
unreachable; ModelReady says how much was downloaded; a bad source is the apiserver's
clear error."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import install_crd, settled, start_operator, wait_until
from hubserver import HubServer

from pdcluster import constants as C
from pdcluster.io.kube import ApiError, Kube, KubeConfig

pytestmark = [pytest.mark.cluster, pytest.mark.vllm]

NAME = "cached"
REPO_ID = "pdcluster/tiny-llama"
STORAGE_CLASS = "local-rwx"
STARTUP_S = 900  # real vLLM engines on two shared cores, several starting at once
SERVED = f"/models/{REPO_ID}/main"  # model.cache's directory for revision main


def pdcluster(namespace: str, hub_url: str, decode: int) -> dict[str, Any]:
    return {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {
                "name": REPO_ID,
                "servedModelName": "tiny",
                "maxModelLen": 512,
                "source": "cache",
                "cache": {"size": "1Gi", "storageClassName": STORAGE_CLASS},
                "hubEndpoint": hub_url,
            },
            "engine": {
                "shmSize": "1Gi",
                "startupProbe": {"periodSeconds": 2, "failureThreshold": 450},
                "readinessProbe": {"periodSeconds": 1},
                "terminationGracePeriodSeconds": 30,
            },
            "router": {"image": "pdcluster/router:0.1.0", "admission": {"enabled": False}},
            "prefill": {"replicas": 1},
            "decode": {"replicas": decode, "maxReplicas": 3},
        },
    }


def host_volume(name: str, path: Path) -> dict[str, Any]:
    """What a storage administrator (or a provisioner) provides: a ReadWriteMany volume."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": STORAGE_CLASS,
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
        },
    }


def condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in ((body or {}).get("status") or {}).get("conditions", []) if c["type"] == type_), None)


async def test_the_cache_is_filled_once_and_serves_offline(vllm_cluster: Any, tmp_path: Path) -> None:
    namespace = f"cache-{uuid.uuid4().hex[:5]}"
    hub = HubServer(REPO_ID, _tiny_model()).start()
    async with Kube(KubeConfig.from_file(vllm_cluster.kubeconfig)) as kube:
        await install_crd(kube)
        await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        await wait_until(lambda: kube.get("v1", "ServiceAccount", "default", namespace), 30, message="default SA")
        volume = host_volume(namespace, tmp_path / "volume")
        await kube.create(volume)
        operator = start_operator(vllm_cluster.kubeconfig, namespace, tmp_path / "operator.log")
        try:
            await _bad_sources_are_refused(kube, namespace, hub.url)
            await kube.apply(pdcluster(namespace, hub.url, decode=1), field_manager="kubectl-test")
            body = await _wait(kube, namespace, 1)
            files = sorted(hub.files)
            # The first fill: every file's contents sent exactly once.
            assert sorted(hub.downloads()) == files, hub.requests
            ready = condition(body, "ModelReady")
            assert ready is not None and ready["status"] == "True", ready
            total = sum(p.stat().st_size for p in hub.files.values())
            assert body["status"]["model"]["bytes"] == total and body["status"]["model"]["files"] == len(files)
            assert f"({total} bytes)" in ready["message"]
            assert sorted(p.name for p in (tmp_path / "volume" / REPO_ID / "main").iterdir() if p.is_file()) == sorted(
                [*files, ".pdcluster-complete"]
            )
            seen = len(hub.requests)

            await kube.apply(pdcluster(namespace, hub.url, decode=3), field_manager="kubectl-test")
            await _wait(kube, namespace, 3)
            assert hub.requests[seen:] == [], "scaling decode reached the hub"

            hub.stop()  # the hub unreachable from here on
            decode = await kube.list(
                "v1", "Pod", namespace, label_selector=f"{C.LABEL_CLUSTER}={NAME},{C.LABEL_ROLE}={C.ROLE_DECODE}"
            )
            async with aiohttp.ClientSession() as http:
                for pod in decode:
                    base = f"http://{pod['status']['podIP']}:8000"
                    async with http.get(f"{base}/v1/models") as r:
                        served = (await r.json())["data"][0]
                    assert (served["id"], served["root"]) == ("tiny", SERVED)
                router = await kube.get("v1", "Service", f"{NAME}-router", namespace)
                url = f"http://{router['spec']['clusterIP']}:8000/v1/completions"
                ask = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
                async with http.post(url, json=ask, timeout=aiohttp.ClientTimeout(total=120)) as r:
                    answer = await r.json()
                    assert r.status == 200, answer
                assert answer["usage"]["completion_tokens"] == 8
        finally:
            hub.stop()
            operator.kill(signal.SIGTERM)
            await kube.delete("v1", "Namespace", namespace)
            await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods")
            await kube.delete("v1", "PersistentVolume", volume["metadata"]["name"])
        failures = operator.failures()
        assert not failures, failures[:5]


async def _bad_sources_are_refused(kube: Kube, namespace: str, hub_url: str) -> None:
    bad = pdcluster(namespace, hub_url, decode=1)
    del bad["spec"]["model"]["cache"]
    with pytest.raises(ApiError) as refused:
        await kube.apply(bad, field_manager="kubectl-test")
    assert "source cache needs cache" in refused.value.message
    bad = pdcluster(namespace, hub_url, decode=1)
    bad["spec"]["model"] |= {"source": "pvc", "pvc": {"claimName": "w", "path": "a/../b"}}
    with pytest.raises(ApiError) as refused:
        await kube.apply(bad, field_manager="kubectl-test")
    assert "must not contain '..'" in refused.value.message


async def _wait(kube: Kube, namespace: str, decode: int) -> dict[str, Any]:
    async def up() -> dict[str, Any] | None:
        body = await kube.get(C.API_VERSION, C.KIND, NAME, namespace)
        ready = condition(body, "ModelReady")
        if ready is not None and ready["reason"] == "DownloadFailed":
            pytest.fail(f"the download failed: {ready['message']}")  # no point waiting
        done = settled(body) and ((body or {}).get("status") or {}).get("decode", {}).get("ready") == decode
        return body if done else None

    try:
        return await wait_until(up, timeout=STARTUP_S, interval=2, message=f"Ready with {decode} decode")
    except AssertionError:
        pods = await kube.list("v1", "Pod", namespace)
        states = {p["metadata"]["name"]: (p.get("status") or {}).get("containerStatuses") for p in pods}
        body = await kube.get(C.API_VERSION, C.KIND, NAME, namespace)
        raise AssertionError(f"{(body or {}).get('status')}\n{states}") from None


def _tiny_model() -> Path:
    from localcluster.podrunner import vllm

    return vllm.runtime() / "model"
