"""One reconcile against an in-memory apiserver (fakekube.py): what it applies, what it
leaves alone, its one status write and the events after it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from fakekube import FakeKube

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.io.events import EventRecorder
from pdcluster.io.kube import ApiError
from pdcluster.reconcile import Context, reconcile
from pdcluster.render import Owner, Replicas, apply_stage, render_all
from pdcluster.router.state import StatePublisher
from pdcluster.status import kv_transfer

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def pdcluster(kube: FakeKube, **spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"model": {"name": "m"}, **spec},
    }
    return kube.put(body)


async def run(kube: FakeKube, body: dict[str, Any]) -> dict[str, Any]:
    """One reconcile of the stored object; returns it as stored afterwards."""
    ctx = Context(kube=kube, events=EventRecorder(kube), clock=lambda: NOW)  # type: ignore[arg-type]
    await reconcile(ctx, kube.live(C.KIND, body["metadata"]["name"]) or body)
    stored = kube.live(C.KIND, body["metadata"]["name"])
    assert stored is not None
    return stored


def events(kube: FakeKube) -> list[str]:
    return [name for verb, kind, name in kube.writes if kind == "Event"]


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)


async def test_a_new_pdcluster_gets_its_children_then_one_status_write_then_events() -> None:
    kube = FakeKube()
    body = pdcluster(kube)
    await run(kube, body)
    spec = PDClusterSpec.model_validate(body["spec"])
    children = render_all(spec, Owner("c", "ns", "uid-c"), Replicas.choose(spec, None))
    assert {(k, n) for v, k, n in kube.written("apply")} == {
        (o["kind"], o["metadata"]["name"]) for o in children
    }
    verbs = [v for v, k, _ in kube.writes if k != "Event"]
    assert verbs.count("patch-status") == 1 and verbs[-1] == "patch-status"
    status_at = kube.writes.index(("patch-status", C.KIND, "c"))
    assert all(kube.writes.index(w) > status_at for w in kube.writes if w[1] == "Event")
    # One Created event naming every child (not one per child: see reconcile's comment).
    (created,) = [e for e in kube.list_sync("Event") if e["reason"] == "Created"]
    assert len(events(kube)) == 1
    assert created["message"] == "Created " + ", ".join(
        f"{o['kind']} {o['metadata']['name']}" for o in children
    )


async def test_children_go_out_in_stages_each_stage_at_once() -> None:
    """A Role before its binding, Services before the pods they serve: stage by stage,
    each stage's applies together (a new PDCluster: six round trips, not fourteen)."""
    kube = FakeKube()
    body = pdcluster(kube)
    await run(kube, body)
    spec = PDClusterSpec.model_validate(body["spec"])
    children = render_all(spec, Owner("c", "ns", "uid-c"), Replicas.choose(spec, None))
    stage_of = {(o["kind"], o["metadata"]["name"]): apply_stage(o) for o in children}
    stages = [stage_of[(k, n)] for v, k, n in kube.written("apply")]
    assert stages == sorted(stages) and len(set(stages)) > 1
    assert kube.most_applying == max(stages.count(s) for s in set(stages)) > 1


