"""Flexible mode: the split rule, how routers find flexible engines and their order, and
what the CRD and the models refuse."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pdcluster import constants as C
from pdcluster import flexible
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.api.validate import problems
from pdcluster.render import Owner, Replicas, render_all
from pdcluster.router.discovery import members_from_pods, members_from_slices, parse_static
from pdcluster.router.membership import assign_roles

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pdcluster-flexible.yaml"
DOC = yaml.safe_load(EXAMPLE.read_text())


@pytest.mark.parametrize(
    ("engines", "asked", "split"),
    [(0, 1, (0, 0)), (1, 1, (0, 0)), (2, 0, (1, 1)), (2, 5, (1, 1)), (4, 1, (1, 3)), (4, 3, (3, 1)), (5, 9, (4, 1))],
)
def test_at_least_one_engine_of_each_role(engines: int, asked: int, split: tuple[int, int]) -> None:
    assert flexible.split(engines, asked) == split


def test_roles_follow_pool_order() -> None:
    assert assign_roles(["a", "b", "c"], 2) == {"a": "prefill", "b": "prefill", "c": "decode"}
    assert assign_roles(["a", "b", "c"], 0) == {"a": "prefill", "b": "decode", "c": "decode"}
    assert assign_roles(["a"], 1) == {"a": C.ROLE_COLOCATED}  # alone: requests served whole


def test_static_flexible_engines_keep_their_flag_order() -> None:
    members = parse_static([], [], [], ["http://127.1.0.9:8000#bootstrap=9000", "http://127.1.0.2:8000"])
    assert members.flexible == {
        "http://127.1.0.9:8000": "http://127.1.0.9:9000",
        "http://127.1.0.2:8000": "http://127.1.0.2:8998",
    }
    assert members.ordinals == {"http://127.1.0.9:8000": 0, "http://127.1.0.2:8000": 1}


def _slice(*endpoints: tuple[str, str | None]) -> dict:
    return {
        "metadata": {"labels": {C.LABEL_ROLE: C.ROLE_FLEXIBLE}},
        "ports": [{"name": "http", "port": 8000}, {"name": "bootstrap", "port": 8998}],
        "endpoints": [
            {"addresses": [ip], **({"targetRef": {"kind": "Pod", "name": name}} if name else {})}
            for ip, name in endpoints
        ],
    }


def test_flexible_engines_are_ordered_by_their_pods_ordinals() -> None:
    members = members_from_slices([_slice(("10.0.0.3", "agile-flexible-10"), ("10.0.0.1", "agile-flexible-2"))])
    assert members.flexible == {
        "http://10.0.0.3:8000": "http://10.0.0.3:8998",
        "http://10.0.0.1:8000": "http://10.0.0.1:8998",
    }
    assert members.ordinals == {"http://10.0.0.1:8000": 2, "http://10.0.0.3:8000": 10}
    # An endpoint without a pod name goes after the named ones.
    unnamed = members_from_slices([_slice(("10.0.0.7", None), ("10.0.0.1", "agile-flexible-0"))])
    assert unnamed.ordinals == {"http://10.0.0.1:8000": 0, "http://10.0.0.7:8000": 1}


def test_flexible_pods_become_flexible_engines() -> None:
    pod = {
        "metadata": {"name": "agile-flexible-1", "labels": {C.LABEL_ROLE: C.ROLE_FLEXIBLE}},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": "127.1.0.4", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    members = members_from_pods([pod])
    assert members.flexible == {"http://127.1.0.4:8000": "http://127.1.0.4:8998"}
    assert members.ordinals == {"http://127.1.0.4:8000": 1}
    assert not members.prefill and not members.decode and not members.colocated


def test_the_pool_is_one_statefulset_of_both_roles_engines_with_kv_both() -> None:
    spec = PDClusterSpec.model_validate(DOC["spec"])
    objs = render_all(spec, Owner("agile", "ns", "uid"), Replicas.choose(spec, None))
    workloads = {o["metadata"]["name"]: o for o in objs if o["kind"] == "StatefulSet"}
    assert set(workloads) == {"agile-flexible"}
    assert workloads["agile-flexible"]["spec"]["replicas"] == 4  # prefill 1 + decode 3
    container = workloads["agile-flexible"]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    kv = yaml.safe_load(args[args.index("--kv-transfer-config") + 1])
    assert (kv["kv_connector"], kv["kv_role"]) == ("MooncakeConnector", "kv_both")
    assert {"name": "VLLM_MOONCAKE_BOOTSTRAP_PORT", "value": "8998"} in container["env"]
    roles = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "agile-router-roles")
    assert roles["data"] == {C.KEY_PREFILL_ENGINES: "1"}
    router = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "agile-router")
    assert "--roles-configmap=agile-router-roles" in router["spec"]["template"]["spec"]["containers"][0]["args"]


def _with(**changes: dict) -> dict:
    doc = copy.deepcopy(DOC)
    for section, values in changes.items():
        doc["spec"].setdefault(section, {}).update(values)
    return doc


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (_with(decode={"tensorParallelSize": 2}), "spec.decode.tensorParallelSize"),
        (_with(prefill={"gpusPerPod": 2}), "spec.decode.gpusPerPod"),
        (_with(decode={"gpuResourceName": "amd.com/gpu"}), "spec.decode.gpuResourceName"),
        (_with(prefill={"gpusPerNode": 1, "tensorParallelSize": 2}, decode={"tensorParallelSize": 2}),
         "spec.prefill.gpusPerNode"),
        (_with(autoscaling={"enabled": True, "mode": "external"}), "spec.autoscaling.mode"),
    ],
)  # fmt: skip
def test_the_crd_refuses_what_one_configuration_cannot_run_naming_the_field(doc: dict, field: str) -> None:
    found = problems(doc)
    assert any(p.startswith(field) and "flexible" in p for p in found), found


def test_the_law_autoscales_a_flexible_pool_but_hpa_cannot() -> None:
    """The operator's law moves engines between the roles of one pool; HPA or KEDA
    (mode external) scale one workload per role and cannot."""
    assert problems(_with(autoscaling={"enabled": True})) == []
    assert problems(_with(autoscaling={"enabled": True, "mode": "recommend"})) == []
    with pytest.raises(ValueError, match=r"autoscaling\.mode auto or recommend"):
        PDClusterSpec.model_validate(_with(autoscaling={"enabled": True, "mode": "external"})["spec"])


def test_pod_settings_that_differ_are_refused_by_name() -> None:
    spec = {**DOC["spec"], "decode": {"replicas": 3, "args": ["--max-num-seqs=512"], "nodeSelector": {"a": "b"}}}
    with pytest.raises(ValueError, match="differ in args, nodeSelector"):
        PDClusterSpec.model_validate(spec)
    assert problems(DOC) == []


def test_a_flip_counts_the_engines_that_change_role_either_way() -> None:
    spec = PDClusterSpec.model_validate(
        {"model": {"name": "m"}, "mode": "flexible", "prefill": {"replicas": 1}, "decode": {"replicas": 3}}
    )
    first = flexible.record_flip(spec, None, None, "t0")
    assert (first.prefill_engines, first.flips, first.last_flip) == (1, 0, None)
    assert flexible.record_flip(spec, None, first, "t1") is first  # no change, nothing recorded
    assert flexible.flip_event(first, first) is None

    more_prefill = spec.model_copy(update={"prefill": spec.prefill.model_copy(update={"replicas": 3})})
    moved = flexible.record_flip(more_prefill, None, first, "t2")
    assert (moved.prefill_engines, moved.flips, moved.last_flip_time) == (3, 2, "t2")
    assert moved.last_flip == "2 engines decode -> prefill: prefill engines 1 -> 3 of 6"
    back = flexible.record_flip(spec, None, moved, "t3")
    assert (back.flips, back.last_flip) == (4, "2 engines prefill -> decode: prefill engines 3 -> 1 of 4")
    assert flexible.flip_event(moved, back) == ("RolesFlipped", back.last_flip)
