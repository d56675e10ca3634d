"""Engine start-up measured from pods, a stuck pod's own reason, and the kstatus pair
(Reconciling, Stalled) with the progress deadline: pure functions on hand-made pods."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from test_status import NOW, SPEC, conditions, healthy, sts

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterStatus
from pdcluster.podstate import (
    STARTUP_SAMPLES,
    observe_pods,
    pod_problem,
    record_startups,
    startup_seconds,
)
from pdcluster.status import Observation, Problem, compute_status
from pdcluster.timestamps import time_s

T0 = datetime(2026, 11, 29, 11, 0, tzinfo=UTC)


def pod(
    name: str,
    created: datetime,
    ready_at: datetime | None = None,
    role: str = C.ROLE_DECODE,
    **status: object,
) -> dict:
    conds = [
        {
            "type": "Ready",
            "status": "True" if ready_at else "False",
            "lastTransitionTime": time_s(ready_at or created),
        }
    ]
    return {
        "metadata": {"name": name, "creationTimestamp": time_s(created), "labels": {C.LABEL_ROLE: role}},
        "status": {"conditions": conds + list(status.pop("conditions", [])), **status},
    }


def waiting(reason: str, message: str = "", image: str = "vllm/vllm-openai:v0.32.0", **extra: object) -> dict:
    return {
        "name": "engine",
        "image": image,
        "state": {"waiting": {"reason": reason, "message": message}},
        **extra,
    }


# ------------------------------------------------------------------ start-up


def test_startup_is_creation_to_ready() -> None:
    assert startup_seconds(pod("d-0", T0, T0 + timedelta(seconds=95))) == 95
    assert startup_seconds(pod("d-1", T0)) is None  # not Ready yet


def test_each_pod_is_measured_once_and_the_median_is_over_recent_pods() -> None:
    first = record_startups(None, [pod("d-0", T0, T0 + timedelta(seconds=90)), pod("d-1", T0, None)])
    assert first is not None and (first.last_seconds, first.median_seconds) == (90, 90)
    # d-0's readiness flaps later: its first Ready stays; d-1 becomes Ready after 130 s.
    later = [pod("d-0", T0, T0 + timedelta(hours=2)), pod("d-1", T0, T0 + timedelta(seconds=130))]
    second = record_startups(first, later)
    assert second is not None and [p.seconds for p in second.pods] == [90, 130]
    assert second.median_seconds == 110
    assert record_startups(second, later) == second  # nothing new: the same object, no write


def test_the_window_keeps_the_newest_pods_and_ignores_older_ones() -> None:
    pods = [
        pod(f"d-{i}", T0 + timedelta(minutes=i), T0 + timedelta(minutes=i, seconds=60 + i)) for i in range(12)
    ]
    full = record_startups(None, pods)
    assert full is not None and len(full.pods) == STARTUP_SAMPLES
    assert full.pods[0].pod == "d-2" and full.last_seconds == 71
    # d-0 and d-1 fell out of the window: seen again, they are not measured again.
    assert record_startups(full, pods) == full
    newer = pod("d-12", T0 + timedelta(minutes=12), T0 + timedelta(minutes=12, seconds=300))
    moved = record_startups(full, [*pods, newer])
    assert moved is not None and moved.last_seconds == 300 and moved.pods[0].pod == "d-3"


def test_observe_pods_measures_each_engine_role() -> None:
    obs = Observation(workloads={}, desired={})
    pods = [
        pod("p-0", T0, T0 + timedelta(seconds=40), role=C.ROLE_PREFILL),
        pod("d-0", T0, T0 + timedelta(seconds=70)),
        pod("r-0", T0, T0 + timedelta(seconds=3), role=C.ROLE_ROUTER),
    ]
    observe_pods(obs, SPEC, PDClusterStatus(), pods)
    assert obs.startups[C.ROLE_PREFILL].last_seconds == 40
    assert obs.startups[C.ROLE_DECODE].last_seconds == 70
    assert C.ROLE_ROUTER not in obs.startups and obs.stuck == []


def test_status_shows_the_start_up_per_role() -> None:
    obs = healthy()
    observe_pods(obs, SPEC, PDClusterStatus(), [pod("d-0", T0, T0 + timedelta(seconds=70))])
    status = compute_status(SPEC, 1, obs, None, None, NOW)
    assert status.decode.startup is not None and status.decode.startup.median_seconds == 70
    assert status.prefill.startup is None
    wire = status.wire()
    assert wire["decode"]["startup"]["lastSeconds"] == 70


# ------------------------------------------------------------------ stuck pods


def test_image_pull_back_off_names_the_image() -> None:
    stuck = pod(
        "d-0",
        T0,
        containerStatuses=[waiting("ImagePullBackOff", 'Back-off pulling image "x/y:1"', image="x/y:1")],
    )
    problem = pod_problem(stuck)
    assert problem is not None and problem.reason == "ImagePullBackOff"
    assert "x/y:1" in problem.message and "d-0" in problem.message


def test_unschedulable_quotes_the_scheduler() -> None:
    message = "0/6 nodes are available: 6 Insufficient nvidia.com/gpu."
    unscheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    problem = pod_problem(pod("d-0", T0, conditions=[unscheduled]))
    assert problem is not None and problem.reason == "Unschedulable" and message in problem.message


def test_crash_loop_quotes_the_last_log_lines() -> None:
    log = "\n".join(f"line {i}" for i in range(20)) + "\nValueError: no such model"
    crashed = waiting(
        "CrashLoopBackOff",
        "back-off 40s",
        restartCount=3,
        lastState={"terminated": {"exitCode": 1, "reason": "Error", "message": log}},
    )
    problem = pod_problem(pod("d-0", T0, containerStatuses=[crashed]))
    assert problem is not None and problem.reason == "CrashLoopBackOff"
    assert "ValueError: no such model" in problem.message and "line 15" not in problem.message
    assert "code 1" in problem.message and "3 restarts" in problem.message


def test_oom_killed_wins_over_the_back_off() -> None:
    oom = waiting(
        "CrashLoopBackOff", restartCount=2, lastState={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    )
    problem = pod_problem(pod("d-0", T0, containerStatuses=[oom]))
    assert problem is not None and problem.reason == "OOMKilled"


def test_no_problem_for_ready_starting_or_deleted_pods() -> None:
    assert pod_problem(pod("d-0", T0, T0 + timedelta(seconds=5))) is None
    assert pod_problem(pod("d-0", T0, containerStatuses=[waiting("ContainerCreating")])) is None
    gone = pod("d-0", T0, containerStatuses=[waiting("ImagePullBackOff")])
    gone["metadata"]["deletionTimestamp"] = time_s(NOW)
    assert pod_problem(gone) is None


# ------------------------------------------------------------------ Reconciling, Stalled


def rolling_out() -> Observation:
    obs = healthy()
    obs.workloads[C.ROLE_DECODE] = sts(3, 2)  # one decode pod not Ready
    return obs


def test_reconciling_while_short_then_stalled_past_the_deadline() -> None:
    spec = SPEC.model_copy(update={"progress_deadline_seconds": 120})
    first = compute_status(spec, 1, rolling_out(), None, None, NOW)
    assert conditions(first)["Reconciling"] == ("True", "Reconciling")
    assert conditions(first)["Stalled"] == ("False", "WithinDeadline")
    assert first.last_progress_time == time_s(NOW)
    within = compute_status(spec, 1, rolling_out(), first, None, NOW + timedelta(seconds=120))
    assert conditions(within)["Stalled"][0] == "False"
    obs = rolling_out()
    obs.stuck = [pod_problem(pod("d-2", T0, containerStatuses=[waiting("ErrImagePull", image="x/y:1")]))]
    late = compute_status(spec, 1, obs, within, None, NOW + timedelta(seconds=121))
    assert conditions(late)["Stalled"] == ("True", "ErrImagePull")
    assert conditions(late)["Reconciling"][0] == "False"  # kstatus reads the first True of the two
    stalled = next(c for c in late.conditions if c.type == "Stalled")
    assert "x/y:1" in stalled.message and "120s" in stalled.message


def test_progress_restarts_the_deadline() -> None:
    spec = SPEC.model_copy(update={"progress_deadline_seconds": 60})
    obs = healthy()
    obs.workloads[C.ROLE_DECODE] = sts(3, 1)
    first = compute_status(spec, 1, obs, None, None, NOW)
    # A second decode pod became Ready: progress, though not yet there.
    later = compute_status(spec, 1, rolling_out(), first, None, NOW + timedelta(seconds=90))
    assert later.last_progress_time == time_s(NOW + timedelta(seconds=90))
    assert conditions(later)["Stalled"][0] == "False"
    # A new generation is a new goal: the deadline counts afresh.
    renewed = compute_status(spec, 2, rolling_out(), later, None, NOW + timedelta(seconds=200))
    assert conditions(renewed)["Stalled"][0] == "False"


def test_stalled_without_a_pod_reason_says_what_it_waits_for() -> None:
    spec = SPEC.model_copy(update={"progress_deadline_seconds": 60})
    first = compute_status(spec, 1, rolling_out(), None, None, NOW)
    late = compute_status(spec, 1, rolling_out(), first, None, NOW + timedelta(seconds=61))
    stalled = next(c for c in late.conditions if c.type == "Stalled")
    assert (stalled.status, stalled.reason) == ("True", "ProgressDeadlineExceeded")
    assert "decode" in stalled.message


def test_settling_clears_stalled_and_the_progress_time() -> None:
    spec = SPEC.model_copy(update={"progress_deadline_seconds": 60})
    first = compute_status(spec, 1, rolling_out(), None, None, NOW)
    late = compute_status(spec, 1, rolling_out(), first, None, NOW + timedelta(seconds=61))
    done = compute_status(spec, 1, healthy(), late, None, NOW + timedelta(seconds=90))
    assert conditions(done)["Stalled"] == ("False", "AsExpected")
    assert conditions(done)["Reconciling"] == ("False", "Stable")
    assert done.last_progress_time is None


def test_paused_never_stalls() -> None:
    spec = SPEC.model_copy(update={"paused": True, "progress_deadline_seconds": 1})
    first = compute_status(spec, 1, rolling_out(), None, None, NOW)
    late = compute_status(spec, 1, rolling_out(), first, None, NOW + timedelta(hours=1))
    assert conditions(late)["Stalled"][0] == "False" and conditions(late)["Reconciling"][0] == "False"


def test_a_container_running_again_after_a_crash_is_still_in_its_loop() -> None:
    again = {
        "name": "engine",
        "state": {"running": {"startedAt": time_s(T0)}},
        "restartCount": 4,
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": "boom"}},
    }
    problem = pod_problem(pod("d-0", T0, containerStatuses=[again]))
    assert problem is not None and problem.reason == "CrashLoopBackOff" and "boom" in problem.message
    first_start = {**again, "restartCount": 0, "lastState": {}}
    assert pod_problem(pod("d-0", T0, containerStatuses=[first_start])) is None


def test_a_problem_that_blocks_the_spec_stalls_at_once_a_warning_does_not() -> None:
    obs = healthy()
    obs.problems = [Problem("SecretNotFound", "Secret ns/hf does not exist; create it with key 'token'")]
    status = compute_status(SPEC, 1, obs, None, None, NOW)
    assert conditions(status)["Stalled"] == ("True", "SecretNotFound")
    assert conditions(status)["Reconciling"] == ("False", "Stalled")
    warned = healthy()
    warned.problems = [Problem("EngineImageKnownBug", "vLLM #43828", blocks=False)]
    assert conditions(compute_status(SPEC, 1, warned, None, None, NOW))["Stalled"] == ("False", "AsExpected")
