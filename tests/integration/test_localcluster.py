"""The local cluster against its own promises: real apiserver validation, scheduling onto
fake GPU nodes, pods running as real processes on 127.x addresses, Services and DNS from
inside pods, garbage collection, crash loops, graceful deletion, and Prometheus scraping."""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from localcluster import nodes as node_networks
from localcluster import procs
from pdcluster.io.kube import ApiError, Kube, KubeConfig

pytestmark = pytest.mark.cluster

GPU = "nvidia.com/gpu"
RDMA = "rdma/rdma_shared_device_a"
Obj = dict[str, Any]

# A web server whose /name is the pod's name (a downward API volume), so an answer
# proves which pod's process served it.
WEB_CONTAINER: Obj = {
    "name": "http",
    "image": "python:3.11",
    "command": ["python3", "-m", "http.server", "8000", "--directory", "/podinfo"],
    "ports": [{"name": "http", "containerPort": 8000}],
    "readinessProbe": {"httpGet": {"path": "/name", "port": "http"}, "periodSeconds": 1},
    "volumeMounts": [{"name": "podinfo", "mountPath": "/podinfo"}],
}
PODINFO_VOLUME: Obj = {
    "name": "podinfo",
    "downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]},
}


def web_statefulset(namespace: str, replicas: int, gpus: int) -> Obj:
    container = {**WEB_CONTAINER, "resources": {"limits": {GPU: str(gpus), RDMA: "1"}}}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {
            "serviceName": "web",
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [container], "volumes": [PODINFO_VOLUME]},
            },
        },
    }


def service(namespace: str, name: str, *, headless: bool, port: int) -> Obj:
    spec: Obj = {"selector": {"app": "web"}, "ports": [{"name": "http", "port": port, "targetPort": "http"}]}
    if headless:
        spec["clusterIP"] = "None"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def script_pod(namespace: str, name: str, script: str, **spec: Any) -> Obj:
    """A pod of the `python` image running `script`."""
    container = {"name": "main", "image": "python", "args": ["python3", "-c", textwrap.dedent(script)]}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [container], **spec},
    }


def is_ready(pod: Obj) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", [])
    )


async def ready_pods(kube: Kube, namespace: str, selector: str, count: int) -> list[Obj] | None:
    pods = await kube.list("v1", "Pod", namespace, label_selector=selector)
    pods = [p for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp")]
    return pods if len(pods) == count else None


async def get_text(url: str) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r,
    ):
        r.raise_for_status()
        return await r.text()


async def test_crd_cel_validation_rejects_a_bad_object(
    kube: Kube, namespace: str, wait_until, stopwatch
) -> None:
    group = f"t{uuid.uuid4().hex[:8]}.test.pdcluster.io"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "replicas": {"type": "integer"},
                                        "max": {"type": "integer"},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.replicas <= self.max",
                                            "message": "replicas must not exceed max",
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    path = f"/apis/{group}/v1/namespaces/{namespace}/widgets"

    def widget(name: str, replicas: int) -> Obj:
        return {
            "apiVersion": f"{group}/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": {"replicas": replicas, "max": 3},
        }

    async def accepted() -> Obj | None:
        try:
            return await kube.request("POST", path, body=widget("good", 2))
        except ApiError as e:
            if e.status == 404:  # not served yet
                return None
            raise

    await kube.create(crd)
    try:
        with stopwatch("CRD established and served"):
            await wait_until(accepted, timeout=30, message="a valid Widget is accepted")
        with stopwatch("invalid object rejected"), pytest.raises(ApiError) as rejected:
            await kube.request("POST", path, body=widget("bad", 5))
        assert rejected.value.status == 422
        assert "replicas must not exceed max" in rejected.value.message
    finally:
        await kube.delete("apiextensions.k8s.io/v1", "CustomResourceDefinition", f"widgets.{group}")


async def test_statefulset_scales_onto_gpu_nodes_with_real_processes(
    kube: Kube, namespace: str, local_cluster, wait_until, stopwatch
) -> None:
    await kube.create(service(namespace, "web", headless=True, port=8000))
    # A whole node's GPUs per pod: three pods must land on three different GPU nodes.
    await kube.create(web_statefulset(namespace, replicas=1, gpus=8))
    with stopwatch("StatefulSet: first pod Ready"):
        await wait_until(lambda: ready_pods(kube, namespace, "app=web", 1), timeout=60)
    await kube.merge_patch("apps/v1", "StatefulSet", "web", namespace, {"spec": {"replicas": 3}})
    with stopwatch("StatefulSet: scaled to 3 pods Ready"):
        pods = await wait_until(lambda: ready_pods(kube, namespace, "app=web", 3), timeout=90)

    nodes = {p["spec"]["nodeName"] for p in pods}
    assert len(nodes) == 3
    for name in nodes:
        node = await kube.get("v1", "Node", name)
        assert node is not None and node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 3 and all(
        ip.startswith(node_networks.pod_network(local_cluster.slot) + ".") for ip in ips
    )
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits[GPU] == "8" and limits[RDMA] == "1"
        # ExtendedResourceToleration admitted the pod onto tainted GPU nodes.
        assert any(t.get("key") == GPU for t in pod["spec"]["tolerations"])
        with stopwatch("HTTP answer from a pod IP"):
            assert await get_text(f"http://{pod['status']['podIP']}:8000/name") == pod["metadata"]["name"]


