"""The router survives a node by default: two replicas spread over nodes, a budget that
lets a drain take one at a time, and resources that make it Guaranteed CPU, not
BestEffort. tests/e2e/test_router_pod_loss.py deletes a router pod under load."""

from __future__ import annotations

from typing import Any

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.render import Owner
from pdcluster.render.router import build_router

OWNER = Owner("demo", "serving", "uid-1")
BASE = {"model": {"name": "m"}}


def router_objects(suspended: bool = False, **router: Any) -> dict[str, dict[str, Any]]:
    spec = PDClusterSpec.model_validate({**BASE, "router": router})
    return {o["kind"]: o for o in build_router(spec, OWNER, suspended=suspended)}


def test_two_replicas_spread_over_nodes_with_a_budget_of_one() -> None:
    objects = router_objects()
    deployment = objects["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    selector = deployment["spec"]["selector"]["matchLabels"]
    terms = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (preferred,) = terms["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["podAffinityTerm"] == {
        "labelSelector": {"matchLabels": selector},
        "topologyKey": "kubernetes.io/hostname",
    }
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in terms  # one node still runs both
    budget = objects["PodDisruptionBudget"]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    assert budget["metadata"]["name"] == OWNER.child(C.ROLE_ROUTER)
    # The budget selects exactly the Deployment's pods.
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_default_resources_request_cpu_and_cap_memory_only() -> None:
    (container,) = router_objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    resources = container["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert set(resources["limits"]) == {"memory"}  # no CPU limit: no throttled relays


def test_a_spec_overrides_resources_and_affinity() -> None:
    mine = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    pod = router_objects(resources={}, affinity=mine)["Deployment"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {}
    assert pod["affinity"] == mine


def test_no_budget_without_router_pods() -> None:
    assert "PodDisruptionBudget" not in router_objects(suspended=True)
    assert "PodDisruptionBudget" not in router_objects(replicas=0)
    assert router_objects(replicas=0)["Deployment"]["spec"]["replicas"] == 0
