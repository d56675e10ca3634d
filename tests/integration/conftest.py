"""Fixtures for running the operator against the local cluster: the CRD installed once,
and `pdcluster-operator` as a real process watching one test namespace."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdcluster import constants as C
from pdcluster.io.kube import Kube

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "pdcluster.io_pdclusters.yaml"


def make_sim_cluster(name: str, **overrides: Any) -> dict[str, Any]:
    """examples/pdcluster-sim.yaml with `name` and top-level spec sections replaced."""
    doc = yaml.safe_load((REPO / "examples" / "pdcluster-sim.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["autoscaling"] = {"enabled": False}
    for key, value in overrides.items():
        doc["spec"][key] = copy.deepcopy(value)
    return doc


@pytest.fixture(name="sim_cluster")
def sim_cluster_fixture() -> Any:
    """`sim_cluster(name, **spec_sections)`: the demo PDCluster (engine simulators) with
    autoscaling off, a new name and some spec sections replaced."""
    return make_sim_cluster


@pytest.fixture(scope="session")
async def crd(local_cluster: Any) -> None:
    from pdcluster.io.kube import KubeConfig

    async with Kube(KubeConfig.from_file(local_cluster.kubeconfig)) as kube:
        await kube.apply(yaml.safe_load(CRD.read_text()), field_manager="pdcluster-tests")

        async def established() -> bool:
            obj = await kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", C.CRD_NAME)
            conditions = ((obj or {}).get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        for _ in range(100):
            if await established():
                return
            await asyncio.sleep(0.1)
        raise AssertionError("CRD not established")


@dataclass
class OperatorProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)


def start_operator(kubeconfig: str, namespace: str, log_path: Path, *extra: str) -> OperatorProcess:
    args = [
        str(REPO / ".venv" / "bin" / "pdcluster-operator"),
        f"--kubeconfig={kubeconfig}",
        f"--namespace={namespace}",
        "--no-leader-election",
        "--resync-seconds=5",
        "--metrics-port=0",
        "--health-port=0",
        *extra,
    ]
    if not Path(args[0]).exists():
        args[0:1] = [sys.executable, "-m", "pdcluster.main"]
    log = log_path.open("ab")
    proc = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    return OperatorProcess(proc, log_path, args)


@pytest.fixture
def operator(local_cluster: Any, crd: None, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator as a real process, scoped to this test's namespace."""
    op = start_operator(
        local_cluster.kubeconfig,
        namespace,
        tmp_path / "operator.log",
        f"--prometheus-url={local_cluster.prometheus_url}",
    )
    yield op
    op.kill(signal.SIGTERM)
    if "Traceback" in op.log():
        print(op.log()[-5000:])


@pytest.fixture
async def pdc(kube: Kube, namespace: str) -> AsyncIterator[Any]:
    """Helpers for PDClusters in the test namespace."""

    class PDC:
        async def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
            doc = {"apiVersion": C.API_VERSION, "kind": C.KIND, **doc}
            doc["metadata"] = {**doc["metadata"], "namespace": namespace}
            return await kube.apply(doc, field_manager="kubectl-test")

        async def get(self, name: str) -> dict[str, Any] | None:
            return await kube.get(C.API_VERSION, C.KIND, name, namespace)

        async def condition(self, name: str, type_: str) -> dict[str, Any] | None:
            obj = await self.get(name)
            for c in (obj or {}).get("status", {}).get("conditions", []):
                if c["type"] == type_:
                    return c
            return None

        async def is_true(self, name: str, type_: str) -> bool:
            c = await self.condition(name, type_)
            return bool(c and c["status"] == "True")

    yield PDC()
