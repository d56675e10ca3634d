"""The demo's cluster: the operator from the Helm chart, and a fresh PDCluster of the
engine's example, Ready before the replay starts."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from pdcluster import constants as C
from pdcluster.io.kube import Kube, KubeConfig
from pddemo.view import step

REPO = Path(__file__).resolve().parents[3]
CLUSTER = "demo"
NAMESPACE = "demo"
OPERATOR_NAMESPACE = "pdcluster-system"
RELEASE = "pdcluster-operator"
CHART = REPO / "charts" / "pdcluster-operator"


def install_operator(bin_dir: str, kubeconfig: str, prometheus_url: str) -> None:
    """`helm upgrade --install` of the chart, waiting for the operator to run."""
    subprocess.run(
        [
            f"{bin_dir}/helm",
            f"--kubeconfig={kubeconfig}",
            "upgrade",
            "--install",
            RELEASE,
            str(CHART),
            "--namespace",
            OPERATOR_NAMESPACE,
            "--create-namespace",
            "--wait",
            "--timeout=180s",
            "--set",
            f"prometheusUrl={prometheus_url}",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )


async def wait_ready(kube: Kube, console: Console, namespace: str, name: str, timeout: float = 300) -> None:
    """Prints the Ready condition's message each time it changes, until it is True."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        obj = await kube.get(C.API_VERSION, C.KIND, name, namespace) or {}
        status = obj.get("status") or {}
        ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
        if ready and ready["status"] == "True":
            console.print(f"    Ready: {ready['message']}")
            return
        line = ready["message"] if ready else "waiting for the operator"
        if line != last:
            console.print(f"    {line}")
            last = line
        await asyncio.sleep(1)
    raise SystemExit(
        f"PDCluster {namespace}/{name} not Ready after {timeout:.0f}s; see `kubectl describe pdc {name} -n {namespace}`"
    )


async def fresh_pdcluster(kube: Kube, console: Console, doc: dict[str, Any]) -> None:
    """Applies the example; one left by an earlier run is replaced, so each run starts at 1:1."""
    name = doc["metadata"]["name"]
    if await kube.get("v1", "Namespace", NAMESPACE) is None:
        await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    if await kube.get(C.API_VERSION, C.KIND, name, NAMESPACE) is not None:
        step(console, f"replacing the PDCluster {NAMESPACE}/{name} of an earlier run")
        await kube.delete(C.API_VERSION, C.KIND, name, NAMESPACE)
        selector = f"{C.LABEL_CLUSTER}={name}"
        while await kube.get(C.API_VERSION, C.KIND, name, NAMESPACE) or await kube.list(
            "v1", "Pod", NAMESPACE, label_selector=selector
        ):
            await asyncio.sleep(0.5)
    # The default ServiceAccount must exist before any pod can be created.
    while await kube.get("v1", "ServiceAccount", "default", NAMESPACE) is None:
        await asyncio.sleep(0.2)
    await kube.apply(
        {**doc, "metadata": {**doc["metadata"], "namespace": NAMESPACE}}, field_manager="pdcluster-demo"
    )


async def crd_established(kube: Kube) -> None:
    for _ in range(100):
        crd = await kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", C.CRD_NAME) or {}
        if any(
            c["type"] == "Established" and c["status"] == "True"
            for c in (crd.get("status") or {}).get("conditions", [])
        ):
            return
        await asyncio.sleep(0.1)


async def deploy_example(
    kubeconfig: str, console: Console, example: Path, doc: dict[str, Any], ready_timeout_s: float
) -> None:
    """The example's PDCluster (`doc`, read from `example`), fresh, in NAMESPACE, once Ready."""
    async with Kube(KubeConfig.from_file(kubeconfig)) as kube:
        await crd_established(kube)
        step(console, f"PDCluster from {example.relative_to(REPO)} into namespace {NAMESPACE}")
        await fresh_pdcluster(kube, console, doc)
        await wait_ready(kube, console, NAMESPACE, doc["metadata"]["name"], timeout=ready_timeout_s)
