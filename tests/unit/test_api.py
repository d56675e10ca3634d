"""The pydantic models are the source of truth: the CRD and the API docs are generated
from them, must be structural, and must not drift from what is checked in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from pdcluster.api.crd import CRD_FILES, build_crd, build_scaler_crd, crd_yaml
from pdcluster.api.docs import api_reference
from pdcluster.api.v1alpha1 import KVProtocol, PDClusterSpec

ROOT = Path(__file__).resolve().parents[2]
CRD_COPIES = [
    (folder / name, build)
    for folder in (ROOT / "crds", ROOT / "charts/pdcluster-operator/crds")
    for name, build in CRD_FILES.items()
]


@pytest.mark.parametrize(("path", "build"), CRD_COPIES, ids=[str(p.relative_to(ROOT)) for p, _ in CRD_COPIES])
def test_crd_has_not_drifted(path: Path, build: Callable[[], dict[str, Any]]) -> None:
    assert path.read_text() == crd_yaml(build), f"{path} is stale: run `make generate`"


def test_scaler_crd_has_a_scale_subresource() -> None:
    version = build_scaler_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_api_docs_have_not_drifted() -> None:
    assert (ROOT / "docs/api.md").read_text() == api_reference(), "docs/api.md is stale: run `make generate`"


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, value in node.get("properties", {}).items():
            out += _walk(value, f"{path}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                out += _walk(node[key], f"{path}[]")
    return out


def test_schema_is_structural() -> None:
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    text = yaml.safe_dump(root)
    for forbidden in ("$ref", "$defs", "const:", "type: 'null'", "title:", "uniqueItems"):
        assert forbidden not in text
    for path, node in _walk(root["properties"]["spec"], "spec"):
        assert node.get("type") != "number", f"{path}: no floats in spec"
        has_type = (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        )
        assert has_type, f"{path} has no type"
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}]


def test_cel_rules_and_columns() -> None:
    version = build_crd()["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    messages = " ".join(r["message"] for r in spec["x-kubernetes-validations"])
    assert "rdma.mode" in messages and "gpuBudget" in messages and "tensorParallelSize" in messages
    role_rules = spec["properties"]["prefill"]["x-kubernetes-validations"]
    assert {r["fieldPath"] for r in role_rules} == {".minReplicas", ".replicas", ".gpusPerPod", ".gpusPerNode"}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready", "Mode", "Prefill", "Decode", "Ratio", "Colocated", "SLO", "TTFT-Beyond-Prefill", "TTFT", "ITL",
        "Quantile", "TTFT-p99", "ITL-p99", "Rollout", "Age",
    ]  # fmt: skip
    assert "autoscaling.gpuBudget must cover the GPUs of colocated.minReplicas" in messages
    assert version["subresources"] == {"status": {}}
    # Sections default to their full defaults, so CEL rules that read them always apply.
    assert spec["properties"]["prefill"]["default"]["minReplicas"] == 1
    assert spec["properties"]["prefill"]["properties"]["minReplicas"]["default"] == 1


def test_models_reject_typos_and_bad_values() -> None:
    with pytest.raises(ValidationError, match="replicaz"):
        PDClusterSpec.model_validate({"model": {"name": "m"}, "prefill": {"replicaz": 2}})
    with pytest.raises(ValidationError, match="mode"):
        PDClusterSpec.model_validate({"model": {"name": "m"}, "rdma": {"mode": "infiniband"}})
    with pytest.raises(ValidationError, match="model"):
        PDClusterSpec.model_validate({})


def test_defaults() -> None:
    spec = PDClusterSpec.model_validate({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}})
    assert spec.served_model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert spec.kv_protocol == KVProtocol.tcp  # no RDMA configured
    rdma = PDClusterSpec.model_validate({"model": {"name": "m"}, "rdma": {"mode": "hostNetwork"}})
    assert rdma.kv_protocol == KVProtocol.rdma
    assert spec.prefill.gpus == 1
    assert (
        PDClusterSpec.model_validate(
            {"model": {"name": "m"}, "decode": {"tensorParallelSize": 2, "dataParallelSize": 2}}
        ).decode.gpus
        == 4
    )


def test_wire_roundtrip() -> None:
    doc = yaml.safe_load((ROOT / "examples/pdcluster-rdma.yaml").read_text())
    spec = PDClusterSpec.model_validate(doc["spec"])
    assert PDClusterSpec.model_validate(spec.wire()) == spec
