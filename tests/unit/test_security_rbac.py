"""Least privilege, checked on every Role and ClusterRole we ship: the chart's (rendered by
`helm template`, cluster-wide and per-namespace) and the router's Role the operator
renders. That the operator works with exactly these roles is shown against the local
cluster by tests/integration/test_chart.py (the chart installed, the operator running
on its ServiceAccount token, a PDCluster reaching Ready, no request forbidden)."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import paths
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.render import Owner, Replicas, render_all

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdcluster-operator"
RELEASE_NAMESPACE = "pdcluster-system"
# Verbs that let a subject gain rights it does not hold (kubernetes.io/docs/concepts/
# security/rbac-good-practices/#privilege-escalation-risks).
ESCALATING_VERBS = {"escalate", "bind", "impersonate"}
# Subresources that reach into running pods or mint credentials.
DANGEROUS_RESOURCES = {
    "pods/exec", "pods/attach", "pods/portforward", "pods/ephemeralcontainers", "nodes/proxy",
    "services/proxy", "serviceaccounts/token", "certificatesigningrequests/approval",
    "mutatingwebhookconfigurations", "validatingwebhookconfigurations",
}  # fmt: skip
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


@cache
def helm() -> str:
    return str(paths.bin_dir() / "helm")


def chart(*args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [helm(), "template", "pdc", str(CHART), "--namespace", RELEASE_NAMESPACE, *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


RENDERS = {
    "cluster-wide": chart(),
    "namespaced": chart("--set", "watchNamespaces={team-a,team-b}"),
}


def router_roles() -> list[dict[str, Any]]:
    out = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        spec = PDClusterSpec.model_validate(yaml.safe_load(path.read_text())["spec"])
        objs = render_all(spec, Owner("x", "ns", "uid"), Replicas.choose(spec, None))
        out += [o for o in objs if o["kind"] in ("Role", "RoleBinding")]
    return out


def roles_of(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Role", "ClusterRole")]


def rule_problems(role: dict[str, Any]) -> list[str]:
    """What is wrong with one role's rules (empty when least-privilege)."""
    name = f"{role['kind']} {role['metadata']['name']}"
    problems = []
    if role.get("aggregationRule"):
        problems.append(f"{name}: aggregationRule pulls in rules from elsewhere")
    for rule in role.get("rules") or []:
        for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            if any("*" in value for value in rule.get(key) or []):
                problems.append(f"{name}: wildcard in {key}: {rule}")
        verbs = set(rule.get("verbs") or [])
        resources = set(rule.get("resources") or [])
        if verbs & ESCALATING_VERBS:
            problems.append(f"{name}: {sorted(verbs & ESCALATING_VERBS)} on {sorted(resources)}")
        # A list or watch returns every Secret's data; writes could plant credentials.
        if "" in (rule.get("apiGroups") or []) and "secrets" in resources and verbs - {"get"}:
            problems.append(f"{name}: {sorted(verbs - {'get'})} on secrets")
        if resources & DANGEROUS_RESOURCES and verbs & (WRITE_VERBS | {"get"}):
            problems.append(f"{name}: {sorted(verbs)} on {sorted(resources & DANGEROUS_RESOURCES)}")
        if rule.get("nonResourceURLs"):
            problems.append(f"{name}: non-resource URLs {rule['nonResourceURLs']}")
    return problems


@pytest.mark.parametrize("render", RENDERS)
def test_chart_roles_are_least_privilege(render: str) -> None:
    roles = roles_of(RENDERS[render])
    assert roles
    problems = [p for role in roles for p in rule_problems(role)]
    assert not problems, problems


@pytest.mark.parametrize("render", RENDERS)
def test_chart_bindings_name_only_the_operators_service_account(render: str) -> None:
    docs = RENDERS[render]
    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    role_names = {(d["kind"], d["metadata"]["name"]) for d in roles_of(docs)}
    bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert bindings
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": RELEASE_NAMESPACE}]
        # Bound to the chart's own roles, never to a built-in one such as cluster-admin or edit.
        assert (b["roleRef"]["kind"], b["roleRef"]["name"]) in role_names, b["roleRef"]


def test_namespaced_install_holds_nothing_cluster_wide_but_discovery() -> None:
    docs = RENDERS["namespaced"]
    for role in (d for d in docs if d["kind"] == "ClusterRole"):
        for rule in role["rules"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
            assert set(rule["resources"]) <= {"customresourcedefinitions", "namespaces"}, rule
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] == "Role"}
    assert namespaces == {"team-a", "team-b", RELEASE_NAMESPACE}


def test_router_role_reads_pods_and_writes_only_its_verdicts() -> None:
    objs = router_roles()
    roles = [o for o in objs if o["kind"] == "Role"]
    assert roles
    for role in roles:
        assert rule_problems(role) == []
        state = role["metadata"]["name"] + "-state"
        # In flexible mode: also the roles ConfigMap, read by name.
        flexible = [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [role["metadata"]["name"] + "-roles"],
                "verbs": ["get", "list", "watch"],
            }
        ]
        assert role["rules"] in (role["rules"][:2], role["rules"][:2] + flexible)
        assert role["rules"][:2] == [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [state],
                "verbs": ["get", "patch"],
            },
        ]
    for binding in (o for o in objs if o["kind"] == "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"
        assert [s["kind"] for s in binding["subjects"]] == ["ServiceAccount"]


@pytest.mark.parametrize(
    "rule",
    [
        {"apiGroups": ["*"], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"], "verbs": ["escalate"]},
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles"], "verbs": ["bind"]},
        {"apiGroups": [""], "resources": ["users", "groups"], "verbs": ["impersonate"]},
        {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"]},
        {"nonResourceURLs": ["/metrics"], "verbs": ["get"]},
    ],
)
def test_the_check_catches(rule: dict[str, Any]) -> None:
    role = {"kind": "ClusterRole", "metadata": {"name": "bad"}, "rules": [rule]}
    assert rule_problems(role)
