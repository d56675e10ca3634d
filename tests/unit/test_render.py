"""Rendering is pure: goldens for each example, plus the invariants every child keeps."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import AutoscalingState, PDClusterSpec
from pdcluster.render import Owner, Replicas, render_all
from pdcluster.render import router as router_render
from pdcluster.render.engine import engine_args, engine_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("pdcluster-*.yaml"))
GOLDEN = Path(__file__).parent / "golden"
VLLM_FLAGS = {
    line.strip()
    for line in (ROOT / "tests/fixtures/vllm-serve-flags.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:
        return True


def _load(path: Path) -> tuple[PDClusterSpec, Owner]:
    doc = yaml.safe_load(path.read_text())
    return PDClusterSpec.model_validate(doc["spec"]), Owner(doc["metadata"]["name"], "serving", "uid-1234")


def _render(path: Path) -> list[dict]:
    spec, owner = _load(path)
    return render_all(spec, owner, Replicas.choose(spec, None))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_golden(example: Path) -> None:
    text = yaml.dump_all(_render(example), Dumper=_NoAliases, sort_keys=False, width=120)
    golden = GOLDEN / f"{example.stem}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), (
        f"rendering of {example.name} changed; rerun with UPDATE_GOLDEN=1 and review"
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_children_invariants(example: Path) -> None:
    objects = _render(example)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names))
    for obj in objects:
        meta = obj["metadata"]
        assert len(meta["name"]) <= 63
        if obj["kind"] == "PersistentVolumeClaim" and "ownerReferences" not in meta:
            assert "retain: true" in example.read_text()  # a cache claim kept past its PDCluster
        else:
            assert meta["ownerReferences"][0]["kind"] == "PDCluster"
            assert meta["ownerReferences"][0]["controller"] is True
        assert meta["labels"][C.LABEL_CLUSTER] == objects[0]["metadata"]["labels"][C.LABEL_CLUSTER]
        assert meta["labels"][C.LABEL_ROLE]
        template = obj.get("spec", {}).get("template")
        if template and "selector" in obj["spec"]:  # a Job chooses its own
            selector = obj["spec"]["selector"]["matchLabels"]
            assert selector.items() <= template["metadata"]["labels"].items()


def test_longest_name_fits() -> None:
    owner = Owner("x" * C.MAX_CLUSTER_NAME_LEN, "ns", "uid")
    cache, _ = _load(ROOT / "examples/pdcluster-model-cache.yaml")
    for obj in render_all(_load(EXAMPLES[0])[0], owner, Replicas(1, 1)) + render_all(cache, owner, Replicas(1, 1)):
        if obj["kind"] == "Job":  # its pods add "-<5 characters>"
            assert len(obj["metadata"]["name"]) + 6 <= 63
        assert len(obj["metadata"]["name"]) <= 63
        if obj["kind"] == "StatefulSet":  # pods add "-<ordinal>", revisions "-<10-char hash>"
            assert len(obj["metadata"]["name"]) + 11 <= 63


VLLM_EXAMPLES = [p for p in EXAMPLES if _load(p)[0].engine.command[0] == "vllm"]


@pytest.mark.parametrize("example", VLLM_EXAMPLES, ids=lambda p: p.stem)
def test_engine_args_are_vllm_flags(example: Path) -> None:
    spec, _ = _load(example)
    for role in C.ENGINE_ROLES:
        for arg in engine_args(spec, role):
            if arg.startswith("--"):
                assert arg.split("=", 1)[0] in VLLM_FLAGS, f"{arg} is not a vllm serve flag"


def test_kv_transfer_config_matches_connector() -> None:
    spec, _ = _load(ROOT / "examples/pdcluster-tcp.yaml")
    for role, kv_role in ((C.ROLE_PREFILL, "kv_producer"), (C.ROLE_DECODE, "kv_consumer")):
        args = engine_args(spec, role)
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert config == {
            "kv_connector": "MooncakeConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
            "kv_load_failure_policy": "recompute",
        }


def test_the_store_runs_beside_the_handoff() -> None:
    """MultiConnector: the hand-off first (a prefilled request always takes it), the store
    second; prefill writes and reads the store, decode reads it; TP4 prefill and TP2
    decode share keys in a TP4 layout."""
    spec, _ = _load(ROOT / "examples/pdcluster-rdma.yaml")
    handoff_extra = {"mooncake_protocol": "rdma", "device_name": "mlx5_0,mlx5_1,mlx5_2,mlx5_3"}
    for role, kv_role, store_role in (
        (C.ROLE_PREFILL, "kv_producer", "kv_both"),
        (C.ROLE_DECODE, "kv_consumer", "kv_consumer"),
    ):
        args = engine_args(spec, role)
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert config == {
            "kv_connector": "MultiConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {
                "connectors": [
                    {
                        "kv_connector": "MooncakeConnector",
                        "kv_role": kv_role,
                        "kv_connector_extra_config": handoff_extra,
                    },
                    {
                        "kv_connector": "MooncakeStoreConnector",
                        "kv_role": store_role,
                        "kv_connector_extra_config": {"store_tp_size": 4},
                    },
                ]
            },
            "kv_load_failure_policy": "recompute",
        }
    objects = _render(ROOT / "examples/pdcluster-rdma.yaml")
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    for role in C.ENGINE_ROLES:
        pod = _engine_pod(objects, role)
        container = pod["containers"][0]
        path = Path(_env(container)["MOONCAKE_CONFIG_PATH"])
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == config["metadata"]["name"]
        engine = json.loads(config["data"][path.name])
        assert engine == {
            "mode": "embedded",
            "metadata_server": "http://llama-70b-mooncake-master:8080/metadata",
            "master_server_address": "llama-70b-mooncake-master:50051",
            "protocol": "rdma",
            "device_name": "mlx5_0,mlx5_1,mlx5_2,mlx5_3",
            "global_segment_size": 32 * 2**30,
            "local_buffer_size": 4 * 2**30,
            "enable_offload": True,  # the store has an SSD tier: loads may come from it
        }
        assert not any(
            name.startswith("MOONCAKE_") for name in _env(container) if name != "MOONCAKE_CONFIG_PATH"
        )
        assert "envFrom" not in container
    master = next(o for o in objects if o["kind"] == "Deployment" and "master" in o["metadata"]["name"])
    assert "--enable_http_metadata_server=true" in master["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_ssd_tier_offloads_from_the_store_pods() -> None:
    objects = _render(ROOT / "examples/pdcluster-rdma.yaml")
    config = next(o for o in objects if o["kind"] == "ConfigMap")["data"]
    store = json.loads(config["store.json"])
    assert store["enable_ssd_offload"] is True
    assert json.loads(config["engine.json"])["enable_offload"] is True
    sts = next(
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("mooncake-store")
    )
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "local-nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "4Ti"
    container = sts["spec"]["template"]["spec"]["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert mount["mountPath"] == store["ssd_offload_path"]
    master = next(o for o in objects if o["kind"] == "Deployment" and "master" in o["metadata"]["name"])
    args = master["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--enable_offload=true", "--offload_on_evict=true", "--promotion_on_hit=true"} <= set(args)


@pytest.mark.parametrize(("ssd", "volume"), [({"hostPath": "/nvme"}, "hostPath"), ({}, "emptyDir")])
def test_an_ssd_tier_without_a_storage_class(ssd: dict, volume: str) -> None:
    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "mooncake": {"store": {"replicas": 1, "ssd": {"enabled": True, "size": "2Ti", **ssd}}},
        }
    )
    objects = render_all(spec, Owner("c", "ns", "uid"), Replicas.choose(spec, None))
    sts = next(
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "c-mooncake-store"
    )
    assert "volumeClaimTemplates" not in sts["spec"]
    (tier,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "ssd"]
    assert volume in tier


def test_without_the_store_engines_read_no_mooncake_config() -> None:
    objects = _render(ROOT / "examples/pdcluster-tcp.yaml")
    configmaps = [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"]
    assert configmaps == ["llama-tcp-router-state"], "only the routers' verdicts"
    container = _engine_pod(objects, C.ROLE_DECODE)["containers"][0]
    assert not [name for name in _env(container) if name.startswith("MOONCAKE_")]
    assert [m["name"] for m in container["volumeMounts"]] == ["dshm"]


def _engine_pod(objects: list[dict], role: str) -> dict:
    sts = next(
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["labels"][C.LABEL_ROLE] == role
    )
    return sts["spec"]["template"]["spec"]


def _env(container: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_engine_pod_wiring() -> None:
    objects = _render(ROOT / "examples/pdcluster-rdma.yaml")
    prefill, decode = _engine_pod(objects, C.ROLE_PREFILL), _engine_pod(objects, C.ROLE_DECODE)
    p_env, d_env = _env(prefill["containers"][0]), _env(decode["containers"][0])
    assert p_env["VLLM_HOST_IP"] == "$(POD_IP)"
    assert p_env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "8998"
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in d_env
    assert p_env["PYTHONHASHSEED"] == d_env["PYTHONHASHSEED"]
    assert p_env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1,mlx5_2,mlx5_3"
    assert p_env["NCCL_IB_GID_INDEX"] == p_env["MC_GID_INDEX"] == "3"
    limits = prefill["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 4 and limits["rdma/rdma_shared_device_a"] == 1
    assert _engine_pod(objects, C.ROLE_DECODE)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert prefill["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert prefill["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}


def test_tcp_engines_get_no_capabilities() -> None:
    objects = _render(ROOT / "examples/pdcluster-tcp.yaml")
    container = _engine_pod(objects, C.ROLE_PREFILL)["containers"][0]
    assert "capabilities" not in container["securityContext"]
    assert "rdma/rdma_shared_device_a" not in container["resources"]["limits"]


def test_rdma_modes() -> None:
    sriov = _render(ROOT / "examples/pdcluster-sriov.yaml")
    pod = next(o for o in sriov if o["kind"] == "StatefulSet")["spec"]["template"]
    assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "roce-net"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/sriov_rdma_vf"] == 1
    hostnet = _render(ROOT / "examples/pdcluster-hostnetwork.yaml")
    pod = next(o for o in hostnet if o["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert {"name": "infiniband", "mountPath": "/dev/infiniband"} in pod["containers"][0]["volumeMounts"]


def _store_pod(objects: list[dict]) -> dict:
    sts = next(
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("mooncake-store")
    )
    return sts["spec"]["template"]


@pytest.mark.parametrize(
    "example", ["pdcluster-rdma", "pdcluster-sriov", "pdcluster-hostnetwork", "pdcluster-tcp"]
)
def test_store_pods_reach_the_fabric_as_engines_do(example: str) -> None:
    doc = yaml.safe_load((ROOT / f"examples/{example}.yaml").read_text())
    doc["spec"].setdefault("mooncake", {}).setdefault("store", {})["replicas"] = 1
    spec = PDClusterSpec.model_validate(doc["spec"])
    objects = render_all(spec, Owner("c", "ns", "uid"), Replicas.choose(spec, None))
    engine, store = _engine_pod(objects, C.ROLE_PREFILL), _store_pod(objects)
    e, s = engine["containers"][0], store["spec"]["containers"][0]
    rdma_env = {"NCCL_IB_HCA", "UCX_NET_DEVICES", "NCCL_IB_GID_INDEX", "MC_GID_INDEX"}
    assert {k: v for k, v in _env(s).items() if k in rdma_env} == {
        k: v for k, v in _env(e).items() if k in rdma_env
    }
    gpu = spec.prefill.gpu_resource_name
    assert {k: v for k, v in e["resources"].get("limits", {}).items() if k != gpu and "/" in k} == {
        k: v for k, v in s["resources"].get("limits", {}).items() if "/" in k
    }
    assert e["securityContext"].get("capabilities", {}).get("add") == s["securityContext"][
        "capabilities"
    ].get("add")
    for field in ("hostNetwork", "dnsPolicy"):
        assert engine.get(field) == store["spec"].get(field)
    networks = "k8s.v1.cni.cncf.io/networks"
    assert (store.get("metadata") or {}).get("annotations", {}).get(networks) == engine_annotations(
        objects
    ).get(networks)
    on_fabric = spec.rdma.mode != "none"
    assert (store["spec"]["securityContext"]["runAsUser"] == 0) == on_fabric
    assert ("/dev/infiniband" in [m["mountPath"] for m in s["volumeMounts"]]) == (
        spec.rdma.mode == "hostNetwork"
    )


def engine_annotations(objects: list[dict]) -> dict:
    sts = next(
        o
        for o in objects
        if o["kind"] == "StatefulSet" and o["metadata"]["labels"][C.LABEL_ROLE] == C.ROLE_PREFILL
    )
    return sts["spec"]["template"]["metadata"]["annotations"]


def test_masters_elect_a_leader_through_etcd_and_clients_find_it_there() -> None:
    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "mooncake": {
                "store": {"enabled": True, "replicas": 1},
                "highAvailability": {
                    "enabled": True,
                    "replicas": 3,
                    "etcdEndpoints": ["etcd-0:2379", "etcd-1:2379"],
                },
            },
        }
    )
    objects = render_all(spec, Owner("c", "ns", "uid"), Replicas.choose(spec, None))
    master = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "c-mooncake-master"
    )
    assert master["spec"]["replicas"] == 3
    assert master["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    args = master["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {
        "--enable_ha=true",
        "--ha_backend_type=etcd",
        "--ha_backend_connstring=etcd-0:2379;etcd-1:2379",
        "--cluster_id=pdcluster.ns.c",
        "--rpc_address=$(POD_IP)",
    } <= set(args)
    assert not [a for a in args if a.startswith("--enable_http_metadata_server")]  # metadata in etcd
    config = next(o for o in objects if o["kind"] == "ConfigMap")["data"]
    for name in ("engine.json", "store.json"):
        client = json.loads(config[name])
        assert (
            client["master_server_address"] == client["metadata_server"] == "etcd://etcd-0:2379;etcd-1:2379"
        )
    for pod in (_engine_pod(objects, C.ROLE_DECODE), _store_pod(objects)["spec"]):
        env = _env(pod["containers"][0])
        assert env["MC_STORE_CLUSTER_ID"] == env["MC_METADATA_CLUSTER_ID"] == "pdcluster.ns.c"
    single = PDClusterSpec.model_validate({"model": {"name": "m"}, "mooncake": {"store": {"enabled": True}}})
    objects = render_all(single, Owner("c", "ns", "uid"), Replicas.choose(single, None))
    master = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "c-mooncake-master"
    )
    assert master["spec"]["replicas"] == 1 and master["spec"]["strategy"] == {"type": "Recreate"}
    assert "MC_STORE_CLUSTER_ID" not in _env(_engine_pod(objects, C.ROLE_DECODE)["containers"][0])


def test_replicas_come_from_one_place() -> None:
    spec, owner = _load(ROOT / "examples/pdcluster-autoscaling.yaml")
    state = AutoscalingState(prefill=5, decode=1)
    assert Replicas.choose(spec, state) == Replicas(2, 2)  # recommend mode: spec wins
    auto = spec.model_copy(update={"autoscaling": spec.autoscaling.model_copy(update={"mode": "auto"})})
    assert Replicas.choose(auto, state) == Replicas(5, 1)
    assert Replicas.choose(auto, AutoscalingState(prefill=50, decode=0)) == Replicas(
        8, 1
    )  # clamped to min/max
    assert Replicas.choose(auto, None) == Replicas(2, 2)
    suspended = auto.model_copy(update={"suspend": True})
    assert Replicas.choose(suspended, state) == Replicas(0, 0)
    objects = render_all(suspended, owner, Replicas.choose(suspended, state))
    workloads = {
        o["metadata"]["name"]: o["spec"]["replicas"]
        for o in objects
        if o["kind"] in ("StatefulSet", "Deployment")
    }
    assert set(workloads.values()) == {0}


def test_mooncake_sizes_are_bytes() -> None:
    """Mooncake parses byte counts, not Kubernetes suffixes: every quantity becomes bytes,
    fractional ones too (a "1.5Gi" used to be passed on as it was)."""
    from pdcluster.render import mooncake

    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "mooncake": {
                "store": {
                    "enabled": True,
                    "replicas": 1,
                    "globalSegmentSize": "1.5Gi",
                    "localBufferSize": "512Mi",
                    "engineSegmentSize": "100M",
                }
            },
        }
    )
    data = mooncake.config_map(spec, Owner("c", "ns", "uid"))["data"]
    store, engine = json.loads(data[mooncake.STORE_CONFIG]), json.loads(data[mooncake.ENGINE_CONFIG])
    assert (store["global_segment_size"], store["local_buffer_size"]) == (3 * 2**29, 2**29)
    assert (engine["global_segment_size"], engine["local_buffer_size"]) == (10**8, 2**30)


@pytest.mark.parametrize(("grace", "drain"), [(120, 113), (30, 23), (8, 1), (3, 0), (0, 0)])
def test_engines_drain_in_the_grace_period_the_prestop_sleep_leaves(grace: int, drain: int) -> None:
    spec = PDClusterSpec.model_validate(
        {"model": {"name": "m"}, "engine": {"terminationGracePeriodSeconds": grace}}
    )
    for role in C.ENGINE_ROLES:
        args = engine_args(spec, role)
        assert args[args.index("--shutdown-timeout") + 1] == str(drain)


def _template(spec: PDClusterSpec, name: str) -> dict:
    objects = render_all(spec, Owner("c", "ns", "uid"), Replicas.choose(spec, None))
    return next(o for o in objects if o["metadata"]["name"] == name and "template" in o["spec"])["spec"][
        "template"
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"engine": {"image": "vllm/vllm-openai:v0.33.1", "args": ["--max-num-seqs=64"]}},
        {"prefill": {"replicas": 3, "tensorParallelSize": 2}, "decode": {"tensorParallelSize": 2}},
        {"router": {"policy": "least-loaded", "storeHits": {"maxComputedTokens": 64}}},
        {"autoscaling": {"enabled": True, "gpuBudget": 16}},
        {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}},
    ],
    ids=["engine image and args", "engine sizes", "router", "autoscaling", "model"],
)
def test_the_mooncake_pods_restart_only_for_their_own_changes(change: dict) -> None:
    base = {"model": {"name": "m"}, "mooncake": {"store": {"enabled": True, "replicas": 1}}}
    before = PDClusterSpec.model_validate(base)
    after = PDClusterSpec.model_validate({**base, **change, "model": change.get("model", base["model"])})
    for name in ("c-mooncake-master", "c-mooncake-store"):
        assert _template(before, name) == _template(after, name), name
    own = PDClusterSpec.model_validate(
        {**base, "mooncake": {**base["mooncake"], "image": "pdcluster/mooncake:0.2.0"}}
    )
    assert _template(before, "c-mooncake-master") != _template(own, "c-mooncake-master")


def test_an_engine_api_key_reaches_engines_and_the_router_only() -> None:
    """Engines read VLLM_API_KEY (vLLM's serve middleware guards /v1 with it); the router
    mounts the same Secret next to its own client key and sends it."""
    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "engine": {"apiKeySecret": {"name": "engine-key", "key": "token"}},
            "router": {"apiKeySecret": {"name": "client-key", "key": "k"}, "retries": {"maxAttempts": 5}},
        }
    )
    owner = Owner("pd", "serving", "uid-1")
    for role in C.ENGINE_ROLES:
        env = {e["name"]: e for e in engine_env(spec, owner, role)}
        assert env["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "engine-key", "key": "token"}}
    args = router_render.router_args(spec, owner)
    assert "--engine-api-key-file=/etc/pdcluster/engine-api-key/token" in args
    assert "--api-key-file=/etc/pdcluster/api-key/k" in args
    assert "--max-attempts=5" in args and "--prefill-timeout=120" in args
    pod = router_render.deployment(spec, owner, 1)["spec"]["template"]["spec"]
    assert {v["secret"]["secretName"] for v in pod["volumes"]} == {"engine-key", "client-key"}
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts == {"/etc/pdcluster/engine-api-key", "/etc/pdcluster/api-key"}


def test_prefill_keeps_kv_no_longer_than_the_router_waits() -> None:
    spec = PDClusterSpec.model_validate({"model": {"name": "m"}, "router": {"requestTimeoutSeconds": 90}})
    for role in C.ENGINE_ROLES:
        env = {e["name"]: e.get("value") for e in engine_env(spec, Owner("pd", "serving", "uid-1"), role)}
        assert env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] == "90"


def test_the_router_connection_limits_reach_its_args_and_the_router_takes_them() -> None:
    from pdcluster.router.flags import parser

    connections = {"headTimeoutSeconds": 10, "bodyTimeoutSeconds": 20, "maxConnections": 500}
    spec = PDClusterSpec.model_validate({"model": {"name": "m"}, "router": {"connections": connections}})
    args = router_render.router_args(spec, Owner("pd", "serving", "uid-1"))
    assert {"--head-timeout=10", "--body-timeout=20", "--max-connections=500"} <= set(args)
    parsed = parser().parse_args(args)
    assert (parsed.head_timeout, parsed.body_timeout, parsed.max_connections) == (10.0, 20.0, 500)


def test_a_colocated_pool_serves_whole_requests() -> None:
    """No hand-off connector and no bootstrap server; chunked prefill on; with the store,
    MooncakeStoreConnector alone reads and writes; the router neither probes hand-offs
    nor sends prompts past a prefill that is not there."""
    spec = PDClusterSpec.model_validate(
        {"model": {"name": "m"}, "mode": "colocated", "colocated": {"replicas": 3, "tensorParallelSize": 2},
         "mooncake": {"store": {"enabled": True}}}
    )  # fmt: skip
    owner = Owner("pd", "serving", "uid-1")
    objects = render_all(spec, owner, Replicas.choose(spec, None))
    workloads = {o["metadata"]["name"]: o for o in objects if o["kind"] == "StatefulSet"}
    assert set(workloads) == {"pd-colocated"}
    assert workloads["pd-colocated"]["spec"]["replicas"] == 3
    engine = _engine_pod(objects, C.ROLE_COLOCATED)["containers"][0]
    args = engine["args"]
    assert "--enable-chunked-prefill" in args and args[args.index("--tensor-parallel-size") + 1] == "2"
    assert json.loads(args[args.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {},
    }  # fmt: skip
    assert [p["name"] for p in engine["ports"]] == ["http"]
    env = _env(engine)
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in env and "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT" not in env
    assert env["MOONCAKE_CONFIG_PATH"]
    router = router_render.router_args(spec, owner)
    assert "--kv-probe-interval=0" in router and not [a for a in router if a.startswith("--store-master")]
    without_store = spec.model_copy(
        update={"mooncake": PDClusterSpec.model_validate({"model": {"name": "m"}}).mooncake}
    )
    assert "--kv-transfer-config" not in engine_args(without_store, C.ROLE_COLOCATED)
    assert Replicas.choose(spec, None) == Replicas(0, 0, 3)


def test_rdma_qos_and_transfer_ports_by_the_guide() -> None:
    """Mooncake's transfer engine reads MC_IB_TC/MC_IB_SL and binds its RPC port in
    MC_MIN_RPC_PORT-MC_MAX_RPC_PORT (config.cpp); host devices need SYS_RESOURCE too."""
    spec = PDClusterSpec.model_validate(
        {"model": {"name": "m"}, "rdma": {"mode": "hostNetwork", "trafficClass": 106, "serviceLevel": 3},
         "kvTransfer": {"rpcPortMin": 16000, "rpcPortMax": 16100}, "mooncake": {"store": {"enabled": True, "replicas": 1}}}
    )  # fmt: skip
    objects = render_all(spec, Owner("pd", "serving", "uid-1"), Replicas.choose(spec, None))
    for role in (C.ROLE_PREFILL, C.ROLE_DECODE):
        container = _engine_pod(objects, role)["containers"][0]
        env = _env(container)
        assert (env["MC_IB_TC"], env["NCCL_IB_TC"], env["MC_IB_SL"], env["NCCL_IB_SL"]) == (
            "106",
            "106",
            "3",
            "3",
        )
        assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == ("16000", "16100")
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK", "SYS_RESOURCE"]
    store = _store_pod(objects)["spec"]["containers"][0]
    assert _env(store)["MC_MIN_RPC_PORT"] == "16000"
    assert set(store["securityContext"]["capabilities"]["add"]) == {"IPC_LOCK", "SYS_RESOURCE"}
    tcp = render_all(*_load(ROOT / "examples/pdcluster-tcp.yaml"), Replicas(1, 1))
    env = _env(_engine_pod(tcp, C.ROLE_DECODE)["containers"][0])
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == (
        "15000",
        "17000",
    )  # pinned to Mooncake's default
    assert "MC_IB_TC" not in env


def _rules(policy: dict) -> list[tuple[frozenset, frozenset]]:
    """(who, ports) per ingress rule: who as role sets / 'any' / peer reprs, ports as (port, endPort)."""
    out = []
    for rule in policy["spec"]["ingress"]:
        who = set()
        for peer in rule.get("from", [{"any": True}]):
            if peer == {"any": True}:
                who.add("any")
                continue
            sel = peer.get("podSelector") or {}
            roles = sel.get("matchLabels", {}).get(C.LABEL_ROLE)
            exprs = [tuple(e["values"]) for e in sel.get("matchExpressions", [])]
            who.add(roles or (exprs[0] if exprs else json.dumps(peer, sort_keys=True)))
        ports = frozenset((p["port"], p.get("endPort")) for p in rule["ports"])
        out.append((frozenset(who), ports))
    return out


def test_network_policies_admit_exactly_what_pd_needs() -> None:
    objects = _render(ROOT / "examples/pdcluster-rdma.yaml")
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}
    name = next(iter(policies)).rsplit("-", 1)[0]
    engines = policies[f"{name}-engines"]
    assert engines["spec"]["policyTypes"] == ["Ingress"]
    peers = ("decode", "prefill")
    monitoring = json.dumps(
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}, sort_keys=True
    )
    assert set(_rules(engines)) == {
        (frozenset({"router", monitoring}), frozenset({(8000, None)})),
        (frozenset({"router"}), frozenset({(8998, None)})),
        (frozenset({peers}), frozenset({(8998, None), (49152, 65535)})),
        (frozenset({peers, "mooncake-store"}), frozenset({(15000, 17000), (12300, 14300)})),
    }
    assert _rules(policies[f"{name}-router"]) == [(frozenset({"any"}), frozenset({(8000, None)}))]
    master = set(_rules(policies[f"{name}-mooncake-master"]))
    assert (frozenset({peers, "mooncake-store"}), frozenset({(50051, None)})) in master
    assert (frozenset({"router", monitoring}), frozenset({(9003, None)})) in master
    assert f"{name}-mooncake-store" in policies
    # Off by default; colocated engines exchange no KV, so no bootstrap or side channel.
    assert not [o for o in _render(ROOT / "examples/pdcluster-tcp.yaml") if o["kind"] == "NetworkPolicy"]
    spec = PDClusterSpec.model_validate(
        {"model": {"name": "m"}, "mode": "colocated", "networkPolicy": {"enabled": True}}
    )
    colocated = render_all(spec, Owner("c", "ns", "u"), Replicas.choose(spec, None))
    (rules,) = [_rules(o) for o in colocated if o["metadata"]["name"] == "c-engines"]
    assert {ports for _, ports in rules} == {frozenset({(8000, None)}), frozenset({(15000, 17000)})}
