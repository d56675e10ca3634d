from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.status import Observation, Problem, compute_status

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SPEC = PDClusterSpec.model_validate({"model": {"name": "m"}, "prefill": {"tensorParallelSize": 2}})


def sts(
    replicas: int, ready: int, updated: int | None = None, generation: int = 1, observed: int = 1
) -> dict:
    return {
        "kind": "StatefulSet",
        "metadata": {"generation": generation},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "observedGeneration": observed,
            "currentRevision": "r1",
            "updateRevision": "r1",
        },
    }


def deploy(replicas: int, ready: int) -> dict:
    return {
        "kind": "Deployment",
        "metadata": {"generation": 1},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas,
            "observedGeneration": 1,
        },
    }


def healthy() -> Observation:
    return Observation(
        workloads={
            C.ROLE_PREFILL: sts(2, 2),
            C.ROLE_DECODE: sts(3, 3),
            C.ROLE_ROUTER: deploy(1, 1),
            C.ROLE_MOONCAKE_MASTER: deploy(1, 1),
        },
        desired={C.ROLE_PREFILL: 2, C.ROLE_DECODE: 3, C.ROLE_ROUTER: 1, C.ROLE_MOONCAKE_MASTER: 1},
    )


def conditions(status) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def test_healthy_cluster() -> None:
    status = compute_status(SPEC, 4, healthy(), None, None, NOW)
    assert conditions(status) == {
        "Ready": ("True", "AllComponentsReady"),
        "Progressing": ("False", "Stable"),
        "Degraded": ("False", "AsExpected"),
        "Reconciling": ("False", "Stable"),
        "Stalled": ("False", "AsExpected"),
    }
    assert status.ratio == "2:3" and status.observed_generation == 4
    assert status.prefill.gpus == 4 and status.decode.gpus == 3


def test_rollout_in_progress() -> None:
    obs = healthy()
    obs.workloads[C.ROLE_PREFILL] = sts(2, 1, updated=1, generation=2, observed=2)
    status = compute_status(SPEC, 4, obs, None, None, NOW)
    assert conditions(status)["Progressing"] == ("True", "Reconciling")
    assert conditions(status)["Ready"][0] == "True"  # one prefill still serves
    assert "prefill" in next(c.message for c in status.conditions if c.type == "Progressing")


def test_stale_workload_status_counts_as_progressing() -> None:
    obs = healthy()
    obs.workloads[C.ROLE_DECODE] = sts(3, 3, generation=2, observed=1)
    assert conditions(compute_status(SPEC, 4, obs, None, None, NOW))["Progressing"][0] == "True"


def test_missing_component_is_not_ready() -> None:
    obs = healthy()
    obs.workloads[C.ROLE_DECODE] = None
    status = compute_status(SPEC, 1, obs, None, None, NOW)
    assert conditions(status)["Ready"] == ("False", "ComponentsUnavailable")
    assert "decode" in status.conditions[0].message


def test_problems_degrade_with_a_fix_message() -> None:
    obs = healthy()
    obs.problems.append(
        Problem("SecretNotFound", "Secret ns/hf-token does not exist; create it with key 'token'")
    )
    status = compute_status(SPEC, 1, obs, None, None, NOW)
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "SecretNotFound")
    assert "create it" in degraded.message


def test_transition_time_is_kept_while_status_holds() -> None:
    first = compute_status(SPEC, 1, healthy(), None, None, NOW)
    later = compute_status(SPEC, 1, healthy(), first, None, NOW + timedelta(minutes=5))
    assert later == first  # nothing changed: identical status, so no write
    obs = healthy()
    obs.workloads[C.ROLE_ROUTER] = deploy(1, 0)
    changed = compute_status(SPEC, 1, obs, first, None, NOW + timedelta(minutes=5))
    ready = next(c for c in changed.conditions if c.type == "Ready")
    assert ready.status == "False" and ready.last_transition_time == "2026-11-29T12:05:00Z"


def test_suspended_and_paused() -> None:
    suspended = SPEC.model_copy(update={"suspend": True})
    obs = Observation(workloads={r: sts(0, 0) for r in (C.ROLE_PREFILL, C.ROLE_DECODE)}, desired={})
    assert conditions(compute_status(suspended, 1, obs, None, None, NOW))["Ready"] == ("False", "Suspended")
    paused = SPEC.model_copy(update={"paused": True})
    assert conditions(compute_status(paused, 1, healthy(), None, None, NOW))["Progressing"] == (
        "False",
        "Paused",
    )


def test_autoscaling_condition() -> None:
    obs = healthy()
    obs.autoscaling = (
        False,
        "MetricsUnavailable",
        "Prometheus at http://p:9090 did not answer: holding replicas",
    )
    status = compute_status(SPEC, 1, obs, None, None, NOW)
    assert conditions(status)["Autoscaling"] == ("False", "MetricsUnavailable")
