"""What the pods say, in the local cluster with the operator as a process: engine start-up
measured per role in status, and the kstatus pair (Reconciling, Stalled) with
spec.progressDeadlineSeconds, judged by kstatus itself (sigs.k8s.io/cli-utils, built by
e2e/local/build.sh): InProgress while rolling out, Current when ready, Failed when an image
cannot run or a pod cannot be scheduled, with the pod's own reason and a Warning event."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from harness import OperatorProcess

from localcluster import paths
from pdcluster import constants as C
from pdcluster.io.kube import Kube
from pdcluster.timestamps import parse

pytestmark = pytest.mark.cluster


def kstatus(obj: dict[str, Any]) -> str:
    """kstatus's verdict (Current, InProgress, Failed ...) on the object as stored."""
    binary = paths.kstatus_binary(paths.bin_dir())
    out = subprocess.run([str(binary)], input=json.dumps(obj), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["status"]


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    found = [c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_]
    return found[0] if found else {}


async def engine_pods(kube: Kube, namespace: str, name: str, role: str) -> list[dict[str, Any]]:
    selector = f"{C.LABEL_CLUSTER}={name},{C.LABEL_ROLE}={role}"
    return await kube.list("v1", "Pod", namespace, label_selector=selector)


async def test_start_up_is_measured_and_kstatus_reads_the_rollout(
    kube: Kube, namespace: str, operator: OperatorProcess, pdc: Any, sim_cluster: Any, wait_until: Any
) -> None:
    await pdc.apply(sim_cluster("up"))
    verdicts: list[str] = []

    async def current() -> bool:
        obj = await pdc.get("up")
        if obj and obj.get("status", {}).get("conditions"):
            verdict = kstatus(obj)
            verdicts.append(verdict)
            assert (verdict == "InProgress") == (condition(obj, "Reconciling").get("status") == "True"), obj
        return bool(verdicts) and verdicts[-1] == "Current"

    await wait_until(current, timeout=180, interval=0.3, message="kstatus Current")
    assert verdicts[0] == "InProgress", verdicts  # the first status: pods not yet Ready

    async def measured() -> dict[str, Any] | None:
        status = (await pdc.get("up"))["status"]
        return status if all("startup" in status[role] for role in C.ENGINE_ROLES) else None

    status = await wait_until(measured, timeout=30, message="start-ups in status")
    for role in C.ENGINE_ROLES:
        (pod,) = await engine_pods(kube, namespace, "up", role)
        ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
        took = int(
            (parse(ready["lastTransitionTime"]) - parse(pod["metadata"]["creationTimestamp"])).total_seconds()
        )
        startup = status[role]["startup"]
        assert startup["pods"] == [
            {"pod": pod["metadata"]["name"], "created": pod["metadata"]["creationTimestamp"], "seconds": took}
        ]
        assert startup["lastSeconds"] == startup["medianSeconds"] == took
        print(f"{role} engine start-up: {took} s")
    assert condition(await pdc.get("up"), "Stalled")["status"] == "False"

    # A new engine revision rolls both roles: InProgress while Reconciling, then Current,
    # and each new pod is measured beside the one it replaced.
    doc = sim_cluster("up")
    doc["spec"]["engine"]["args"] = [*doc["spec"]["engine"]["args"], "--sim-record=100"]
    await pdc.apply(doc)

    async def rolling() -> bool:
        obj = await pdc.get("up")
        reconciling = condition(obj, "Reconciling")
        return (
            reconciling.get("status") == "True"
            and reconciling.get("observedGeneration") == 2
            and kstatus(obj) == "InProgress"
        )

    await wait_until(rolling, timeout=60, interval=0.3, message="kstatus InProgress while rolling out")
    verdicts.clear()
    await wait_until(current, timeout=180, interval=0.3, message="kstatus Current after the rollout")

    async def both_measured() -> bool:
        status = (await pdc.get("up"))["status"]
        return all(len(status[role]["startup"]["pods"]) == 2 for role in C.ENGINE_ROLES)

    await wait_until(both_measured, timeout=30, message="the rolled pods measured")


async def stalled_with(pdc: Any, name: str, wait_until: Any) -> dict[str, Any]:
    async def failed() -> dict[str, Any] | None:
        obj = await pdc.get(name)
        return obj if obj and kstatus(obj) == "Failed" else None

    obj = await wait_until(failed, timeout=120, interval=0.5, message=f"{name}: kstatus Failed")
    assert condition(obj, "Reconciling")["status"] == "False"
    stalled = condition(obj, "Stalled")
    print(f"{name}: Stalled {stalled['reason']}: {stalled['message']}")
    return stalled


async def warning_events(kube: Kube, namespace: str, name: str, reason: str) -> list[dict[str, Any]]:
    events = await kube.list("v1", "Event", namespace)
    return [
        e
        for e in events
        if e["involvedObject"].get("name") == name and e["reason"] == reason and e["type"] == "Warning"
    ]


async def test_an_image_that_cannot_run_stalls_with_the_image(
    kube: Kube, namespace: str, operator: OperatorProcess, pdc: Any, sim_cluster: Any, wait_until: Any
) -> None:
    doc = sim_cluster("noimg", progressDeadlineSeconds=15)
    image = "pdcluster/no-such-engine:0.0.1"
    doc["spec"]["engine"]["image"] = image
    await pdc.apply(doc)
    stalled = await stalled_with(pdc, "noimg", wait_until)
    # The local pod runner's answer for an image it cannot run; a kubelet says
    # ErrImagePull / ImagePullBackOff for one it cannot pull, which reads the same way.
    assert stalled["reason"] == "ImageNotRunnableLocally", stalled
    assert image in stalled["message"] and "noimg-prefill-0" in stalled["message"], stalled
    events = await wait_until(
        lambda: warning_events(kube, namespace, "noimg", stalled["reason"]), timeout=30, message="a Warning"
    )
    assert events[0]["message"] == stalled["message"]


async def test_more_gpus_than_a_node_has_stalls_with_the_scheduler_s_message(
    kube: Kube, namespace: str, operator: OperatorProcess, pdc: Any, sim_cluster: Any, wait_until: Any
) -> None:
    doc = sim_cluster("nogpu", progressDeadlineSeconds=15)
    doc["spec"]["decode"] = {**doc["spec"]["decode"], "gpusPerPod": 16}
    await pdc.apply(doc)
    stalled = await stalled_with(pdc, "nogpu", wait_until)
    assert stalled["reason"] == "Unschedulable", stalled
    assert "nogpu-decode-0" in stalled["message"] and "nvidia.com/gpu" in stalled["message"], stalled
    await wait_until(
        lambda: warning_events(kube, namespace, "nogpu", "Unschedulable"), timeout=30, message="a Warning"
    )
    # A spec that fits is a new goal: the stall clears once it is met.
    doc["spec"]["decode"] = {k: v for k, v in doc["spec"]["decode"].items() if k != "gpusPerPod"}
    await pdc.apply(doc)

    async def current() -> bool:
        return kstatus(await pdc.get("nogpu")) == "Current"

    await wait_until(current, timeout=180, interval=0.5, message="kstatus Current after the fix")
    assert condition(await pdc.get("nogpu"), "Stalled")["status"] == "False"


async def test_a_crash_loop_stalls_with_the_engine_s_last_log_lines(
    kube: Kube, namespace: str, operator: OperatorProcess, pdc: Any, sim_cluster: Any, wait_until: Any
) -> None:
    doc = sim_cluster("crash", progressDeadlineSeconds=15)
    args = [a for a in doc["spec"]["engine"]["args"] if not a.startswith("--sim-profile")]
    doc["spec"]["engine"]["args"] = [*args, "--sim-profile=no-such-profile"]
    await pdc.apply(doc)

    async def crash_looping() -> dict[str, Any] | None:
        stalled = await stalled_with(pdc, "crash", wait_until)
        return stalled if stalled["reason"] == "CrashLoopBackOff" else None

    stalled = await wait_until(crash_looping, timeout=120, message="Stalled with CrashLoopBackOff")
    # The engine's own last words, from the termination message the kubelet keeps.
    assert "KeyError: \"unknown profile 'no-such-profile'" in stalled["message"], stalled
    assert "exited with code 1" in stalled["message"], stalled


async def test_a_missing_secret_fails_at_once_and_recovers(
    kube: Kube, namespace: str, operator: OperatorProcess, pdc: Any, sim_cluster: Any, wait_until: Any
) -> None:
    engine = {**sim_cluster("x")["spec"]["engine"], "hfTokenSecret": {"name": "hf-token"}}
    await pdc.apply(sim_cluster("gated", engine=engine))  # the default deadline: 600 s
    stalled = await stalled_with(pdc, "gated", wait_until)
    assert stalled["reason"] == "SecretNotFound" and "hf-token" in stalled["message"], stalled
    secret = {"name": "hf-token", "namespace": namespace}
    await kube.create(
        {"apiVersion": "v1", "kind": "Secret", "metadata": secret, "stringData": {"token": "x"}}
    )

    async def current() -> bool:
        return kstatus(await pdc.get("gated")) == "Current"

    await wait_until(current, timeout=180, interval=0.5, message="kstatus Current once the Secret exists")
    warned = await warning_events(kube, namespace, "gated", "SecretNotFound")
    assert len(warned) == 1, warned  # Degraded's warning; Stalled with the same reason adds none
