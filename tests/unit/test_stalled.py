"""Reconcile (against fakekube) with pods that cannot start: Stalled past
spec.progressDeadlineSeconds with the pod's own reason, one Warning event after the
status write, Argo CD's health Degraded; start-ups measured from the watch cache."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fakekube import FakeKube
from test_argocd_health import health, ready_workloads
from test_reconcile import NOW, condition, pdcluster

from pdcluster import constants as C
from pdcluster.io.events import EventRecorder
from pdcluster.reconcile import Context, reconcile
from pdcluster.timestamps import time_s


async def run_at(kube: FakeKube, body: dict[str, Any], seconds: float, cache: bool = False) -> dict[str, Any]:
    at = NOW + timedelta(seconds=seconds)
    children = kube.children() if cache else None
    ctx = Context(kube=kube, events=EventRecorder(kube), clock=lambda: at, children=children)  # type: ignore[arg-type]
    await reconcile(ctx, kube.live(C.KIND, body["metadata"]["name"]) or body)
    stored = kube.live(C.KIND, body["metadata"]["name"])
    assert stored is not None
    return stored


def engine_pod(name: str, role: str, **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "creationTimestamp": time_s(NOW),
            "labels": {C.LABEL_CLUSTER: "c", C.LABEL_ROLE: role, C.LABEL_MANAGED_BY: C.MANAGED_BY},
        },
        "status": status,
    }


async def test_an_image_that_cannot_be_pulled_stalls_past_the_deadline() -> None:
    kube = FakeKube()
    body = await run_at(kube, pdcluster(kube, progressDeadlineSeconds=300), 0)
    image = "registry.invalid/no-such-engine:1"
    waiting = {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{image}"'}
    kube.put(
        engine_pod(
            "c-decode-0",
            C.ROLE_DECODE,
            containerStatuses=[{"name": "engine", "image": image, "state": {"waiting": waiting}}],
        )
    )
    body = await run_at(kube, body, 200)
    assert condition(body, "Reconciling")["status"] == "True"
    assert condition(body, "Stalled")["status"] == "False"
    before = len(kube.writes)
    body = await run_at(kube, body, 301)
    stalled = condition(body, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "ImagePullBackOff")
    assert image in stalled["message"] and "c-decode-0" in stalled["message"]
    assert condition(body, "Reconciling")["status"] == "False"
    after = [w for w in kube.writes[before:] if w[1] in (C.KIND, "Event")]
    assert after[0][1] == C.KIND and after[1][1] == "Event"  # the status first, then the warning
    events = [e for e in kube.list_sync("Event") if e["reason"] == "ImagePullBackOff"]
    assert len(events) == 1 and events[0]["type"] == "Warning"
    assert health(body) == ("Degraded", f"ImagePullBackOff: {stalled['message']}")
    await run_at(kube, body, 400)  # still stalled, same reason: no second warning
    assert len([e for e in kube.list_sync("Event") if e["reason"] == "ImagePullBackOff"]) == 1


async def test_start_ups_come_from_the_pods_in_the_watch_cache() -> None:
    kube = FakeKube()
    body = await run_at(kube, pdcluster(kube), 0, cache=True)
    ready = {"type": "Ready", "status": "True", "lastTransitionTime": time_s(NOW + timedelta(seconds=84))}
    kube.put(engine_pod("c-prefill-0", C.ROLE_PREFILL, conditions=[ready]))
    ready_workloads(kube)
    body = await run_at(kube, body, 90, cache=True)
    assert body["status"]["prefill"]["startup"]["lastSeconds"] == 84
    assert body["status"]["prefill"]["startup"]["pods"][0]["pod"] == "c-prefill-0"
    assert "startup" not in body["status"]["decode"]
    assert condition(body, "Reconciling")["status"] == "False"


async def test_a_missing_secret_stalls_at_once_with_one_warning() -> None:
    kube = FakeKube()
    body = await run_at(kube, pdcluster(kube, engine={"hfTokenSecret": {"name": "hf"}}), 0)
    assert condition(body, "Stalled")["reason"] == "SecretNotFound"
    assert condition(body, "Degraded")["reason"] == "SecretNotFound"
    body = await run_at(kube, body, 10)
    assert [e["type"] for e in kube.list_sync("Event") if e["reason"] == "SecretNotFound"] == ["Warning"]