async def test_a_rejected_child_is_reported_and_the_others_still_applied() -> None:
    kube = FakeKube()
    body = pdcluster(kube)
    kube.fail_applies[("Service", "c-prefill")] = ApiError(422, "Invalid", "spec.ports: Invalid value")
    stored = await run(kube, body)
    assert ("apply", "StatefulSet", "c-prefill") in kube.writes
    assert ("apply", "Service", "c-decode") in kube.writes
    degraded = condition(stored, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ApplyFailed"
    assert "Service c-prefill: spec.ports: Invalid value" in degraded["message"]


async def test_at_rest_nothing_is_written() -> None:
    kube = FakeKube()
    body = pdcluster(kube)
    await run(kube, body)
    kube.writes.clear()
    await run(kube, body)
    assert kube.writes == []


async def test_paused_applies_nothing() -> None:
    kube = FakeKube()
    body = await run(kube, pdcluster(kube, paused=True))
    assert kube.written("apply") == []
    assert condition(body, "Progressing")["reason"] == "Paused"


async def test_suspended_scales_every_workload_to_zero() -> None:
    kube = FakeKube()
    body = await run(kube, pdcluster(kube, suspend=True))
    workloads = [kube.live(k, n) for v, k, n in kube.written("apply") if k in ("StatefulSet", "Deployment")]
    assert workloads and all(w["spec"]["replicas"] == 0 for w in workloads if w)
    assert condition(body, "Ready")["reason"] == "Suspended"


async def test_a_failed_status_write_sends_no_events_and_the_next_reconcile_writes_it() -> None:
    kube = FakeKube()
    body = pdcluster(kube)
    kube.fail_status_writes = ApiError(500, "InternalError", "etcd timeout")
    with pytest.raises(ApiError):
        await run(kube, body)
    assert events(kube) == []  # nothing described a state that was not stored
    kube.fail_status_writes = None
    stored = await run(kube, body)
    assert stored["status"]["observedGeneration"] == 1


async def test_a_removed_field_leaves_the_child() -> None:
    kube = FakeKube()
    body = pdcluster(kube, prefill={"nodeSelector": {"pool": "h200"}, "priorityClassName": "high"})
    await run(kube, body)
    sts = kube.live("StatefulSet", "c-prefill")
    assert sts and sts["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "h200"}
    kube.objects[(C.KIND, "ns", "c")].others["spec"]["prefill"] = {}
    kube.writes.clear()
    await run(kube, body)
    assert ("apply", "StatefulSet", "c-prefill") in kube.writes
    sts = kube.live("StatefulSet", "c-prefill")
    assert sts and "nodeSelector" not in sts["spec"]["template"]["spec"]
    assert "priorityClassName" not in sts["spec"]["template"]["spec"]


async def test_drift_by_someone_else_is_put_back() -> None:
    kube = FakeKube()
    body = pdcluster(kube)
    await run(kube, body)
    await kube.merge_patch("apps/v1", "StatefulSet", "c-decode", "ns", {"spec": {"replicas": 5}})
    kube.writes.clear()
    await run(kube, body)
    assert kube.written("apply") == [("apply", "StatefulSet", "c-decode")]
    assert (kube.live("StatefulSet", "c-decode") or {})["spec"]["replicas"] == 1


async def test_a_missing_tracing_headers_secret_holds_back_all_that_export_spans() -> None:
    kube = FakeKube()
    tracing = {"enabled": True, "endpoint": "http://otel:4318", "headersSecret": {"name": "otel", "key": "headers"}}
    body = await run(kube, pdcluster(kube, tracing=tracing))
    applied = {n for _, k, n in kube.written("apply") if k in ("StatefulSet", "Deployment")}
    assert applied == {"c-mooncake-master"}  # the router and the engines send the header
    degraded = condition(body, "Degraded")
    assert degraded["reason"] == "SecretNotFound" and "ns/otel" in degraded["message"]


async def test_a_missing_secret_holds_the_engines_back_and_warns_after_the_status() -> None:
    kube = FakeKube()
    body = await run(kube, pdcluster(kube, engine={"hfTokenSecret": {"name": "hf"}}))
    applied = {n for _, k, n in kube.written("apply") if k in ("StatefulSet", "Deployment")}
    assert applied == {"c-router", "c-mooncake-master"}  # not the engines that need the Secret
    degraded = condition(body, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "SecretNotFound")
    warning = next(e for e in kube.list_sync("Event") if e["reason"] == "SecretNotFound")
    assert warning["type"] == "Warning"
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hf", "namespace": "ns"},
            "data": {"token": "eA=="},
        }
    )
    await run(kube, body)
    assert ("apply", "StatefulSet", "c-prefill") in kube.writes


async def test_external_mode_follows_the_role_scalers() -> None:
    kube = FakeKube()
    autoscaling = {"enabled": True, "mode": "external"}
    body = pdcluster(kube, autoscaling=autoscaling, prefill={"replicas": 2})
    await run(kube, body)
    scaler = kube.live(C.SCALER_KIND, "c-prefill")
    assert scaler and scaler["spec"]["replicas"] == 2  # created from the spec
    await kube.merge_patch(C.API_VERSION, C.SCALER_KIND, "c-prefill", "ns", {"spec": {"replicas": 4}})
    await run(kube, body)
    assert (kube.live("StatefulSet", "c-prefill") or {})["spec"]["replicas"] == 4
    assert (kube.live(C.SCALER_KIND, "c-prefill") or {})["spec"]["replicas"] == 4  # never taken back


