"""Every file in examples/ applied to the local cluster with the operator running: the
operator renders all children, wired for the example's RDMA mode and GPUs. vLLM pods
cannot run here (no GPU, no vLLM), so those examples must report their engines not
ready; the simulated example must become Ready."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec, RDMAMode
from pdcluster.io.kube import Kube
from pdcluster.render import Owner, Replicas, render_all

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SIMULATED = {"pdcluster-sim.yaml", "pdcluster-colocated.yaml", "pdcluster-flexible.yaml"}


def load(path: Path) -> tuple[dict[str, Any], PDClusterSpec]:
    doc = yaml.safe_load(path.read_text())
    return doc, PDClusterSpec.model_validate(doc["spec"])


def expected_children(doc: dict[str, Any], spec: PDClusterSpec, namespace: str) -> list[tuple[str, str, str]]:
    owner = Owner(doc["metadata"]["name"], namespace, "")
    return [
        (o["apiVersion"], o["kind"], o["metadata"]["name"])
        for o in render_all(spec, owner, Replicas.choose(spec, None))
    ]


def pod_templates(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """A StatefulSet's pod template, or a LeaderWorkerSet's leader and worker templates."""
    if workload["kind"] == "LeaderWorkerSet":
        group = workload["spec"]["leaderWorkerTemplate"]
        return [group["leaderTemplate"], group["workerTemplate"]]
    return [workload["spec"]["template"]]


def check_engine_wiring(pod: dict[str, Any], spec: PDClusterSpec, role: str) -> None:
    """What the example asks of an engine pod: GPUs, RDMA resources and network, and the
    MooncakeConnector's role, protocol and devices."""
    engine = pod["spec"]["containers"][0]
    limits = engine["resources"]["limits"]
    r = spec.role(role)
    per_pod = r.gpus // r.nodes  # a role spanning nodes: one node's GPUs in each pod of a group
    assert limits[r.gpu_resource_name] == str(per_pod)
    assert engine["resources"]["requests"][r.gpu_resource_name] == str(per_pod)

    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == str(r.tensor_parallel_size)
    if role == C.ROLE_COLOCATED:  # whole requests on one engine: no hand-off to wire
        assert "--enable-chunked-prefill" in args
        assert ("--kv-transfer-config" in args) == spec.mooncake.store.enabled
        return
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer", "flexible": "kv_both"}[role]
    assert kv["kv_role"] == kv_role
    if spec.mooncake.store.enabled:  # the hand-off is MultiConnector's first child
        assert kv["kv_connector"] == "MultiConnector"
        handoff, store = kv["kv_connector_extra_config"]["connectors"]
        assert store["kv_connector"] == "MooncakeStoreConnector"
        assert any(m["mountPath"] == "/etc/mooncake" for m in engine["volumeMounts"])
        kv = handoff
    assert kv["kv_connector"] == "MooncakeConnector"
    assert kv["kv_role"] == kv_role
    extra = kv["kv_connector_extra_config"]
    env = {e["name"]: e.get("value") for e in engine["env"]}

    mode = spec.rdma.mode
    assert extra["mooncake_protocol"] == ("tcp" if mode == RDMAMode.none else "rdma")
    if spec.rdma.hcas:
        assert extra["device_name"] == ",".join(spec.rdma.hcas)
        assert env["NCCL_IB_HCA"] == ",".join(spec.rdma.hcas)
    if spec.rdma.gid_index is not None:
        assert env["NCCL_IB_GID_INDEX"] == env["MC_GID_INDEX"] == str(spec.rdma.gid_index)
    caps = (engine.get("securityContext") or {}).get("capabilities", {}).get("add", [])
    assert ("IPC_LOCK" in caps) == (mode != RDMAMode.none)
    if mode in (RDMAMode.shared_device_plugin, RDMAMode.sriov):
        assert limits[spec.rdma.resource_name] == str(spec.rdma.resource_count)
    else:
        assert not any(k.startswith("rdma/") or "sriov" in k for k in limits)
    annotations = pod["metadata"].get("annotations") or {}
    if mode == RDMAMode.sriov:
        assert annotations["k8s.v1.cni.cncf.io/networks"] == ",".join(spec.rdma.networks)
    else:
        assert "k8s.v1.cni.cncf.io/networks" not in annotations
    host = mode == RDMAMode.host_network
    assert bool(pod["spec"].get("hostNetwork")) == host
    if host:
        assert pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
        mounts = {m["mountPath"] for m in engine["volumeMounts"]}
        assert "/dev/infiniband" in mounts


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
async def test_example(
    path: Path, kube: Kube, namespace: str, operator: Any, pdc: Any, wait_until: Any, stopwatch: Any
) -> None:
    doc, spec = load(path)
    name = doc["metadata"]["name"]
    if spec.engine.hf_token_secret:  # as a user would, before applying a gated model's example
        ref = spec.engine.hf_token_secret
        secret = {"name": ref.name, "namespace": namespace}
        await kube.create(
            {"apiVersion": "v1", "kind": "Secret", "metadata": secret, "stringData": {ref.key: "hf_x"}}
        )
    await pdc.apply(doc)

    want = expected_children(doc, spec, namespace)

    async def all_children() -> dict[tuple[str, str], dict[str, Any]]:
        found = {(kind, n): await kube.get(api, kind, n, namespace) for api, kind, n in want}
        missing = [k for k, v in found.items() if v is None]
        assert not missing, f"not rendered yet: {missing}"
        return found

    with stopwatch("all children rendered"):
        children = await wait_until(all_children, timeout=60, message=f"children of {path.name}")
    uid = (await pdc.get(name))["metadata"]["uid"]
    kept = spec.model.cache is not None and spec.model.cache.retain  # the weights' claim outlives the cluster
    for key, obj in children.items():
        if kept and key[0] == "PersistentVolumeClaim":
            assert "ownerReferences" not in obj["metadata"], key
        else:
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid, key
        assert obj["metadata"]["labels"][C.LABEL_CLUSTER] == name, key
    for role in spec.engine_roles:
        kind = "LeaderWorkerSet" if spec.role(role).nodes > 1 else "StatefulSet"
        workload = children[(kind, f"{name}-{role}")]
        assert workload["spec"]["replicas"] == spec.role(role).replicas
        for pod in pod_templates(workload):
            check_engine_wiring(pod, spec, role)

    if path.name in SIMULATED:

        async def ready() -> bool:
            status = (await pdc.get(name)).get("status") or {}
            return await pdc.is_true(name, "Ready") and all(
                status[role]["ready"] == spec.role(role).replicas for role in spec.engine_roles
            )

        with stopwatch("simulated example Ready"):
            await wait_until(ready, timeout=120, message="simulated example Ready")
        return

    # vLLM cannot run here: the engines' pods exist (or wait for a node), none is ready,
    # and the status says which components have no ready pod.
    async def reports_engines_not_ready() -> dict[str, Any]:
        status = (await pdc.get(name)).get("status") or {}
        ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), None)
        assert ready and ready["status"] == "False" and ready["reason"] == "ComponentsUnavailable", ready
        assert "prefill" in ready["message"] and "decode" in ready["message"], ready
        for role in C.ENGINE_ROLES:
            assert status[role]["desired"] == spec.role(role).replicas, status
            assert status[role]["ready"] == 0, status
        return status

    await wait_until(reports_engines_not_ready, timeout=60, message="status reports engines not ready")

    # The StatefulSet controller creates the pods after the status is written: wait for them.
    async def engine_pods() -> list[dict[str, Any]]:
        pods = await kube.list("v1", "Pod", namespace, label_selector=f"{C.LABEL_CLUSTER}={name}")
        engines = [p for p in pods if p["metadata"]["labels"][C.LABEL_ROLE] in C.ENGINE_ROLES]
        want = sum(spec.role(r).replicas * spec.role(r).nodes for r in C.ENGINE_ROLES)
        assert len(engines) == want, engines
        return engines

    engines = await wait_until(engine_pods, timeout=30, message="every engine pod created")
    assert not any(
        c.get("ready") for p in engines for c in p.get("status", {}).get("containerStatuses") or []
    )
    if spec.autoscaling.enabled:  # no metrics from engines that do not run: hold, and say so
        cond = await pdc.condition(name, "Autoscaling")
        assert cond and cond["status"] == "False", cond
