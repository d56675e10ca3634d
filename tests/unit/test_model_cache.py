"""spec.model.source: what the engines mount and serve, the cache's claim and download
Job, and the ModelReady condition from the Job and its pods."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fakekube import FakeKube
from pydantic import ValidationError

from pdcluster import constants as C
from pdcluster import modelready
from pdcluster.api.v1alpha1 import ModelStatus, PDClusterSpec
from pdcluster.io.events import EventRecorder
from pdcluster.reconcile import Context, reconcile
from pdcluster.render import Owner, Replicas, render_all
from pdcluster.render import model as render_model

OWNER = Owner("c", "ns", "uid-c")


def spec_of(**model: Any) -> PDClusterSpec:
    return PDClusterSpec.model_validate(
        {"model": {"name": "org/m", **model}, "engine": {"hfTokenSecret": {"name": "hf"}}}
    )


def children(spec: PDClusterSpec) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render_all(spec, OWNER, Replicas(1, 1))}


def engine_pod(spec: PDClusterSpec, role: str = C.ROLE_DECODE) -> dict[str, Any]:
    return children(spec)[("StatefulSet", f"c-{role}")]["spec"]["template"]["spec"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


CACHE = {"source": "cache", "cache": {"size": "40Gi", "storageClassName": "rwx"}}


def test_the_hub_stays_the_default_and_mounts_nothing() -> None:
    pod = engine_pod(spec_of())
    engine = pod["containers"][0]
    assert engine["args"][0] == "org/m"
    assert "initContainers" not in pod
    assert render_model.MODEL_VOLUME not in {v["name"] for v in pod["volumes"]}
    assert {"HF_HUB_OFFLINE", "HF_ENDPOINT"}.isdisjoint(env_of(engine))
    assert not [k for k in children(spec_of()) if k[0] in ("Job", "PersistentVolumeClaim")]


def test_a_hub_mirror_reaches_the_engines() -> None:
    engine = engine_pod(spec_of(hubEndpoint="http://mirror.internal"))["containers"][0]
    assert env_of(engine)["HF_ENDPOINT"] == "http://mirror.internal"


def test_a_users_claim_is_mounted_read_only_and_served_offline() -> None:
    pod = engine_pod(spec_of(source="pvc", pvc={"claimName": "weights", "path": "llama/8b"}))
    engine = pod["containers"][0]
    volume = next(v for v in pod["volumes"] if v["name"] == render_model.MODEL_VOLUME)
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    assert engine["args"][0] == "/models/llama/8b"
    assert env_of(engine)["HF_HUB_OFFLINE"] == "1"
    assert engine["args"][engine["args"].index("--served-model-name") + 1] == "org/m"  # clients' name kept


def test_a_node_path_is_a_host_directory() -> None:
    pod = engine_pod(spec_of(source="nodePath", nodePath={"path": "/data/llama"}))
    volume = next(v for v in pod["volumes"] if v["name"] == render_model.MODEL_VOLUME)
    assert volume["hostPath"] == {"path": "/data/llama", "type": "Directory"}
    assert pod["containers"][0]["args"][0] == "/models"


def test_the_cache_claim_job_and_engines_agree_on_one_directory() -> None:
    spec = spec_of(revision="v2", hubEndpoint="http://mirror.internal", **CACHE)
    objs = children(spec)
    claim = objs[("PersistentVolumeClaim", "c-model-cache")]
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "40Gi"}},
        "storageClassName": "rwx",
    }
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "uid-c"  # collected with its PDCluster
    (job,) = [o for k, o in objs.items() if k[0] == "Job"]
    download = job["spec"]["template"]["spec"]["containers"][0]
    env = env_of(download)
    assert env["MODEL_NAME"] == "org/m" and env["MODEL_REVISION"] == "v2"
    assert env["HF_ENDPOINT"] == "http://mirror.internal"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}  # the engines' Secret
    assert download["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "c-model-cache"}
    for role in (C.ROLE_PREFILL, C.ROLE_DECODE):
        pod = engine_pod(spec, role)
        engine = pod["containers"][0]
        assert engine["args"][0] == env["MODEL_DIR"] == "/models/org/m/v2"
        assert env_of(engine)["HF_HUB_OFFLINE"] == "1"
        (wait,) = pod["initContainers"]
        assert f"{env['MODEL_DIR']}/{render_model.COMPLETE_MARKER}" in wait["command"][-1]
        assert wait["volumeMounts"] == [{"name": "model", "mountPath": "/models", "readOnly": True}]


def test_the_engines_mirror_is_the_jobs_when_the_model_names_none() -> None:
    spec = PDClusterSpec.model_validate(
        {"model": {"name": "org/m", **CACHE}, "engine": {"env": [{"name": "HF_ENDPOINT", "value": "http://m.internal"}]}}
    )
    (job,) = [o for k, o in children(spec).items() if k[0] == "Job"]
    assert env_of(job["spec"]["template"]["spec"]["containers"][0])["HF_ENDPOINT"] == "http://m.internal"
    without = PDClusterSpec.model_validate({"model": {"name": "org/m", **CACHE}})
    assert render_model.download_job_name(spec, OWNER) != render_model.download_job_name(without, OWNER)


def test_a_retained_claim_has_no_owner() -> None:
    spec = spec_of(source="cache", cache={"size": "1Gi", "retain": True})
    assert "ownerReferences" not in children(spec)[("PersistentVolumeClaim", "c-model-cache")]["metadata"]


def test_a_new_revision_is_a_new_job_and_scaling_is_not() -> None:
    job = render_model.download_job_name
    assert job(spec_of(**CACHE), OWNER) != job(spec_of(revision="v2", **CACHE), OWNER)
    bigger = spec_of(**CACHE).model_copy(update={"decode": spec_of().decode.model_copy(update={"replicas": 3})})
    assert job(bigger, OWNER) == job(spec_of(**CACHE), OWNER)


@pytest.mark.parametrize(
    ("model", "error"),
    [
        ({"source": "cache"}, "model.source cache needs model.cache"),
        ({"source": "pvc"}, "model.source pvc needs model.pvc"),
        ({"cache": {"size": "1Gi"}}, "model.cache is set but model.source is hub"),
        ({"source": "pvc", "pvc": {"claimName": "w", "path": "a/../b"}}, "must not contain '..'"),
        ({"source": "pvc", "pvc": {"claimName": "w", "path": "/abs"}}, "must be relative"),
        ({"source": "nodePath", "nodePath": {"path": "relative"}}, "should match pattern"),
        ({"hubEndpoint": "mirror.internal"}, "should match pattern"),
    ],
)
def test_bad_model_sources_are_clear_errors(model: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error.replace("(", r"\(").replace(".", r"\.")):
        spec_of(**model)


def test_the_crd_checks_the_sources_too() -> None:
    from pdcluster.api.crd import build_crd

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    model = schema["properties"]["spec"]["properties"]["model"]
    messages = {r["message"] for r in model["x-kubernetes-validations"]}
    assert {"source cache needs cache", "cache is set but source is not cache"} <= messages
    assert model["properties"]["source"]["enum"] == ["hub", "pvc", "nodePath", "cache"]


# --------------------------------------------------------------------- ModelReady

JOB = "c-model-1234abcd"


def job(*, complete: bool = False, failed: int = 0, gave_up: bool = False) -> dict[str, Any]:
    conditions = []
    if complete:
        conditions.append({"type": "Complete", "status": "True"})
    if gave_up:
        conditions.append({"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"})
    return {"metadata": {"name": JOB}, "status": {"failed": failed, "conditions": conditions}}


def pod(code: int, message: str, finished: str = "2026-12-01T12:00:00Z") -> dict[str, Any]:
    ended = {"exitCode": code, "message": message, "finishedAt": finished}
    return {"status": {"containerStatuses": [{"name": "download", "state": {"terminated": ended}}]}}


REPORT = json.dumps({"bytes": 4_923_456, "files": 6, "ms": 3200})


def test_a_finished_download_says_how_much_and_how_long() -> None:
    assert modelready.needs_pods(job(complete=True), None)
    (ok, reason, message), model = modelready.observe(JOB, job(complete=True), [pod(0, REPORT)], None)
    assert (ok, reason) == (True, "Downloaded")
    assert message == f"6 files, 4.7 MiB (4923456 bytes) in 3.2 s by Job {JOB}"
    assert model == ModelStatus(job=JOB, bytes=4_923_456, files=6, download_ms=3200)
    # Known now: no more reads of its pods.
    assert not modelready.needs_pods(job(complete=True), model)
    assert modelready.observe(JOB, job(complete=True), None, model)[0] == (ok, reason, message)


def test_a_failed_download_carries_the_error_its_pod_ended_with() -> None:
    pods = [
        pod(1, "old error", "2026-12-01T12:00:00Z"),
        pod(1, "Traceback ...\nRepositoryNotFoundError: 401", "2026-12-01T12:01:00Z"),
    ]
    (ok, reason, message), model = modelready.observe(JOB, job(failed=2, gave_up=True), pods, None)
    assert (ok, reason) == (False, "DownloadFailed")
    assert message == f"Job {JOB} failed (BackoffLimitExceeded): Traceback ...\nRepositoryNotFoundError: 401"
    assert model.failed_attempts == 2 and model.error is not None and model.bytes is None
    assert not modelready.needs_pods(job(failed=2, gave_up=True), model)
    assert modelready.needs_pods(job(failed=3), model)  # another attempt failed: read its error


def test_a_retried_download_is_still_downloading_and_says_why() -> None:
    (ok, reason, message), _ = modelready.observe(JOB, job(failed=1), [pod(1, "connection refused")], None)
    assert (ok, reason) == (False, "Downloading")
    assert "after 1 failed attempt(s); last: connection refused" in message


def test_no_job_yet_is_pending_and_another_jobs_status_is_forgotten() -> None:
    old = ModelStatus(job="c-model-old", bytes=1)
    (ok, reason, _), model = modelready.observe(JOB, None, None, old)
    assert (ok, reason) == (False, "CachePending") and model == ModelStatus(job=JOB)
    assert modelready.needs_pods(job(complete=True), old)


# --------------------------------------------------------------------- one reconcile


async def test_reconcile_reports_the_download_and_reads_its_pods_once() -> None:
    kube = FakeKube()
    body = kube.put(
        {
            "apiVersion": C.API_VERSION,
            "kind": C.KIND,
            "metadata": {"name": "c", "namespace": "ns"},
            "spec": {"model": {"name": "org/m", **CACHE}},
        }
    )
    ctx = Context(kube=kube, events=EventRecorder(kube))  # type: ignore[arg-type]
    await reconcile(ctx, body)
    stored = kube.live(C.KIND, "c")
    assert stored is not None
    ready = next(c for c in stored["status"]["conditions"] if c["type"] == "ModelReady")
    assert (ready["status"], ready["reason"]) == ("False", "Downloading")
    assert kube.live("PersistentVolumeClaim", "c-model-cache") is not None
    (name,) = [n for _, k, n in kube.written("apply") if k == "Job"]
    finished = kube.live("Job", name)
    assert finished is not None
    finished["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
    kube.put(finished)
    done = pod(0, REPORT)
    done |= {"apiVersion": "v1", "kind": "Pod"}
    done["metadata"] = {"name": f"{name}-x1y2z", "namespace": "ns", "labels": {C.LABEL_JOB_NAME: name}}
    kube.put(done)
    await reconcile(ctx, kube.live(C.KIND, "c") or body)
    stored = kube.live(C.KIND, "c")
    assert stored is not None
    ready = next(c for c in stored["status"]["conditions"] if c["type"] == "ModelReady")
    assert (ready["status"], ready["reason"]) == ("True", "Downloaded")
    assert stored["status"]["model"] == {
        "job": name, "bytes": 4_923_456, "files": 6, "downloadMs": 3200, "failedAttempts": 0,
    }  # fmt: skip
    del kube.objects[("Pod", "ns", done["metadata"]["name"])]  # a collected pod changes nothing now
    await reconcile(ctx, kube.live(C.KIND, "c") or body)
    stored = kube.live(C.KIND, "c")
    assert stored is not None and stored["status"]["model"]["bytes"] == 4_923_456