async def test_router_verdicts_become_the_kv_transfer_condition_and_one_warning() -> None:
    """Routers write their probe verdicts into the router-state ConfigMap (router/state.py);
    the operator's own apply of that ConfigMap keeps them, and its status says what they say."""
    kube = FakeKube()
    body = pdcluster(kube)
    stored = await run(kube, body)
    assert not [c for c in stored["status"]["conditions"] if c["type"] == "KVTransfer"], "nothing probed yet"

    router = StatePublisher(kube, "ns", "c-router-state", "c-router-abc")  # type: ignore[arg-type]
    router.routers = {"c-router-abc"}
    await router.publish({"pairs": 2, "passed": 2, "failed": []})
    stored = await run(kube, body)
    verified = condition(stored, "KVTransfer")
    assert (verified["status"], verified["reason"]) == ("True", "Verified")
    assert verified["message"].startswith("2 ")  # the pairs verified

    bad = {"prefill": "c-prefill-1", "decode": "c-decode-0", "reason": "decode computed the prompt itself"}
    await router.publish({"pairs": 2, "passed": 1, "failed": [bad]})
    kube.writes.clear()
    stored = await run(kube, body)
    handoff = condition(stored, "KVTransfer")
    assert (handoff["status"], handoff["reason"]) == ("False", "HandOffFailed")
    assert "c-prefill-1 -> c-decode-0" in handoff["message"]  # the pair out of rotation, by name
    assert [k for _, k, _ in kube.writes].count("Event") == 1, "one Warning, after the status write"
    kube.writes.clear()
    await run(kube, body)
    assert [k for _, k, _ in kube.writes] == [], "at rest: no second warning, no write"

    # A router that is gone: the next one to write removes its verdicts.
    successor = StatePublisher(kube, "ns", "c-router-state", "c-router-def")  # type: ignore[arg-type]
    successor.routers = {"c-router-def"}
    await successor.publish({"pairs": 2, "passed": 2, "failed": []})
    data = kube.live("ConfigMap", "c-router-state", "ns")["data"]  # type: ignore[index]
    assert set(data) == {"c-router-def"}
    stored = await run(kube, body)
    assert condition(stored, "KVTransfer")["status"] == "True"


def test_verdicts_that_are_not_ours_are_ignored() -> None:
    assert kv_transfer(None) is None
    assert kv_transfer({"r1": "not json", "r2": '{"passed": "x"}'}) is None
    ok = kv_transfer({"r1": '{"passed": 3, "failed": []}', "r2": '{"passed": 1, "failed": []}'})
    assert ok is not None and ok[0] is True and "3 prefill" in ok[2]


async def cached_run(kube: FakeKube, body: dict[str, Any]) -> dict[str, Any]:
    """One reconcile reading children from the watch cache, as the operator does."""
    ctx = Context(kube=kube, events=EventRecorder(kube), clock=lambda: NOW, children=kube.children())  # type: ignore[arg-type]
    await reconcile(ctx, kube.live(C.KIND, body["metadata"]["name"]) or body)
    return kube.live(C.KIND, body["metadata"]["name"]) or {}


def kinds_named(kube: FakeKube, role: str) -> set[tuple[str, str]]:
    return {(k, n) for (k, _, n) in kube.objects if n == f"c-{role}"}


async def test_a_suspended_role_keeps_no_disruption_budget() -> None:
    """A budget over no pod guards nothing and draws a NoPods warning from the disruption
    controller: suspending deletes the budgets, resuming brings them back."""
    kube = FakeKube()
    body = pdcluster(kube)
    await cached_run(kube, body)
    budgets = {(k, n) for (k, _, n) in kube.objects if k == "PodDisruptionBudget"}
    assert budgets == {("PodDisruptionBudget", f"c-{role}") for role in ("prefill", "decode", "router")}
    kube.objects[(C.KIND, "ns", "c")].others["spec"]["suspend"] = True
    await cached_run(kube, body)
    assert not any(k == "PodDisruptionBudget" for (k, _, _) in kube.objects)
    assert kube.live("StatefulSet", "c-prefill") is not None  # everything else stays
    kube.objects[(C.KIND, "ns", "c")].others["spec"]["suspend"] = False
    await cached_run(kube, body)
    assert {(k, n) for (k, _, n) in kube.objects if k == "PodDisruptionBudget"} == budgets


