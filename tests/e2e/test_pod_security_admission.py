"""The Pod Security admission plugin of the local kube-apiserver judges every pod we ship
(server-side dry run, nothing runs): the operator, router and Mooncake pods are admitted
where `restricted` is enforced; engine pods need `baseline`, and a privileged namespace
when an RDMA mode adds IPC_LOCK or the host network. The same levels are checked without
a cluster, rule by rule, in tests/unit/test_security_pod.py."""

from __future__ import annotations

import copy
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import State
from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec, RDMAMode
from pdcluster.io.kube import ApiError, Kube
from pdcluster.render import Owner, Replicas, render_all

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
ENGINES = (C.ROLE_PREFILL, C.ROLE_DECODE, C.ROLE_COLOCATED, C.ROLE_FLEXIBLE)
ON_FABRIC = (*ENGINES, C.ROLE_MOONCAKE_STORE)  # pods that move KV over RDMA


def shipped_pods(local_cluster: State) -> list[tuple[str, str, RDMAMode | None, dict[str, Any]]]:
    """(where, role, rdma mode, pod template) of the chart's operator and of every
    workload every example renders."""
    pods = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())["spec"]
        raw.setdefault("mooncake", {})["store"] = {"replicas": 1}  # store pods too
        spec = PDClusterSpec.model_validate(raw)
        for obj in render_all(spec, Owner("x", "ns", "uid"), Replicas.choose(spec, None)):
            if obj["kind"] in ("StatefulSet", "Deployment"):
                role = obj["metadata"]["labels"][C.LABEL_ROLE]
                pods.append((path.stem, role, spec.rdma.mode, obj["spec"]["template"]))
    chart = subprocess.run(
        [f"{local_cluster.bin_dir}/helm", "template", "pdc", str(ROOT / "charts" / "pdcluster-operator")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for obj in yaml.safe_load_all(chart):
        if obj and obj["kind"] == "Deployment":
            pods.append(("chart", "operator", None, obj["spec"]["template"]))
    return pods


async def verdict(kube: Kube, namespace: str, template: dict[str, Any]) -> str:
    """'admitted', or the admission's reason for refusing the pod."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **copy.deepcopy(template.get("metadata") or {}),
            "name": f"check-{uuid.uuid4().hex[:8]}",
        },
        "spec": copy.deepcopy(template["spec"]),
    }
    pod["metadata"]["namespace"] = namespace
    account = pod["spec"].get("serviceAccountName")
    if account and await kube.get("v1", "ServiceAccount", account, namespace) is None:
        await kube.create(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": account, "namespace": namespace},
            }
        )
    try:
        await kube.create(pod, dry_run=True)
    except ApiError as e:
        assert e.status == 403 and "violates PodSecurity" in e.message, e.message
        return e.message
    return "admitted"


@pytest.fixture
async def enforcing(kube: Kube) -> AsyncIterator[dict[str, str]]:
    """A namespace per Pod Security level, enforcing it."""
    names = {}
    for level in ("restricted", "baseline"):
        name = f"pss-{level}-{uuid.uuid4().hex[:5]}"
        labels = {
            "pod-security.kubernetes.io/enforce": level,
            "pod-security.kubernetes.io/enforce-version": "latest",
        }
        await kube.create(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
        )
        names[level] = name
    yield names
    for name in names.values():
        await kube.delete("v1", "Namespace", name)


async def test_pod_security_admission(kube: Kube, local_cluster: State, enforcing: dict[str, str]) -> None:
    pods = shipped_pods(local_cluster)
    assert {role for _, role, _, _ in pods} >= {"operator", C.ROLE_ROUTER, C.ROLE_MOONCAKE_MASTER, *ENGINES}
    wrong = []
    for where, role, rdma, template in pods:
        restricted = await verdict(kube, enforcing["restricted"], template)
        baseline = await verdict(kube, enforcing["baseline"], template)
        got = tuple("admitted" if v == "admitted" else "refused" for v in (restricted, baseline))
        on_rdma = role in ON_FABRIC and rdma not in (None, RDMAMode.none)
        if on_rdma:
            want = ("refused", "refused")  # IPC_LOCK (and the host network): privileged only
        elif role not in ENGINES:
            want = ("admitted", "admitted")
        else:
            want = ("refused", "admitted")  # vLLM runs as root: baseline, not restricted
        if got != want:
            wrong.append(f"{where}/{role}: restricted {restricted!r}, baseline {baseline!r}")
        if on_rdma:
            assert "IPC_LOCK" in baseline, baseline  # refused for the capability we add, nothing else
    assert not wrong, wrong