async def test_service_names_resolve_inside_a_pod(
    kube: Kube, namespace: str, local_cluster, wait_until, stopwatch, pod_log
) -> None:
    await kube.create(service(namespace, "web", headless=True, port=8000))
    await kube.create(service(namespace, "web-svc", headless=False, port=80))
    await kube.create(web_statefulset(namespace, replicas=1, gpus=1))
    await wait_until(lambda: ready_pods(kube, namespace, "app=web", 1), timeout=60)
    svc = await kube.get("v1", "Service", "web-svc", namespace)
    assert svc is not None
    cluster_ip = svc["spec"]["clusterIP"]
    assert cluster_ip.startswith(node_networks.service_cidr(local_cluster.slot).removesuffix("0.0/16"))

    client = script_pod(
        namespace,
        "client",
        f"""
        import json, os, socket, urllib.request
        print(json.dumps({{
            "clusterip": socket.gethostbyname("web-svc"),
            "fqdn": socket.gethostbyname("web-svc.{namespace}.svc.cluster.local"),
            "pod_dns": socket.gethostbyname("web-0.web"),
            "via_service": urllib.request.urlopen("http://web-svc/name", timeout=5).read().decode(),
            "via_pod_dns": urllib.request.urlopen("http://web-0.web.{namespace}.svc.cluster.local:8000/name",
                                                  timeout=5).read().decode(),
            "service_env": os.environ["WEB_SVC_SERVICE_HOST"],
            "expanded": os.environ["GREETING"],
        }}))
        """,
        restartPolicy="Never",
        container={
            "env": [
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "GREETING", "value": "from $(POD_IP) $$(POD_IP)"},
            ]
        },
    )
    await kube.create(client)
    with stopwatch("client pod ran to completion"):
        done = await wait_until(
            lambda: _phase_is(kube, namespace, "client", "Succeeded", "Failed"), timeout=60
        )
    log = pod_log(namespace, "client", "main")
    assert done["status"]["phase"] == "Succeeded", log
    answer = json.loads(log.strip().splitlines()[-1])
    web0 = await kube.get("v1", "Pod", "web-0", namespace)
    assert web0 is not None
    assert answer["clusterip"] == answer["fqdn"] == answer["service_env"] == cluster_ip
    assert answer["pod_dns"] == web0["status"]["podIP"]
    assert answer["via_service"] == answer["via_pod_dns"] == "web-0"
    assert answer["expanded"] == f"from {done['status']['podIP']} $(POD_IP)"


async def _phase_is(kube: Kube, namespace: str, name: str, *phases: str) -> Obj | None:
    pod = await kube.get("v1", "Pod", name, namespace)
    return pod if pod and pod.get("status", {}).get("phase") in phases else None


async def test_deleting_the_owner_collects_pods_and_stops_processes(
    kube: Kube, namespace: str, wait_until, stopwatch, local_cluster
) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [WEB_CONTAINER], "volumes": [PODINFO_VOLUME]},
            },
        },
    }
    await kube.create(deployment)
    with stopwatch("Deployment: 2 pods Ready"):
        pods = await wait_until(lambda: ready_pods(kube, namespace, "app=web", 2), timeout=60)
    pods_dir = Path(local_cluster.run_dir) / "pods"
    processes = [
        procs.Proc.from_json(
            json.loads((pods_dir / f"{namespace}_{p['metadata']['name']}" / "http.pid").read_text())
        )
        for p in pods
    ]
    assert all(procs.alive(p) for p in processes)

    await kube.delete("apps/v1", "Deployment", "web", namespace)
    with stopwatch("owner deleted: ReplicaSet and pods collected"):
        await wait_until(
            lambda: _all_gone(kube, namespace), timeout=60, message="ReplicaSet and pods deleted"
        )
    assert not any(procs.alive(p) for p in processes)
    for pod in pods:
        with pytest.raises(aiohttp.ClientConnectionError):
            await get_text(f"http://{pod['status']['podIP']}:8000/name")