async def test_switching_to_colocated_replaces_the_pools() -> None:
    kube = FakeKube()
    body = pdcluster(kube)
    await cached_run(kube, body)
    assert kinds_named(kube, "prefill") == {("StatefulSet", "c-prefill"), ("Service", "c-prefill"),
                                            ("PodDisruptionBudget", "c-prefill")}  # fmt: skip
    kube.objects[(C.KIND, "ns", "c")].others["spec"] |= {"mode": "colocated", "colocated": {"replicas": 3}}
    kube.writes.clear()
    stored = await cached_run(kube, body)
    assert kinds_named(kube, "prefill") == kinds_named(kube, "decode") == set()
    assert (kube.live("StatefulSet", "c-colocated") or {})["spec"]["replicas"] == 3
    (deleted,) = [e for e in kube.list_sync("Event") if e["reason"] == "Deleted"]
    assert "StatefulSet c-prefill" in deleted["message"] and "StatefulSet c-decode" in deleted["message"]
    status = stored["status"]
    assert status["colocated"]["desired"] == 3 and "ratio" not in status
    assert "colocated" in condition(stored, "Ready")["message"]
    kube.writes.clear()
    await cached_run(kube, body)
    assert kube.writes == [], "at rest: nothing applied, nothing deleted"


async def test_children_an_earlier_pdcluster_of_the_name_left_are_replaced_not_adopted() -> None:
    """Deleted and created again before the garbage collector reached the children:
    adopting them would race the collector, which deletes them after the status said
    all was there."""
    kube = FakeKube()
    body = pdcluster(kube, autoscaling={"enabled": True, "mode": "external"})
    await cached_run(kube, body)
    before = {(k, n): s.meta["uid"] for (k, _, n), s in kube.objects.items() if k != C.KIND and k != "Event"}
    kube.objects[(C.KIND, "ns", "c")].meta["uid"] = "uid-c-again"
    kube.writes.clear()
    stored = await cached_run(kube, body)
    after = {(k, n): s.meta["uid"] for (k, _, n), s in kube.objects.items() if k != C.KIND and k != "Event"}
    assert after.keys() == before.keys()
    assert all(after[key] != before[key] for key in before), "every child is a new object"
    for kind, name in after:
        refs = (kube.live(kind, name) or {})["metadata"]["ownerReferences"]
        assert [r["uid"] for r in refs] == ["uid-c-again"], (kind, name)
        deleted_at = kube.writes.index(("delete", kind, name))
        created = "create" if kind == C.SCALER_KIND else "apply"
        assert deleted_at < kube.writes.index((created, kind, name))
    (deleted,) = [e for e in kube.list_sync("Event") if e["reason"] == "Deleted"]
    assert "StatefulSet c-prefill" in deleted["message"]
    assert condition(stored, "Degraded")["status"] == "False"
    kube.writes.clear()
    await cached_run(kube, body)
    assert kube.writes == [], "at rest again"


async def test_nothing_is_deleted_while_paused_and_role_scalers_stay() -> None:
    kube = FakeKube()
    body = pdcluster(kube, autoscaling={"enabled": True, "mode": "external"})
    await cached_run(kube, body)
    assert kube.live(C.SCALER_KIND, "c-prefill") is not None
    kube.objects[(C.KIND, "ns", "c")].others["spec"] |= {"mode": "colocated", "paused": True}
    kube.writes.clear()
    await cached_run(kube, body)
    assert kube.written("delete") == []
    kube.objects[(C.KIND, "ns", "c")].others["spec"]["paused"] = False
    await cached_run(kube, body)
    deleted = {n for _, k, n in kube.written("delete")}
    assert "c-prefill" in deleted and kube.live("StatefulSet", "c-prefill") is None
    # Created by the operator but owned by their HPA from then on: never deleted by it.
    assert kube.live(C.SCALER_KIND, "c-prefill") is not None
    assert kube.live(C.SCALER_KIND, "c-colocated") is not None


@pytest.mark.parametrize(
    ("image", "warned"),
    [
        ("vllm/vllm-openai:v0.32.0", True),
        ("registry.example:5000/vllm/vllm-openai:v0.31.2", True),
        ("vllm/vllm-openai:v0.33.0", False),
        ("pdcluster/engine:0.1.0", False),
    ],
)
async def test_the_store_with_an_engine_image_known_to_crash_is_degraded_and_warned(image, warned) -> None:
    kube = FakeKube()
    body = await run(kube, pdcluster(kube, engine={"image": image}, mooncake={"store": {"enabled": True}}))
    degraded = condition(body, "Degraded")
    assert (degraded["status"] == "True" and degraded["reason"] == "EngineImageKnownBug") == warned
    events = [e for e in kube.list_sync("Event") if e["reason"] == "EngineImageKnownBug"]
    assert len(events) == (1 if warned else 0)
    # Warned, not held back: the engines are applied.
    assert ("apply", "StatefulSet", "c-prefill") in kube.writes
