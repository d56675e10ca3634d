from __future__ import annotations

import copy

import pytest

from pdcluster import constants as C
from pdcluster.api.base import quantity
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.drift import differences, in_sync, merge_patch, stamp
from pdcluster.render import Owner, Replicas, render_all


def test_quantities_compare_by_value() -> None:
    assert quantity("16Gi") == quantity(str(16 * 2**30))
    assert quantity("500m") == quantity("0.5")
    assert quantity(4) == quantity("4")
    assert quantity("mlx5_0") is None and quantity(True) is None
    assert (
        differences(
            {"limits": {"nvidia.com/gpu": 4, "cpu": "1000m"}}, {"limits": {"nvidia.com/gpu": "4", "cpu": "1"}}
        )
        == []
    )


def test_extra_live_fields_are_not_drift() -> None:
    desired = {
        "spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "engine", "image": "x"}]}}}
    }
    live = {
        "spec": {
            "replicas": 2,
            "revisionHistoryLimit": 10,
            "template": {
                "spec": {
                    "containers": [
                        {"name": "engine", "image": "x", "terminationMessagePath": "/dev/termination-log"}
                    ]
                }
            },
        },
        "status": {"readyReplicas": 2},
    }
    assert differences(desired, live) == []


def test_changed_missing_and_reordered_fields_are_drift() -> None:
    desired = {"spec": {"replicas": 2, "args": ["--a", "--b"], "env": [{"name": "X", "value": "1"}]}}
    assert differences(
        desired, {"spec": {"replicas": 3, "args": ["--a", "--b"], "env": [{"name": "X", "value": "1"}]}}
    ) == [".spec.replicas"]
    assert differences(
        desired, {"spec": {"replicas": 2, "args": ["--b", "--a"], "env": [{"name": "X", "value": "1"}]}}
    ) == [
        ".spec.args[0]",
        ".spec.args[1]",
    ]
    assert differences(desired, {"spec": {"replicas": 2, "args": ["--a", "--b"]}}) == [".spec.env"]


def test_empty_desired_values_match_absent_live_ones() -> None:
    assert differences({"resources": {}, "tolerations": [], "hostNetwork": False}, {}) == []


def test_in_sync_checks_labels_and_owner() -> None:
    desired = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s", "labels": {"a": "1"}},
        "spec": {"clusterIP": "None"},
    }
    live = {
        "metadata": {"name": "s", "labels": {"a": "1", "extra": "x"}, "resourceVersion": "5"},
        "spec": {"clusterIP": "None"},
    }
    assert in_sync(desired, live)
    assert not in_sync(desired, {**live, "metadata": {"name": "s", "labels": {"a": "2"}}})
    assert not in_sync(desired, None)


def test_merge_patch_deletes_what_disappeared() -> None:
    old = {"a": 1, "b": {"c": 2, "d": 3}, "e": [1]}
    new = {"a": 1, "b": {"c": 2}, "e": [1, 2]}
    assert merge_patch(old, new) == {"b": {"d": None}, "e": [1, 2]}
    assert merge_patch(old, old) == {}


def test_zero_values_match_omitted_fields() -> None:
    """The apiserver omits zero-valued optional fields (e.g. a probe's initialDelaySeconds: 0)."""
    desired = {"readinessProbe": {"initialDelaySeconds": 0, "periodSeconds": 5}}
    assert differences(desired, {"readinessProbe": {"periodSeconds": 5}}) == []
    assert differences({"replicas": 0}, {"replicas": 1}) == [".replicas"]


def _prefill(spec: dict) -> dict:
    s = PDClusterSpec.model_validate({"model": {"name": "m"}, **spec})
    objects = render_all(s, Owner("c", "ns", "uid"), Replicas.choose(s, None))
    return stamp(
        next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "c-prefill")
    )


def _applied(desired: dict) -> dict:
    """The live object after an apply: what was sent, plus what the apiserver adds."""
    live = copy.deepcopy(desired)
    live["metadata"] |= {"resourceVersion": "7", "uid": "u"}
    live["spec"]["revisionHistoryLimit"] = 10
    live["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
    live["status"] = {"readyReplicas": 1}
    return live


WITH = {
    "nodeSelector": {"pool": "h200"},
    "podAnnotations": {"team": "serving"},
    "priorityClassName": "serving-high",
    "affinity": {"nodeAffinity": {}},
    "env": [{"name": "EXTRA", "value": "1"}],
}


@pytest.mark.parametrize("removed", [*WITH, "bootstrap port"])
def test_a_removed_field_is_drift(removed: str) -> None:
    """The live object keeps a field we stopped rendering: only the hash tells."""
    before = {"prefill": WITH}
    after = {"prefill": {k: v for k, v in WITH.items() if k != removed}}
    if removed == "bootstrap port":  # an optional port: the bootstrap's moves, the old one stays
        before, after = (
            {**before, "kvTransfer": {"bootstrapPort": 8998}},
            {**before, "kvTransfer": {"bootstrapPort": 8999}},
        )
    live = _applied(_prefill(before))
    assert in_sync(_prefill(before), live)
    assert not in_sync(_prefill(after), live)


def test_a_change_by_someone_else_is_drift() -> None:
    desired = _prefill({"prefill": WITH})
    live = _applied(desired)
    live["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "a100"}
    assert not in_sync(desired, live)
    live = _applied(desired)
    live["metadata"]["annotations"][C.ANNOTATION_RENDERED] = "0" * 16  # the hash itself edited
    assert not in_sync(desired, live)


def test_the_stamp_is_the_rendering_s_own() -> None:
    a, b = _prefill({}), _prefill({})
    assert (
        a["metadata"]["annotations"][C.ANNOTATION_RENDERED]
        == b["metadata"]["annotations"][C.ANNOTATION_RENDERED]
    )
    assert (
        "annotations" not in a["spec"]["template"]["metadata"]
        or C.ANNOTATION_RENDERED not in (a["spec"]["template"]["metadata"]["annotations"])
    )  # on the object, not its pods: a new hash restarts nothing by itself


def test_a_hash_that_reads_as_a_huge_number_is_a_string_that_differs() -> None:
    """A rendered hash of digits and one `e` parses as a quantity of 10^(10^15): it is
    compared as a string (found by the generated-specs test as an Overflow)."""
    assert quantity("9e99999999999999") is None
    desired = {"metadata": {"annotations": {C.ANNOTATION_RENDERED: "9e99999999999999"}}, "spec": {}}
    live = {"metadata": {"annotations": {C.ANNOTATION_RENDERED: "1e99999999999999"}}, "spec": {}}
    assert not in_sync(desired, live)
    assert in_sync(desired, desired)
