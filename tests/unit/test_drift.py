from __future__ import annotations

from pdcluster.api.base import quantity
from pdcluster.drift import differences, in_sync, merge_patch


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
