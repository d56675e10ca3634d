"""The operator against the real local control plane: create, update, drift, delete,
bad input, and the status people and GitOps tools read."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import aiohttp
import pytest
from harness import CHILD_KINDS

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.io.kube import ApiError, Kube

pytestmark = pytest.mark.cluster

WORKLOADS = [
    ("StatefulSet", "prefill"),
    ("StatefulSet", "decode"),
    ("Deployment", "router"),
    ("Deployment", "mooncake-master"),
]
CHILDREN = [
    *WORKLOADS,
    ("Service", "prefill"),
    ("Service", "decode"),
    ("Service", "router"),
    ("Service", "mooncake-master"),
    ("ConfigMap", "mooncake"),
    ("PodDisruptionBudget", "prefill"),
    ("PodDisruptionBudget", "decode"),
    ("PodDisruptionBudget", "router"),
    ("ServiceAccount", "router"),
    ("Role", "router"),
    ("RoleBinding", "router"),
]


async def children(kube: Kube, namespace: str, name: str) -> dict[tuple[str, str], dict[str, Any] | None]:
    return {
        (kind, suffix): await kube.get(CHILD_KINDS[kind], kind, f"{name}-{suffix}", namespace)
        for kind, suffix in CHILDREN
    }


def operator_owned(obj: dict[str, Any]) -> tuple[Any, ...]:
    """What changes when the operator writes an object: its spec's generation, its labels and
    annotations, and the operator's own managed-fields entry (time and fields)."""
    meta = obj["metadata"]
    ours = [m for m in meta.get("managedFields", []) if m.get("manager") == C.FIELD_MANAGER]
    return meta["generation"], meta.get("labels"), meta.get("annotations"), ours


async def ready(pdc: Any, name: str) -> bool:
    obj = await pdc.get(name)
    if not obj or not await pdc.is_true(name, "Ready"):
        return False
    return not await pdc.is_true(name, "Progressing")


async def reconciles_pass(operator: Any, wait_until: Any, count: int, what: str) -> None:
    """Waits until the operator has finished `count` more reconciles (its resyncs come
    every 5 s): what the operator does at rest is seen over its own work, not over time."""
    start = await operator.reconciles()

    async def done() -> bool:
        return await operator.reconciles() >= start + count

    await wait_until(done, timeout=60, interval=0.5, message=f"{count} reconciles {what}")


async def completion(
    router_ip: str, prompt: str = "Hello from the tests", stream: bool = False
) -> tuple[int, str]:
    body = {"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 8, "stream": stream}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://{router_ip}:8000/v1/completions", json=body) as r,
    ):
        return r.status, await r.text()


