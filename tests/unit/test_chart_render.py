"""The Helm chart without a cluster: `helm lint`, golden renders, a schema that types and
describes every value, a comment on every key of values.yaml, and RBAC that covers every
child the operator renders."""

from __future__ import annotations

import json
import os
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import paths
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.children import KINDS
from pdcluster.render import Owner, Replicas, render_all

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdcluster-operator"
GOLDEN = Path(__file__).parent / "golden"
FULL_VALUES = ROOT / "tests" / "fixtures" / "chart-values-full.yaml"
RENDERS = {"chart-default": [], "chart-full": ["-f", str(FULL_VALUES)]}
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


@cache
def helm() -> str:
    return str(paths.bin_dir() / "helm")


def template(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm(), "template", "pdc", str(CHART), "--namespace", "pdcluster-system", *args],
        capture_output=True,
        text=True,
    )


def render(name: str) -> list[dict[str, Any]]:
    out = template(*RENDERS[name])
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("values", [None, FULL_VALUES], ids=["default", "full"])
def test_helm_lint(values: Path | None) -> None:
    out = subprocess.run(
        [helm(), "lint", "--strict", str(CHART), *(["-f", str(values)] if values else [])],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("name", RENDERS)
def test_golden(name: str) -> None:
    out = template(*RENDERS[name])
    assert out.returncode == 0, out.stderr
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(out.stdout)
    assert out.stdout == golden.read_text(), f"{name} render changed; rerun with UPDATE_GOLDEN=1 and review"


def test_full_values_switch_on_every_optional_object() -> None:
    kinds = {d["kind"] for d in render("chart-full")}
    assert {"PodMonitor", "ServiceMonitor", "ConfigMap", "Role", "RoleBinding"} <= kinds
    assert {d["kind"] for d in render("chart-default")}.isdisjoint(
        {"PodMonitor", "ServiceMonitor", "ConfigMap"}
    )
    dashboard = next(d for d in render("chart-full") if d["kind"] == "ConfigMap")
    assert json.loads(dashboard["data"]["pdcluster.json"]) == json.loads(
        (CHART / "dashboards" / "pdcluster.json").read_text()
    )


# ------------------------------------------------------------------------- values


def _schema_paths(node: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """Every key the schema defines (dotted path -> its schema node)."""
    out = {}
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        out[path] = sub
        out |= _schema_paths(sub, f"{path}.")
    return out


def _value_keys() -> list[tuple[str, int]]:
    """(dotted path, line index) of every key in values.yaml, from its indentation."""
    stack: list[tuple[int, str]] = []
    out = []
    for i, line in enumerate((CHART / "values.yaml").read_text().splitlines()):
        m = re.match(r"^( *)([A-Za-z_][\w-]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        out.append((".".join(k for _, k in stack), i))
    return out


SCHEMA_PATHS = _schema_paths(SCHEMA)
# Keys whose parent is a free-form map (Kubernetes quantities) are example data, not options.
OPTIONS = [(p, i) for p, i in _value_keys() if p in SCHEMA_PATHS]


def test_every_schema_key_is_typed_and_described() -> None:
    assert SCHEMA.get("additionalProperties") is False
    for path, node in SCHEMA_PATHS.items():
        assert node.get("type"), f"{path} has no type"
        assert len(node.get("description", "")) > 10, f"{path} has no description"
        if node["type"] == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path} accepts unknown keys"


def test_values_and_schema_name_the_same_keys() -> None:
    in_values = {p for p, _ in _value_keys()}
    unknown = {p for p in in_values if p not in SCHEMA_PATHS and p.rsplit(".", 1)[0] not in SCHEMA_PATHS}
    assert not unknown, f"values.yaml keys missing from values.schema.json: {unknown}"
    # Every option has its default in values.yaml, except `global` (set by parent charts).
    assert set(SCHEMA_PATHS) - {"global"} <= in_values


def test_every_key_in_values_is_commented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    uncommented = [path for path, i in OPTIONS if not lines[i - 1].lstrip().startswith("#")]
    assert not uncommented, f"keys without a comment above them: {uncommented}"


BAD_VALUES = [
    (["--set", "replicaCount=two"], "replicaCount"),
    (["--set", "prometheusURL=http://p:9090"], "prometheusURL"),  # a typo is refused, not ignored
    (["--set", "metrics.port=8081"], "/metrics/port"),
    (["--set", "logLevel=chatty"], "/logLevel"),
    (["--set", "podMonitor.interval=5"], "/podMonitor/interval"),
    (["--set", "resources.requests.cpu=lots"], "/resources/requests/cpu"),
    (["--set", "watchNamespaces={Team_A}"], "/watchNamespaces/0"),
    (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
    (["--set", "serviceMonitor.enabled=true,metrics.service.enabled=false"], "needs metrics.service.enabled"),
]


@pytest.mark.parametrize(("args", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_schema_rejects_bad_values(args: list[str], where: str) -> None:
    out = template(*args)
    assert out.returncode != 0
    assert where in out.stderr


# --------------------------------------------------------------------------- RBAC

VERBS_FOR_CHILDREN = {"get", "list", "watch", "create", "patch", "delete"}


def _grants(rules: list[dict[str, Any]], group: str, resource: str) -> set[str]:
    return {
        verb for r in rules if group in r["apiGroups"] and resource in r["resources"] for verb in r["verbs"]
    }


def _rendered_children() -> set[tuple[str, str]]:
    """(apiGroup, plural) of every child any example renders."""
    plural = {"PodDisruptionBudget": "poddisruptionbudgets", "NetworkPolicy": "networkpolicies"}
    out = set()
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        spec = PDClusterSpec.model_validate(doc["spec"])
        for obj in render_all(spec, Owner(doc["metadata"]["name"], "ns", "uid"), Replicas.choose(spec, None)):
            group = obj["apiVersion"].rpartition("/")[0]
            out.add((group, plural.get(obj["kind"], obj["kind"].lower() + "s")))
    return out


@pytest.mark.parametrize("name", RENDERS)
def test_rbac_covers_every_child_and_watch(name: str) -> None:
    docs = render(name)
    kind = "Role" if name == "chart-full" else "ClusterRole"
    roles = [
        d
        for d in docs
        if d["kind"] == kind and not d["metadata"]["name"].endswith(("-leader-election", "-discovery"))
    ]
    assert roles
    for role in roles:
        for group, resource in _rendered_children() | {(g, p) for g, _, p in KINDS}:
            if resource in ("pdrolescalers", "persistentvolumeclaims"):
                continue  # created once, never applied; a claim, never deleted: checked below
            if resource == "pods":  # watched for start-up times and stuck pods; labelled, never made
                assert _grants(role["rules"], group, resource) == {"get", "list", "watch", "patch"}
                continue
            assert _grants(role["rules"], group, resource) >= VERBS_FOR_CHILDREN, (group, resource)
        # PDRoleScalers belong to HPA/KEDA after creation: the operator may not patch their spec.
        assert _grants(role["rules"], "pdcluster.io", "pdrolescalers") == {"get", "list", "watch", "create"}
        assert _grants(role["rules"], "pdcluster.io", "pdrolescalers/status") >= {"patch"}
        assert _grants(role["rules"], "pdcluster.io", "pdclusters/status") >= {"patch"}
        # The operator never writes a spec, and deletes only children it no longer renders.
        assert not _grants(role["rules"], "pdcluster.io", "pdclusters") & {"update", "patch", "delete"}
        assert "delete" not in _grants(role["rules"], "pdcluster.io", "pdrolescalers")
        # The model cache's claim holds the weights: it goes with its PDCluster, not by our hand.
        assert _grants(role["rules"], "", "persistentvolumeclaims") == {"get", "create", "patch"}
        assert all("*" not in r["verbs"] for r in role["rules"])
        children = _rendered_children()
        assert all(
            set(r["resources"]) <= {resource for _, resource in children}
            for r in role["rules"] if "delete" in r["verbs"]
        )  # fmt: skip
        assert _grants(role["rules"], "", "secrets") == {"get"}
    discovery = next(
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-discovery")
    )
    assert _grants(discovery["rules"], "apiextensions.k8s.io", "customresourcedefinitions") == {
        "list",
        "watch",
    }
