"""Where engines read the model from (`spec.model.source`), and the operator-managed cache.

`hub`: each engine downloads `model.name` itself, as vLLM does by default. `pvc` and
`nodePath`: a directory the user filled, mounted read-only. `cache`: a ReadWriteMany
claim the operator creates, filled once by a download Job with huggingface_hub's
`snapshot_download` into a plain directory (`local_dir`: files, no symlinked blob
store), so that engines serve that directory read-only like any other. Engines of the
last three run with `HF_HUB_OFFLINE=1` (huggingface_hub constants.py): nothing they do
reaches the hub. A cache engine waits in an init container until the Job has written
its completion marker, the last thing it does.

The Job reports what it did in its termination message (bytes, files, milliseconds), which the
operator reads into the ModelReady condition; a Job that fails reports the tail of its
log instead (`FallbackToLogsOnError`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdcluster.api.v1alpha1 import ModelSource, PDClusterSpec
from pdcluster.render.names import Owner, env_secret, labels, metadata

MODEL_VOLUME = "model"
MODEL_MOUNT = "/models"
CACHE_ROLE = "model-cache"
COMPLETE_MARKER = ".pdcluster-complete"
# Where the Job's container writes its report; the kubelet reads it back as the
# container's termination message.
REPORT_PATH = "/tmp/pdcluster-model-report"
WAIT_SECONDS = 5
BACKOFF_LIMIT = 3

# Run by the Job with the image's Python. huggingface_hub reads HF_TOKEN and HF_ENDPOINT
# from the environment itself; a marker left by an earlier fill (a retained claim) means
# there is nothing to download.
DOWNLOAD_SCRIPT = """\
import json, os, pathlib, time
target = pathlib.Path(os.environ["MODEL_DIR"])
marker = target / os.environ["MODEL_MARKER"]
if marker.is_file():
    report = json.loads(marker.read_text()) | {"reused": True}
else:
    from huggingface_hub import snapshot_download
    started = time.monotonic()
    snapshot_download(os.environ["MODEL_NAME"], revision=os.environ["MODEL_REVISION"], local_dir=target)
    files = [p for p in target.rglob("*") if p.is_file() and ".cache" not in p.relative_to(target).parts]
    report = {"bytes": sum(p.stat().st_size for p in files), "files": len(files),
              "ms": round((time.monotonic() - started) * 1000)}
    marker.write_text(json.dumps(report))
