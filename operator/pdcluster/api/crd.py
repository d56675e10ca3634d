"""The PDCluster CustomResourceDefinition, built from the pydantic models."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

from pdcluster import constants as C
from pdcluster.api.schema import structural_schema
from pdcluster.api.v1alpha1 import PDClusterSpec, PDClusterStatus, PDRoleScalerSpec, PDRoleScalerStatus

PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode", "description": "disaggregated or colocated"},
    {
        "name": "Prefill",
        "type": "integer",
        "jsonPath": ".status.prefill.ready",
        "description": "Ready prefill pods",
    },
    {
        "name": "Decode",
        "type": "integer",
        "jsonPath": ".status.decode.ready",
        "description": "Ready decode pods",
    },
    {"name": "Ratio", "type": "string", "jsonPath": ".status.ratio", "description": "Ready prefill:decode"},
    {
        "name": "Colocated",
        "type": "integer",
        "jsonPath": ".status.colocated.ready",
        "description": "Ready colocated pods",
        "priority": 1,
    },
    # The SLO as the control law judged its last window, at the SLO quantile (docs/metrics.md).
    {
        "name": "SLO",
        "type": "string",
        "jsonPath": ".status.autoscaling.slo.verdict",
        "description": "met, missed or unseen, as the control law judged the last window",
    },
    {
        "name": "TTFT-Beyond-Prefill",
        "type": "integer",
        "jsonPath": ".status.autoscaling.slo.ttftBeyondPrefillMs",
        "description": "The router's TTFT beyond prefill at the SLO quantile (ms), where the target applies to it",
    },
    {
        "name": "TTFT",
        "type": "integer",
        "jsonPath": ".status.autoscaling.slo.ttftMs",
        "description": "The router's whole TTFT at the SLO quantile (ms)",
    },
    {
        "name": "ITL",
        "type": "integer",
        "jsonPath": ".status.autoscaling.slo.itlMs",
        "description": "The router's ITL at the SLO quantile (ms)",
    },
    {
        "name": "Quantile",
        "type": "string",
        "jsonPath": ".status.autoscaling.slo.quantile",
        "description": "The SLO quantile of the columns before",
        "priority": 1,
    },
    {
        "name": "TTFT-p99",
        "type": "integer",
        "jsonPath": ".status.ttftP99Ms",
        "description": "Router TTFT p99 (ms)",
        "priority": 1,
    },
    {
        "name": "ITL-p99",
        "type": "integer",
        "jsonPath": ".status.itlP99Ms",
        "description": "Router ITL p99 (ms)",
        "priority": 1,
    },
    {
        "name": "Rollout",
        "type": "string",
        "jsonPath": ".status.rollout",
        "description": "Pods on the new engine revision",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


SCALER_PRINTER_COLUMNS = [
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Current", "type": "integer", "jsonPath": ".status.replicas"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _root(
    description: str, spec: dict[str, Any], status: dict[str, Any], rules: list[dict[str, str]]
) -> dict[str, Any]:
    root = {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    if rules:
        root["x-kubernetes-validations"] = rules
    return root


def _crd(
    name: str, names: dict[str, Any], root: dict[str, Any], subresources: dict[str, Any], columns: list
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": name,
            "labels": {C.LABEL_NAME: "pdcluster-operator", C.LABEL_PART_OF: C.APP_NAME},
        },
        "spec": {
            "group": C.GROUP,
            "names": {**names, "listKind": f"{names['kind']}List", "categories": ["pdcluster"]},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": C.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def build_crd() -> dict[str, Any]:
    name_rule = {
        "rule": f"self.metadata.name.size() <= {C.MAX_CLUSTER_NAME_LEN}",
        "message": f"metadata.name must be at most {C.MAX_CLUSTER_NAME_LEN} characters "
        "(child object names add suffixes up to the 63-character limit)",
    }
    root = _root(
        "PDCluster serves one model with disaggregated prefill and decode pools.",
        structural_schema(PDClusterSpec, keep_defaults=True),
        structural_schema(PDClusterStatus, keep_defaults=False),
        [name_rule],
    )
    names = {"kind": C.KIND, "plural": C.PLURAL, "singular": C.SINGULAR, "shortNames": C.SHORT_NAMES}
    return _crd(C.CRD_NAME, names, root, {"status": {}}, PRINTER_COLUMNS)


def build_scaler_crd() -> dict[str, Any]:
    """PDRoleScaler: a /scale subresource per engine role, so HPA or KEDA can size one role
    while the operator stays the only writer of the StatefulSets."""
    root = _root(
        "PDRoleScaler holds the desired replicas of one role of a PDCluster whose autoscaling.mode is external.",
        structural_schema(PDRoleScalerSpec, keep_defaults=True),
        structural_schema(PDRoleScalerStatus, keep_defaults=False),
        [],
    )
    names = {
        "kind": C.SCALER_KIND,
        "plural": C.SCALER_PLURAL,
        "singular": C.SCALER_SINGULAR,
        "shortNames": C.SCALER_SHORT_NAMES,
    }
    scale = {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    return _crd(C.SCALER_CRD_NAME, names, root, {"status": {}, "scale": scale}, SCALER_PRINTER_COLUMNS)


CRD_FILES = {
    "pdcluster.io_pdclusters.yaml": build_crd,
    "pdcluster.io_pdrolescalers.yaml": build_scaler_crd,
}


def crd_yaml(build: Callable[[], dict[str, Any]] = build_crd) -> str:
    header = "# Generated by `pdctl crd` from operator/pdcluster/api/v1alpha1/. Do not edit.\n"
    return header + yaml.safe_dump(build(), sort_keys=False, width=120)