async def _all_gone(kube: Kube, namespace: str) -> bool:
    return not await kube.list("apps/v1", "ReplicaSet", namespace) and not await kube.list(
        "v1", "Pod", namespace
    )


async def test_a_crashing_container_is_restarted(
    kube: Kube, namespace: str, wait_until, stopwatch, pod_log
) -> None:
    await kube.create(script_pod(namespace, "crash", "import sys; print('boom'); sys.exit(3)"))

    async def restarted() -> Obj | None:
        pod = await kube.get("v1", "Pod", "crash", namespace)
        statuses = (pod or {}).get("status", {}).get("containerStatuses", [])
        return (
            statuses[0]
            if statuses and statuses[0]["restartCount"] > 0 and statuses[0].get("lastState")
            else None
        )

    with stopwatch("first restart visible"):
        status = await wait_until(restarted, timeout=60)
    assert status["lastState"]["terminated"]["exitCode"] == 3
    await wait_until(
        lambda: pod_log(namespace, "crash", "main").count("boom") >= 2,
        timeout=10,
        message="the restarted process ran",
    )


async def test_startup_and_liveness_probes(kube: Kube, namespace: str, wait_until, stopwatch) -> None:
    # Starts after 2 s, falls sick 2 s later; /tmp is the container's own and starts empty.
    script = """
        import pathlib, time
        time.sleep(2); pathlib.Path("/tmp/started").touch()
        time.sleep(2); pathlib.Path("/tmp/sick").touch()
        time.sleep(3600)
        """
    await kube.create(
        script_pod(
            namespace,
            "probed",
            script,
            container={
                "startupProbe": {
                    "exec": {"command": ["test", "-f", "/tmp/started"]},
                    "periodSeconds": 1,
                    "failureThreshold": 30,
                },
                "livenessProbe": {
                    "exec": {"command": ["test", "!", "-f", "/tmp/sick"]},
                    "periodSeconds": 1,
                    "failureThreshold": 1,
                },
            },
        )
    )

    async def container() -> Obj | None:
        pod = await kube.get("v1", "Pod", "probed", namespace)
        statuses = (pod or {}).get("status", {}).get("containerStatuses", [])
        return statuses[0] if statuses else None

    with stopwatch("running but not started until the startup probe passes"):
        first = await wait_until(lambda: _running(container()), timeout=30)
        assert first["started"] is False and first["ready"] is False
        await wait_until(lambda: _started(container()), timeout=30)
    with stopwatch("liveness failure restarts the container"):
        restarted = await wait_until(lambda: _restarted(container()), timeout=30)
    assert restarted["lastState"]["terminated"]["exitCode"] == 143  # SIGTERM


async def _running(status: Awaitable[Obj | None]) -> Obj | None:
    s = await status
    return s if s and "running" in s["state"] else None


async def _started(status: Awaitable[Obj | None]) -> bool:
    s = await status
    return bool(s and s["started"] and s["ready"])


async def _restarted(status: Awaitable[Obj | None]) -> Obj | None:
    s = await status
    return s if s and s["restartCount"] >= 1 and s.get("lastState") else None


async def test_graceful_deletion_runs_prestop_and_waits_for_the_process(
    kube: Kube, namespace: str, wait_until, stopwatch, pod_log
) -> None:
    script = """
        import http.server, signal, sys, time
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                print("prestop", flush=True)
                self.send_response(200); self.end_headers()
            def log_message(self, *args):
                pass
        def drain(*_):
            print("draining", flush=True); time.sleep(2); print("bye", flush=True); sys.exit(0)
        signal.signal(signal.SIGTERM, drain)
        server = http.server.HTTPServer(("0.0.0.0", 8080), Handler)
        print("up", flush=True)
        server.serve_forever()
        """
    pod = script_pod(
        namespace,
        "drain",
        script,
        terminationGracePeriodSeconds=20,
        container={
            "lifecycle": {"preStop": {"httpGet": {"path": "/prestop", "port": 8080}}},
            # An exec probe runs in the container's namespaces: it sees the pod's hostname.
            "readinessProbe": {
                "exec": {"command": ["sh", "-c", 'test "$(hostname)" = drain']},
                "periodSeconds": 1,
            },
        },
    )
    await kube.create(pod)
    await wait_until(lambda: ready_pods(kube, namespace, "", 1), timeout=60)
    await kube.delete("v1", "Pod", "drain", namespace)
    with stopwatch("graceful deletion (2s drain)"):

        async def seen_mid_drain() -> tuple[dict[str, Any] | None] | None:
            # The log read before the get says the drain had begun, the one after it that
            # the process had not exited yet: the pod as got is one whose process drains.
            begun = "draining" in pod_log(namespace, "drain", "main").split()
            pod = await kube.get("v1", "Pod", "drain", namespace)
            if not begun or "bye" in pod_log(namespace, "drain", "main").split():
                return None
            return (pod,)

        (terminating,) = await wait_until(
            seen_mid_drain, timeout=30, interval=0.1, message="the pod seen while its process drains"
        )
        assert terminating is not None and terminating["metadata"].get("deletionTimestamp")
        await wait_until(lambda: _gone(kube, namespace, "drain"), timeout=30)
    assert pod_log(namespace, "drain", "main").split() == ["up", "prestop", "draining", "bye"]