async def test_create_update_drift_delete(
    kube: Kube, namespace: str, operator: Any, pdc: Any, wait_until: Any, local_cluster: Any, sim_cluster: Any
) -> None:
    # With the store on, so that its client ConfigMap is a child too: the engine
    # simulators read it, as vLLM's store connector does, and write their blocks.
    store = {"enabled": True, "engineSegmentSize": "64Mi", "engineBufferSize": "16Mi"}
    mooncake = {"image": C.DEFAULT_MOONCAKE_IMAGE, "store": store}
    await pdc.apply(sim_cluster("demo", mooncake=mooncake))
    await wait_until(lambda: ready(pdc, "demo"), timeout=120, message="PDCluster Ready and settled")

    # Every child exists, is owned by the PDCluster and runs.
    owned = await children(kube, namespace, "demo")
    uid = (await pdc.get("demo"))["metadata"]["uid"]
    for key, obj in owned.items():
        assert obj is not None, key
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    status = (await pdc.get("demo"))["status"]
    assert status["prefill"]["ready"] == 1 and status["decode"]["ready"] == 1 and status["ratio"] == "1:1"
    assert status["observedGeneration"] == (await pdc.get("demo"))["metadata"]["generation"]
    pods = await kube.list("v1", "Pod", namespace, label_selector=f"{C.LABEL_CLUSTER}=demo")
    # prefill, decode, the Mooncake master and two routers (the router's default)
    assert len(pods) == 5 and all(p["status"]["podIP"].startswith("127.") for p in pods)

    # A request goes through the router (its Service) to prefill and decode.
    router_svc = owned[("Service", "router")]
    code, text = await completion(router_svc["spec"]["clusterIP"])
    assert code == 200, text
    assert json.loads(text)["choices"][0]["text"]

    # `kubectl get pdc` shows the printer columns.
    out = subprocess.run(
        [
            f"{local_cluster.bin_dir}/kubectl",
            f"--kubeconfig={local_cluster.kubeconfig}",
            "get",
            "pdc",
            "-n",
            namespace,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    header, row = out.splitlines()[:2]
    assert header.split() == [
        "NAME",
        "READY",
        "MODE",
        "PREFILL",
        "DECODE",
        "RATIO",
        "SLO",
        "TTFT-BEYOND-PREFILL",
        "TTFT",
        "ITL",
        "ROLLOUT",
        "AGE",
    ]
    assert row.split()[:6] == ["demo", "True", "disaggregated", "1", "1", "1:1"]

    # At rest the operator writes nothing: resource versions stay put over several resyncs.
    versions = {
        k: v["metadata"]["resourceVersion"] for k, v in (await children(kube, namespace, "demo")).items()
    }
    pdc_version = (await pdc.get("demo"))["metadata"]["resourceVersion"]
    await reconciles_pass(operator, wait_until, 3, "at rest")
    assert {
        k: v["metadata"]["resourceVersion"] for k, v in (await children(kube, namespace, "demo")).items()
    } == versions
    assert (await pdc.get("demo"))["metadata"]["resourceVersion"] == pdc_version

    # Drift by hand is put back: replicas and the pod template.
    sts = f"demo-{C.ROLE_DECODE}"
    await kube.merge_patch("apps/v1", "StatefulSet", sts, namespace, {"spec": {"replicas": 3}})
    tampered = {"spec": {"template": {"metadata": {"annotations": {"prometheus.io/scrape": "false"}}}}}
    await kube.merge_patch("apps/v1", "StatefulSet", f"demo-{C.ROLE_PREFILL}", namespace, tampered)

    async def repaired() -> bool:
        d = await kube.get("apps/v1", "StatefulSet", sts, namespace)
        p = await kube.get("apps/v1", "StatefulSet", f"demo-{C.ROLE_PREFILL}", namespace)
        return (
            d["spec"]["replicas"] == 1
            and p["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        )

    await wait_until(repaired, timeout=30, message="drift repaired")
    await wait_until(lambda: ready(pdc, "demo"), timeout=120, message="settled after drift")
    # ... and then it rests again (no write storm between two managers). The StatefulSet
    # controller still writes status while the extra pods terminate, so the test judges
    # the writes the operator owns: the spec's generation and its field manager's entry.
    settled = operator_owned(await kube.get("apps/v1", "StatefulSet", sts, namespace))
    await reconciles_pass(operator, wait_until, 2, "after the repair")
    assert operator_owned(await kube.get("apps/v1", "StatefulSet", sts, namespace)) == settled

    # Update: a new tensor-parallel size rolls the prefill pool onto pods asking for 2 GPUs.
    before = {
        p["metadata"]["uid"]
        for p in await kube.list("v1", "Pod", namespace, label_selector=f"{C.LABEL_ROLE}=prefill")
    }
    doc = sim_cluster("demo", mooncake=mooncake)
    doc["spec"]["prefill"] = {**doc["spec"]["prefill"], "tensorParallelSize": 2}
    await pdc.apply(doc)

    async def rolled() -> bool:
        pods = await kube.list("v1", "Pod", namespace, label_selector=f"{C.LABEL_ROLE}=prefill")
        fresh = [p for p in pods if p["metadata"]["uid"] not in before]
        gpus = [p["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") for p in fresh]
        return len(pods) == 1 and gpus == ["2"] and await ready(pdc, "demo")

    await wait_until(rolled, timeout=120, message="prefill rolled to TP2")
    args = (await kube.get("apps/v1", "StatefulSet", "demo-prefill", namespace))["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert (await pdc.get("demo"))["status"]["prefill"]["gpus"] == 2

    # Delete: owner references take every child with it.
    await kube.delete(C.API_VERSION, C.KIND, "demo", namespace)

    async def collected() -> bool:
        left = [k for k, v in (await children(kube, namespace, "demo")).items() if v is not None]
        pods = await kube.list("v1", "Pod", namespace, label_selector=f"{C.LABEL_CLUSTER}=demo")
        return not left and not pods

    await wait_until(collected, timeout=120, message="children garbage-collected")


async def test_a_field_removed_from_the_spec_leaves_the_child(
    kube: Kube, namespace: str, operator: Any, pdc: Any, wait_until: Any, sim_cluster: Any
) -> None:
    """GitOps: what disappears from the PDCluster disappears from its children, by
    server-side apply's pruning of what our field manager no longer sends."""
    extras = {
        "nodeSelector": {"pool": "h200"},
        "podAnnotations": {"team": "serving"},
        "priorityClassName": "serving-high",
        "env": [{"name": "EXTRA", "value": "1"}],
    }
    doc = sim_cluster("prune", suspend=True)  # objects only: no pod needs to run
    doc["spec"]["prefill"] = {**doc["spec"]["prefill"], **extras}
    await pdc.apply(doc)

    async def template() -> dict | None:
        sts = await kube.get("apps/v1", "StatefulSet", "prune-prefill", namespace)
        return sts["spec"]["template"] if sts else None

    async def carries_extras() -> bool:
        t = await template()
        return bool(t and t["spec"].get("priorityClassName") == "serving-high")

    await wait_until(carries_extras, timeout=60, message="the extras applied")
    doc["spec"]["prefill"] = {k: v for k, v in doc["spec"]["prefill"].items() if k not in extras}
    await pdc.apply(doc)

    async def pruned() -> bool:
        t = await template()
        assert t is not None
        env = [e["name"] for e in t["spec"]["containers"][0]["env"]]
        return (
            "nodeSelector" not in t["spec"]
            and "priorityClassName" not in t["spec"]
            and "team" not in t["metadata"].get("annotations", {})
            and "EXTRA" not in env
        )

    await wait_until(pruned, timeout=60, message="the removed fields gone from the StatefulSet")
    assert operator.failures() == []


async def test_missing_secret_is_degraded_not_a_crash(
    kube: Kube, namespace: str, operator: Any, pdc: Any, wait_until: Any, sim_cluster: Any
) -> None:
    engine = {**sim_cluster("x")["spec"]["engine"], "hfTokenSecret": {"name": "hf-token"}}
    await pdc.apply(sim_cluster("gated", engine=engine))

    async def degraded() -> dict | None:
        c = await pdc.condition("gated", "Degraded")
        return c if c and c["status"] == "True" else None

    cond = await wait_until(degraded, timeout=30, message="Degraded condition")
    assert cond["reason"] == "SecretNotFound"
    assert "hf-token" in cond["message"] and "create it" in cond["message"]
    # Engines are not rolled onto a config that cannot start; the rest is there.
    assert await kube.get("apps/v1", "StatefulSet", "gated-prefill", namespace) is None
    assert await kube.get("apps/v1", "Deployment", "gated-router", namespace) is not None

    # Events follow the status write that they describe.
    async def warned() -> bool:
        events = await kube.list("v1", "Event", namespace)
        return any(e["reason"] == "SecretNotFound" and e["involvedObject"]["name"] == "gated" for e in events)

    await wait_until(warned, timeout=10, message="SecretNotFound Event")

    await kube.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hf-token", "namespace": namespace},
            "stringData": {"token": "hf_x"},
        }
    )
    await wait_until(lambda: ready(pdc, "gated"), timeout=120, message="Ready once the Secret exists")
    assert (await pdc.condition("gated", "Degraded"))["status"] == "False"
    assert operator.proc.poll() is None


async def test_suspend_and_resume(
    kube: Kube, namespace: str, operator: Any, pdc: Any, wait_until: Any, sim_cluster: Any
) -> None:
    await pdc.apply(sim_cluster("nap", prefill={"replicas": 2, "maxReplicas": 4}))
    await wait_until(lambda: ready(pdc, "nap"), timeout=120, message="Ready")
    await pdc.apply(
        {
            **sim_cluster("nap", prefill={"replicas": 2, "maxReplicas": 4}),
            "spec": {
                **sim_cluster("nap", prefill={"replicas": 2, "maxReplicas": 4})["spec"],
                "suspend": True,
            },
        }
    )

    async def asleep() -> bool:
        pods = await kube.list("v1", "Pod", namespace, label_selector=f"{C.LABEL_CLUSTER}=nap")
        c = await pdc.condition("nap", "Ready")
        return not pods and c and c["reason"] == "Suspended"

    await wait_until(asleep, timeout=120, message="suspended: no pods")
    assert await kube.get("apps/v1", "StatefulSet", "nap-prefill", namespace) is not None  # config kept
    await pdc.apply(sim_cluster("nap", prefill={"replicas": 2, "maxReplicas": 4}))
    await wait_until(lambda: ready(pdc, "nap"), timeout=120, message="resumed")
    assert (await pdc.get("nap"))["status"]["prefill"]["ready"] == 2


async def test_recreated_under_the_same_name_gets_children_of_its_own(
    kube: Kube, namespace: str, operator: Any, pdc: Any, wait_until: Any, sim_cluster: Any
) -> None:
    """Deleted and created again at once, as a GitOps replace does: the old children are
    the garbage collector's, so the new PDCluster must end up with its own set (not
    adopted ones the collector deletes after the status said all was there)."""
    doc = sim_cluster("again")
    doc["spec"]["suspend"] = True
    await pdc.apply(doc)
    await wait_until(lambda: _suspended(pdc, "again"), timeout=60, message="first one reconciled")
    first = {k: v["metadata"]["uid"] for k, v in (await children(kube, namespace, "again")).items() if v}
    await kube.delete(C.API_VERSION, C.KIND, "again", namespace)
    await wait_until(lambda: _gone(pdc, "again"), timeout=30, message="deleted")
    await pdc.apply(doc)
    uid = (await pdc.get("again"))["metadata"]["uid"]

    async def own_set() -> bool:
        now = await children(kube, namespace, "again")
        return all(
            obj is not None
            and [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid]
            and obj["metadata"]["uid"] != first[key]
            for key, obj in now.items()
            if key in first
        )

    await wait_until(own_set, timeout=60, message="a child set of its own")
    await wait_until(lambda: _suspended(pdc, "again"), timeout=60, message="second one reconciled")
    # Nothing of the old set is left for the collector (own_set: every name holds a new
    # object); the set stays the new one's over the operator's next reconciles.
    await reconciles_pass(operator, wait_until, 2, "after the re-creation")
    assert await own_set()


async def _gone(pdc: Any, name: str) -> bool:
    return await pdc.get(name) is None


async def _suspended(pdc: Any, name: str) -> bool:
    ready = await pdc.condition(name, "Ready")
    return bool(ready and ready["reason"] == "Suspended")


BAD_SPECS = [
    ({"prefill": {"replicas": 1, "minReplicas": 2}}, "minReplicas must be <= replicas"),
    ({"decode": {"replicas": 9, "maxReplicas": 8}}, "replicas must be <= maxReplicas"),
    ({"kvTransfer": {"protocol": "rdma"}}, "kvTransfer.protocol rdma needs rdma.mode other than none"),
    ({"rdma": {"mode": "sriov"}}, "rdma.mode sriov needs at least one Multus network"),
    ({"prefill": {"tensorParallelSize": 3}, "decode": {"tensorParallelSize": 2}}, "must divide one another"),
    ({"prefill": {"tensorParallelSize": 2, "gpusPerPod": 1}}, "gpusPerPod must be at least"),
    ({"autoscaling": {"enabled": True, "gpuBudget": 1}}, "gpuBudget must cover"),
    (
        {
            "mode": "colocated",
            "colocated": {"minReplicas": 3},
            "autoscaling": {"enabled": True, "gpuBudget": 2},
        },
        "gpuBudget must cover the GPUs of colocated.minReplicas",
    ),
    ({"mode": "mixed"}, 'spec.mode: Unsupported value: "mixed"'),
    ({"prefill": {"tensorParallelSize": 12, "gpusPerNode": 8}}, "must be a multiple of gpusPerNode"),
    (
        {"prefill": {"tensorParallelSize": 16, "dataParallelSize": 2, "gpusPerNode": 8}},
        "a role spanning nodes",
    ),
    ({"rdma": {"mode": "infiniband"}}, 'Unsupported value: "infiniband"'),
    ({"prefill": {"replicas": -1}}, "spec.prefill.replicas"),
    ({"engine": {"shmSize": "lots"}}, "spec.engine.shmSize"),
    (
        {"mooncake": {"store": {"enabled": True, "engineBufferSize": 0}}},
        "engineBufferSize must be above 0 when the store is enabled",
    ),
    (
        {"mooncake": {"store": {"enabled": True, "engineSegmentSize": "0Gi"}}},
        "engineSegmentSize must be above 0",
    ),
    ({"mooncake": {"store": {"ssd": {"enabled": True}}}}, "mooncake.store.ssd needs store pods"),
    (
        {"mooncake": {"store": {"replicas": 1, "ssd": {"storageClassName": "nvme", "hostPath": "/nvme"}}}},
        "a storageClassName or a hostPath, not both",
    ),
    ({"mooncake": {"image": ""}}, "spec.mooncake.image"),
    ({"mooncake": {"highAvailability": {"enabled": True}}}, "mooncake.highAvailability needs etcdEndpoints"),
    (
        {
            "mooncake": {
                "httpMetadataServer": True,
                "highAvailability": {"enabled": True, "etcdEndpoints": ["etcd:2379"]},
            }
        },
        "httpMetadataServer cannot be used with highAvailability",
    ),
    (
        {"mooncake": {"highAvailability": {"enabled": True, "etcdEndpoints": ["http://etcd:2379"]}}},
        "spec.mooncake.highAvailability.etcdEndpoints[0]",
    ),
    ({"mooncake": {"highAvailability": {"replicas": 1}}}, "spec.mooncake.highAvailability.replicas"),
]


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS, ids=[m[:40] for _, m in BAD_SPECS])
async def test_invalid_specs_are_rejected_with_the_field(
    kube: Kube, crd: None, namespace: str, spec: dict, message: str
) -> None:
    doc = {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "metadata": {"name": "bad", "namespace": namespace},
        "spec": {"model": {"name": "m"}, **spec},
    }
    with pytest.raises(ApiError) as err:
        await kube.create(doc)
    assert err.value.status == 422
    assert message in err.value.message


async def test_long_names_are_rejected(kube: Kube, crd: None, namespace: str) -> None:
    doc = {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "metadata": {"name": "x" * 41, "namespace": namespace},
        "spec": {"model": {"name": "m"}},
    }
    with pytest.raises(ApiError, match="at most 40 characters"):
        await kube.create(doc)


async def test_server_side_defaults_match_the_models(kube: Kube, crd: None, namespace: str) -> None:
    """The CRD's defaults and the pydantic defaults must agree, or the operator and the
    apiserver would disagree about what a spec means."""
    created = await kube.create(
        {
            "apiVersion": C.API_VERSION,
            "kind": C.KIND,
            "metadata": {"name": "defaults", "namespace": namespace},
            "spec": {"model": {"name": "m"}},
        }
    )
    model = PDClusterSpec.model_validate({"model": {"name": "m"}}).wire()

    def subset(stored: Any, expected: Any, path: str = "spec") -> None:
        if isinstance(stored, dict):
            for key, value in stored.items():
                assert key in expected, f"{path}.{key} defaulted by the apiserver but not by the models"
                subset(value, expected[key], f"{path}.{key}")
        else:
            assert stored == expected, f"{path}: apiserver {stored!r} != models {expected!r}"

    subset(created["spec"], model)


async def test_external_mode_scales_a_role_through_its_scaler(
    kube: Kube, namespace: str, operator: Any, pdc: Any, wait_until: Any, local_cluster: Any, sim_cluster: Any
) -> None:
    """HPA and KEDA scale through /scale; `kubectl scale` takes the same path."""
    await pdc.apply(
        sim_cluster(
            "ext",
            prefill={"replicas": 1, "maxReplicas": 3},
            autoscaling={"enabled": True, "mode": "external"},
        )
    )
    await wait_until(lambda: ready(pdc, "ext"), timeout=120, message="Ready")
    scaler = await kube.get(C.API_VERSION, C.SCALER_KIND, "ext-prefill", namespace)
    assert scaler["spec"]["replicas"] == 1
    assert scaler["metadata"]["ownerReferences"][0]["name"] == "ext"
    kubectl = [
        f"{local_cluster.bin_dir}/kubectl",
        f"--kubeconfig={local_cluster.kubeconfig}",
        "-n",
        namespace,
    ]
    subprocess.run(
        [*kubectl, "scale", "pdrs", "ext-prefill", "--replicas=2"], check=True, capture_output=True
    )

    async def scaled() -> bool:
        sts = await kube.get("apps/v1", "StatefulSet", "ext-prefill", namespace)
        s = await kube.get(C.API_VERSION, C.SCALER_KIND, "ext-prefill", namespace)
        return sts["spec"]["replicas"] == 2 and (s.get("status") or {}).get("replicas") == 2

    await wait_until(scaled, timeout=30, message="StatefulSet follows the scaler")
    await wait_until(lambda: ready(pdc, "ext"), timeout=120, message="2 prefill pods ready")
    scale = await kube.request(
        "GET", f"/apis/{C.API_VERSION}/namespaces/{namespace}/pdrolescalers/ext-prefill/scale"
    )
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == "pdcluster.io/cluster=ext,pdcluster.io/role=prefill"
    # Out of bounds is clamped to the role's maxReplicas; the spec is never written.
    subprocess.run(
        [*kubectl, "scale", "pdrs", "ext-prefill", "--replicas=9"], check=True, capture_output=True
    )

    async def clamped() -> bool:
        sts = await kube.get("apps/v1", "StatefulSet", "ext-prefill", namespace)
        return sts["spec"]["replicas"] == 3

    await wait_until(clamped, timeout=30, message="StatefulSet at the role's maxReplicas")
    assert (await pdc.get("ext"))["spec"]["prefill"]["replicas"] == 1
