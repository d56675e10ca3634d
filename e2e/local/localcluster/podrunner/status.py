"""Pod phase and conditions from container statuses, as the kubelet computes them
(getPhase and the condition generators in pkg/kubelet/status, kubernetes v1.36). Pure."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def _status(statuses: list[Obj], name: str) -> Obj | None:
    return next((s for s in statuses if s["name"] == name), None)


def is_sidecar(container: Obj) -> bool:
    return container.get("restartPolicy") == "Always"


def phase(spec: Obj, init_statuses: list[Obj], statuses: list[Obj], *, terminal: bool = False) -> str:
    """`terminal`: the pod is being deleted and its containers have stopped for good."""
    pending_init = failed_init = 0
    for c in spec.get("initContainers", []):
        s = _status(init_statuses, c["name"])
        state = (s or {}).get("state", {})
        if is_sidecar(c):
            pending_init += not (state.get("running") and s and s.get("started"))
        elif s is None or "running" in state:
            pending_init += 1
        elif "terminated" in state:
            failed_init += state["terminated"]["exitCode"] != 0
        elif last := s.get("lastState", {}).get("terminated"):
            failed_init += last["exitCode"] != 0
        else:
            pending_init += 1

    unknown = running = waiting = stopped = succeeded = 0
    for c in spec["containers"]:
        s = _status(statuses, c["name"])
        state = (s or {}).get("state", {})
        if s is None or not state:
            unknown += 1
        elif "running" in state:
            running += 1
        elif "terminated" in state:
            stopped += 1
            succeeded += state["terminated"]["exitCode"] == 0
        elif s.get("lastState", {}).get("terminated"):
            stopped += 1
        else:
            waiting += 1

    policy = spec.get("restartPolicy", "Always")
    if failed_init and policy == "Never":
        return "Failed"
    if pending_init or waiting:
        return "Pending"
    if running and not unknown:
        return "Running"
    if not running and stopped and not unknown:
        if terminal:
            return "Succeeded" if stopped == succeeded else "Failed"
        if policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        return "Failed" if policy == "Never" else "Running"
    return "Pending"


def conditions(pod: Obj, init_statuses: list[Obj], statuses: list[Obj], pod_phase: str, now: str) -> list[Obj]:
    """PodReadyToStartContainers, Initialized, ContainersReady and Ready; a condition keeps
    its lastTransitionTime while its status does not change."""
    spec = pod["spec"]
    previous = {c["type"]: c for c in pod.get("status", {}).get("conditions", [])}
    completed = pod_phase in ("Succeeded", "Failed")

    initialized = all(
        (s := _status(init_statuses, c["name"])) is not None
        and (s.get("started") if is_sidecar(c) else s.get("state", {}).get("terminated", {}).get("exitCode") == 0)
        for c in spec.get("initContainers", [])
    )
    unready = [c["name"] for c in spec["containers"] if not (_status(statuses, c["name"]) or {}).get("ready")]
    gates = [g["conditionType"] for g in spec.get("readinessGates", [])]
    gates_ok = all(previous.get(g, {}).get("status") == "True" for g in gates)

    def condition(kind: str, ok: bool, reason: str = "", message: str = "") -> Obj:
        status = "True" if ok else "False"
        old = previous.get(kind, {})
        c: Obj = {"type": kind, "status": status,
                  "lastTransitionTime": old.get("lastTransitionTime") if old.get("status") == status else now}
        if not ok and reason:
            c["reason"] = "PodCompleted" if completed else reason
            if message and not completed:
                c["message"] = message
        return c

    pending_init = [c["name"] for c in spec.get("initContainers", []) if not is_sidecar(c)]
    containers_msg = f"containers with unready status: [{' '.join(unready)}]"
    return [
        condition("PodReadyToStartContainers", not completed),
        condition("Initialized", initialized, "ContainersNotInitialized",
                  f"containers with incomplete status: [{' '.join(pending_init)}]"),
        condition("ContainersReady", not unready, "ContainersNotReady", containers_msg),
        condition("Ready", not unready and gates_ok, "ContainersNotReady" if unready else "ReadinessGatesNotReady",
                  containers_msg if unready else "corresponding condition of pod readiness gate is not True"),
    ]