async def _gone(kube: Kube, namespace: str, name: str) -> bool:
    return await kube.get("v1", "Pod", name, namespace) is None


async def test_images_that_cannot_run_here_are_reported(kube: Kube, namespace: str, wait_until) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "vllm", "namespace": namespace},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]},
    }
    await kube.create(pod)

    async def waiting_reason() -> str | None:
        got = await kube.get("v1", "Pod", "vllm", namespace)
        statuses = (got or {}).get("status", {}).get("containerStatuses", [])
        return statuses[0]["state"].get("waiting", {}).get("reason") if statuses else None

    assert await wait_until(waiting_reason, timeout=30) == "ImageNotRunnableLocally"
    got = await kube.get("v1", "Pod", "vllm", namespace)
    assert got is not None and got["status"]["phase"] == "Pending"


async def test_service_account_rbac_inside_and_outside_pods(
    kube: Kube, namespace: str, local_cluster, wait_until, service_account_kubeconfig, pod_log
) -> None:
    await kube.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader", "namespace": namespace}}
    )
    await kube.create(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "pod-reader", "namespace": namespace},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        }
    )
    await kube.create(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "reader", "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        }
    )
    path = await service_account_kubeconfig(namespace, "reader")
    async with Kube(KubeConfig.from_file(path)) as reader:
        assert await reader.list("v1", "Pod", namespace) == []
        with pytest.raises(ApiError) as denied:
            await reader.list("v1", "Secret", namespace)
        assert denied.value.status == 403

    # In a pod: the mounted token, ca.crt and KUBERNETES_SERVICE_HOST reach the apiserver
    # through the kubernetes Service's ClusterIP.
    in_cluster = script_pod(
        namespace,
        "incluster",
        """
        import asyncio, os
        from pdcluster.io.kube import ApiError, Kube, KubeConfig
        async def main():
            async with Kube(KubeConfig.load()) as kube:
                pods = await kube.list("v1", "Pod", kube.config.namespace)
                try:
                    await kube.list("v1", "Secret", kube.config.namespace)
                except ApiError as e:
                    print(os.environ["KUBERNETES_SERVICE_HOST"], len(pods), e.status)
        asyncio.run(main())
        """,
        restartPolicy="Never",
        serviceAccountName="reader",
    )
    await kube.create(in_cluster)
    done = await wait_until(
        lambda: _phase_is(kube, namespace, "incluster", "Succeeded", "Failed"), timeout=60
    )
    log = pod_log(namespace, "incluster", "main")
    assert done["status"]["phase"] == "Succeeded", log
    assert log.split() == [node_networks.kubernetes_service_ip(local_cluster.slot), "1", "403"]


async def test_prometheus_scrapes_annotated_pods(
    kube: Kube, namespace: str, wait_until, stopwatch, prometheus_url: str
) -> None:
    pod = script_pod(
        namespace,
        "exporter",
        """
        import time
        from prometheus_client import start_http_server
        start_http_server(9100)
        while True: time.sleep(60)
        """,
        container={"ports": [{"name": "metrics", "containerPort": 9100}]},
    )
    pod["metadata"]["labels"] = {"pdcluster.io/cluster": "demo", "pdcluster.io/role": "decode"}
    pod["metadata"]["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": "9100"}
    unscraped = script_pod(namespace, "quiet", "import time; time.sleep(3600)")
    await kube.create(pod)
    await kube.create(unscraped)

    async def up() -> list[Obj]:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"{prometheus_url}/api/v1/query", params={"query": f'up{{namespace="{namespace}"}}'}) as r,
        ):
            result = (await r.json())["data"]["result"]
            return [x for x in result if x["value"][1] == "1"]

    with stopwatch("pod scraped by Prometheus (up == 1)"):
        series = await wait_until(up, timeout=60, interval=0.5)
    assert len(series) == 1
    labels = series[0]["metric"]
    assert (labels["pod"], labels["pdcluster"], labels["role"]) == ("exporter", "demo", "decode")