pathlib.Path(os.environ["REPORT_FILE"]).write_text(json.dumps(report))
print(json.dumps(report))
"""


def revision(spec: PDClusterSpec) -> str:
    return spec.model.revision or "main"


def cache_dir(spec: PDClusterSpec) -> str:
    """The model's directory within the cache claim: one per model and revision, so a
    changed model is downloaded beside the old one, never over files engines still read."""
    return f"{spec.model.name}/{revision(spec)}"


def serve_path(spec: PDClusterSpec) -> str:
    """What `vllm serve` is given: the hub id, or the mounted directory."""
    model = spec.model
    if model.source == ModelSource.pvc and model.pvc is not None:
        return f"{MODEL_MOUNT}/{model.pvc.path}".rstrip("/")
    if model.source == ModelSource.node_path:
        return MODEL_MOUNT
    if model.source == ModelSource.cache:
        return f"{MODEL_MOUNT}/{cache_dir(spec)}"
    return model.name


def cache_claim_name(owner: Owner) -> str:
    return owner.child(CACHE_ROLE)


def download_job_name(spec: PDClusterSpec, owner: Owner) -> str:
    """A Job's pod template cannot change: a new model, revision or download set-up is a
    new Job (the old one is no longer rendered and is deleted)."""
    return f"{owner.child('model')}-{_job_hash(spec)}"


def _job_hash(spec: PDClusterSpec) -> str:
    model = spec.model
    token = spec.engine.hf_token_secret
    shared = [model.name, revision(spec), hub_endpoint(spec), _downloader_image(spec), token and token.wire()]
    return hashlib.sha256(json.dumps(shared).encode()).hexdigest()[:8]


def hub_endpoint(spec: PDClusterSpec) -> str | None:
    """The mirror the Job downloads from: `model.hubEndpoint`, else an `HF_ENDPOINT` the
    engines were already given in `engine.env` (how a hub engine's mirror was set before)."""
    given = (e.value for e in spec.engine.env if e.name == "HF_ENDPOINT" and e.value)
    return spec.model.hub_endpoint or next(given, None)


def _downloader_image(spec: PDClusterSpec) -> str:
    cache = spec.model.cache
    return (cache.image if cache is not None else None) or spec.engine.image


def _volume(spec: PDClusterSpec, owner: Owner) -> dict[str, Any] | None:
    model = spec.model
    if model.source == ModelSource.pvc and model.pvc is not None:
        return {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": model.pvc.claim_name, "readOnly": True}}
    if model.source == ModelSource.node_path and model.node_path is not None:
        return {"name": MODEL_VOLUME, "hostPath": {"path": model.node_path.path, "type": "Directory"}}
    if model.source == ModelSource.cache:
        return {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": cache_claim_name(owner), "readOnly": True}}
    return None


def engine_volumes(spec: PDClusterSpec, owner: Owner) -> list[dict[str, Any]]:
    volume = _volume(spec, owner)
    return [volume] if volume is not None else []


def engine_mounts(spec: PDClusterSpec) -> list[dict[str, Any]]:
    if spec.model.source == ModelSource.hub:
        return []
    return [{"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True}]


def engine_env(spec: PDClusterSpec) -> list[dict[str, Any]]:
    if spec.model.source == ModelSource.hub:
        endpoint = spec.model.hub_endpoint
        return [{"name": "HF_ENDPOINT", "value": endpoint}] if endpoint else []
    return [{"name": "HF_HUB_OFFLINE", "value": "1"}]


def init_containers(spec: PDClusterSpec) -> list[dict[str, Any]]:
    """A cache engine waits for the download Job's marker before vLLM starts."""
    if spec.model.source != ModelSource.cache:
        return []
    marker = f"{MODEL_MOUNT}/{cache_dir(spec)}/{COMPLETE_MARKER}"
    wait = (
        f"until [ -f '{marker}' ]; do echo 'waiting for the model cache to be filled'; "
        f"sleep {WAIT_SECONDS}; done"
    )
    return [
        {
            "name": "wait-for-model",
            "image": spec.engine.image,
            "imagePullPolicy": spec.engine.image_pull_policy,
            "command": ["sh", "-c", wait],
            "securityContext": {"allowPrivilegeEscalation": False},
            "volumeMounts": engine_mounts(spec),
        }
    ]


def cache_claim(spec: PDClusterSpec, owner: Owner) -> dict[str, Any]:
    cache = spec.model.cache
    assert cache is not None
    meta = metadata(owner, CACHE_ROLE)
    if cache.retain:
        # No owner: the garbage collector leaves it when the PDCluster goes.
        del meta["ownerReferences"]
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name:
        claim["storageClassName"] = cache.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim}


def _job_env(spec: PDClusterSpec) -> list[dict[str, Any]]:
    env = [
        {"name": "MODEL_NAME", "value": spec.model.name},
        {"name": "MODEL_REVISION", "value": revision(spec)},
        {"name": "MODEL_DIR", "value": f"{MODEL_MOUNT}/{cache_dir(spec)}"},
        {"name": "MODEL_MARKER", "value": COMPLETE_MARKER},
        {"name": "REPORT_FILE", "value": REPORT_PATH},
        # huggingface_hub's own files (tokens, caches) on the claim, not in the image's home.
        {"name": "HF_HOME", "value": f"{MODEL_MOUNT}/.huggingface"},
    ]
    if endpoint := hub_endpoint(spec):
        env.append({"name": "HF_ENDPOINT", "value": endpoint})
    if spec.engine.hf_token_secret is not None:
        env.append(env_secret("HF_TOKEN", spec.engine.hf_token_secret))
    return env


def download_job(spec: PDClusterSpec, owner: Owner) -> dict[str, Any]:
    container = {
        "name": "download",
        "image": _downloader_image(spec),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["python3", "-c", DOWNLOAD_SCRIPT],
        "env": _job_env(spec),
        "terminationMessagePath": REPORT_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False},
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT}],
    }
    pod = {
        # Never: each failed attempt keeps its pod, and with it the error it ended with.
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": [{"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": cache_claim_name(owner)}}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(owner, CACHE_ROLE, name=download_job_name(spec, owner)),
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "template": {"metadata": {"labels": labels(owner, CACHE_ROLE)}, "spec": pod},
        },
    }


def build_model(spec: PDClusterSpec, owner: Owner) -> list[dict[str, Any]]:
    """The cache claim and its download Job; nothing for the other sources."""
    if spec.model.source != ModelSource.cache:
        return []
    return [cache_claim(spec, owner), download_job(spec, owner)]
