"""The Helm chart against the real local control plane: every object it renders passes a
strict server-side dry run (the Prometheus Operator's own CRDs are installed for the
PodMonitor and ServiceMonitor), and an install runs the operator from the chart, as a
pod with the chart's ServiceAccount token and nothing more, which brings a PDCluster to
Ready; the Grafana dashboard's queries then find the series they chart."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from pdcluster import constants as C
from pdcluster.io.kube import ApiError, Kube, object_path

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pdcluster-operator"
FULL_VALUES = REPO / "tests" / "fixtures" / "chart-values-full.yaml"
# The Prometheus Operator's CRDs, from its Go module (example/prometheus-operator-crd).
PROMETHEUS_OPERATOR = "github.com/prometheus-operator/prometheus-operator@v0.85.0"
MONITORING_CRDS = ("monitoring.coreos.com_podmonitors.yaml", "monitoring.coreos.com_servicemonitors.yaml")


def _load_dashboard_checks() -> Any:
    """tests/unit/test_chart_dashboard.py: the dashboard's queries and their substitution."""
    path = REPO / "tests" / "unit" / "test_chart_dashboard.py"
    spec = importlib.util.spec_from_file_location("chart_dashboard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def helm(local_cluster: Any, *args: str) -> str:
    out = subprocess.run(
        [f"{local_cluster.bin_dir}/helm", f"--kubeconfig={local_cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def render(local_cluster: Any, namespace: str, *values: str) -> list[dict[str, Any]]:
    text = helm(local_cluster, "template", "pdc", str(CHART), "--namespace", namespace, *values)
    return [d for d in yaml.safe_load_all(text) if d]


async def dry_run(kube: Kube, obj: dict[str, Any]) -> None:
    """Server-side apply with dryRun=All and strict field validation: admission, schema
    and unknown fields are checked, nothing is stored."""
    params = {"fieldManager": "chart-test", "dryRun": "All", "fieldValidation": "Strict", "force": "true"}
    await kube.request(
        "PATCH", object_path(obj), body=obj, params=params, content_type="application/apply-patch+yaml"
    )


async def established(kube: Kube, name: str) -> bool:
    obj = await kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", name)
    return any(
        c["type"] == "Established" and c["status"] == "True"
        for c in ((obj or {}).get("status") or {}).get("conditions") or []
    )


@pytest.fixture(scope="module")
def monitoring_crd_files() -> list[dict[str, Any]]:
    out = subprocess.run(
        ["go", "mod", "download", "-json", PROMETHEUS_OPERATOR], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    folder = Path(json.loads(out.stdout)["Dir"]) / "example" / "prometheus-operator-crd"
    return [yaml.safe_load((folder / name).read_text()) for name in MONITORING_CRDS]


@pytest.fixture
async def monitoring_crds(kube: Kube, monitoring_crd_files: list[dict[str, Any]], wait_until: Any) -> None:
    for crd in monitoring_crd_files:
        await kube.apply(crd, field_manager="chart-test")
        await wait_until(lambda crd=crd: established(kube, crd["metadata"]["name"]), timeout=30)


@pytest.mark.parametrize("values", ["default", "full"])
async def test_every_rendered_object_passes_a_server_side_dry_run(
    kube: Kube, crd: None, monitoring_crds: None, namespace: str, local_cluster: Any, values: str
) -> None:
    args = (
        [] if values == "default" else ["-f", str(FULL_VALUES), "--set", f"watchNamespaces={{{namespace}}}"]
    )
    docs = render(local_cluster, namespace, "--include-crds", *args)
    kinds = {d["kind"] for d in docs}
    assert "CustomResourceDefinition" in kinds
    if values == "full":
        assert {"PodMonitor", "ServiceMonitor", "ConfigMap", "Role"} <= kinds
    failures = []
    for obj in docs:
        try:
            await dry_run(kube, obj)
        except ApiError as e:
            failures.append(f"{obj['kind']} {obj['metadata']['name']}: {e.message}")
    assert not failures, "\n".join(failures)


async def test_dry_run_is_strict(
    kube: Kube, monitoring_crds: None, namespace: str, local_cluster: Any
) -> None:
    """The check above can fail: a misspelt field of a PodMonitor is refused."""
    docs = render(local_cluster, namespace, "--set", "podMonitor.enabled=true")
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["relabellings"] = []
    with pytest.raises(ApiError, match="relabellings"):
        await dry_run(kube, monitor)


# ------------------------------------------------------------------------ install


def token_of(local_cluster: Any, namespace: str, pod: str) -> str:
    """The ServiceAccount token as the operator's container sees it (its mount namespace)."""
    pid_file = Path(local_cluster.run_dir) / "pods" / f"{namespace}_{pod}" / "operator.pid"
    pid = json.loads(pid_file.read_text())[0]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not any(e.startswith(b"KUBECONFIG=") for e in environ), (
        "the operator must use its in-cluster token"
    )
    return Path(f"/proc/{pid}/root/run/secrets/kubernetes.io/serviceaccount/token").read_text()


async def stream_completions(router_ip: str, count: int) -> None:
    body = {
        "model": "llama-3.1-8b",
        "prompt": "The chart test says hello " * 20,
        "max_tokens": 24,
        "stream": True,
    }
    async with aiohttp.ClientSession() as s:

        async def one() -> None:
            async with s.post(f"http://{router_ip}:8000/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()

        await asyncio.gather(*(one() for _ in range(count)))


async def prom_query(url: str, promql: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/api/v1/query", params={"query": promql}) as r:
        payload = await r.json()
    assert payload["status"] == "success", (promql, payload)
    return payload["data"]["result"]


# Panels that stay empty while nothing fails and nothing autoscales.
MAY_BE_EMPTY = ("rejections_total", "upstream_errors_total", "scaling_decisions_total")


@pytest.mark.parametrize("scope", ["namespaced", "cluster-wide"])
async def test_operator_from_the_chart_brings_a_pdcluster_to_ready(
    kube: Kube,
    crd: None,
    namespace: str,
    local_cluster: Any,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
    pod_log: Any,
    stopwatch: Any,
    scope: str,
) -> None:
    release = f"pdc-{namespace[-5:]}"
    values = ["--set", f"prometheusUrl={local_cluster.prometheus_url}", "--set", "resyncSeconds=5"]
    if scope == "namespaced":  # Roles in the watched namespace, two replicas electing a leader
        values += ["--set", f"watchNamespaces={{{namespace}}}"]
    else:
        values += ["--set", "replicaCount=1"]
    try:
        with stopwatch("helm install --wait"):
            helm(
                local_cluster,
                "install",
                release,
                str(CHART),
                "-n",
                namespace,
                "--wait",
                "--timeout=120s",
                *values,
            )
        operators = await kube.list(
            "v1", "Pod", namespace, label_selector=f"app.kubernetes.io/instance={release}"
        )
        assert len(operators) == (2 if scope == "namespaced" else 1)

        # The operator runs with the chart's ServiceAccount token, nothing else.
        for pod in operators:
            review = await kube.request(
                "POST",
                "/apis/authentication.k8s.io/v1/tokenreviews",
                body={
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "TokenReview",
                    "spec": {"token": token_of(local_cluster, namespace, pod["metadata"]["name"])},
                },
            )
            sa = f"{release}-pdcluster-operator"
            assert review["status"]["user"]["username"] == f"system:serviceaccount:{namespace}:{sa}"

        with stopwatch("PDCluster Ready from the chart's operator"):
            await pdc.apply(sim_cluster("demo"))

            async def ready() -> bool:
                obj = await pdc.get("demo")
                status = (obj or {}).get("status") or {}
                return await pdc.is_true("demo", "Ready") and status.get("decode", {}).get("ready") == 1

            await wait_until(ready, timeout=120, message="PDCluster Ready")
        status = (await pdc.get("demo"))["status"]
        assert status["prefill"]["ready"] == 1 and status["ratio"] == "1:1"
        lease = await kube.get("coordination.k8s.io/v1", "Lease", "pdcluster-operator", namespace)
        assert lease["spec"]["holderIdentity"].startswith(f"{release}-pdcluster-operator-")

        # Exactly the chart's RBAC is enough: RBAC refused no request of the operator.
        logs = "".join(pod_log(namespace, p["metadata"]["name"], "operator") for p in operators)
        assert "forbidden: User" not in logs, logs[-3000:]
        assert "Traceback" not in logs, logs[-3000:]

        # Traffic through the router, then every dashboard query against the live Prometheus.
        router = await kube.get("v1", "Service", "demo-router", namespace)
        await stream_completions(router["spec"]["clusterIP"], 12)
        await dashboard_queries_find_their_series(local_cluster.prometheus_url, namespace, wait_until)
    finally:
        helm(local_cluster, "uninstall", release, "-n", namespace, "--wait")
    assert not [
        r
        for r in await kube.list("rbac.authorization.k8s.io/v1", "ClusterRole")
        if r["metadata"]["name"].startswith(release)
    ]


async def dashboard_queries_find_their_series(prometheus_url: str, namespace: str, wait_until: Any) -> None:
    dash = _load_dashboard_checks()
    dash.VARIABLES.update(namespace=namespace, pdcluster="demo", __rate_interval="1m")
    queries = [(where, dash.substitute(expr)) for where, expr in dash.queries()]

    async def all_have_data() -> bool:
        empty = []
        for where, promql in queries:
            if not await prom_query(prometheus_url, promql) and not any(m in promql for m in MAY_BE_EMPTY):
                empty.append(where)
        assert not empty, f"no series for: {empty}"
        return True

    await wait_until(all_have_data, timeout=60, interval=2, message="dashboard queries have data")
    by_role = await prom_query(prometheus_url, next(q for w, q in queries if w == "panel 1 B"))
    ready = {r["metric"]["role"]: float(r["value"][1]) for r in by_role}
    assert ready == {C.ROLE_PREFILL: 1.0, C.ROLE_DECODE: 1.0, C.ROLE_COLOCATED: 0.0}  # a PD cluster
