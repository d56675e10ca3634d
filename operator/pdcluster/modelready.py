"""Pure: the model cache's download Job, and the pods it ran, in; the ModelReady
condition and `status.model` out.

The Job's container writes a JSON report (bytes, files, milliseconds) as its termination
message; a failed attempt's message is the tail of its log (render/model.py). Pods are
read only when the Job has news the previous status does not hold (`needs_pods`).
"""

from __future__ import annotations

import json
from typing import Any

from pdcluster.api.v1alpha1 import ModelStatus

ConditionFields = tuple[bool, str, str]
ERROR_CHARS = 1000  # enough for a traceback's last lines, short enough for a condition


def _job_condition(job: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


def _failed(job: dict[str, Any]) -> int:
    return int((job.get("status") or {}).get("failed", 0))


def needs_pods(job: dict[str, Any] | None, previous: ModelStatus | None) -> bool:
    """Whether the Job's pods say something the previous status lacks."""
    if job is None:
        return False
    known = previous if previous is not None and previous.job == job["metadata"]["name"] else None
    if _job_condition(job, "Complete"):
        return known is None or known.bytes is None
    return _failed(job) > 0 and (known is None or known.failed_attempts != _failed(job))


def _terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    for s in (pod.get("status") or {}).get("containerStatuses") or []:
        if "terminated" in (s.get("state") or {}):
            return s["state"]["terminated"]
    return None


def _report(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    for pod in pods:
        ended = _terminated(pod)
        if ended is None or ended.get("exitCode") != 0:
            continue
        try:
            report = json.loads(ended.get("message") or "")
        except ValueError:
            continue
        if isinstance(report, dict) and isinstance(report.get("bytes"), int):
            return report
    return None


def _last_error(pods: list[dict[str, Any]]) -> str | None:
    ended = [t for pod in pods if (t := _terminated(pod)) is not None and t.get("exitCode") != 0]
    if not ended:
        return None
    last = max(ended, key=lambda t: t.get("finishedAt") or "")
    message = (last.get("message") or "").strip() or f"exit code {last.get('exitCode')}"
    return message[-ERROR_CHARS:]


def size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def observe(
    job_name: str, job: dict[str, Any] | None, pods: list[dict[str, Any]] | None, previous: ModelStatus | None
) -> tuple[ConditionFields, ModelStatus]:
    """The ModelReady condition and status.model. `pods`: the Job's pods when
    `needs_pods` asked for them, else None (the previous status still holds)."""
    known = previous if previous is not None and previous.job == job_name else ModelStatus(job=job_name)
    if job is None:
        return (False, "CachePending", f"download Job {job_name} not created yet"), known
    if pods is not None:
        report = _report(pods) or {}
        known = known.model_copy(
            update={
                "bytes": report.get("bytes", known.bytes),
                "files": report.get("files", known.files),
                "download_ms": report.get("ms", known.download_ms),
                "failed_attempts": _failed(job),
                "error": _last_error(pods) or known.error,
            }
        )
    if _job_condition(job, "Complete"):
        if known.bytes is None:
            return (True, "Downloaded", f"Job {job_name} succeeded; it reported no size"), known
        took = f" in {known.download_ms / 1000:.1f} s" if known.download_ms is not None else ""
        files = f"{known.files} files, " if known.files is not None else ""
        return (True, "Downloaded", f"{files}{size(known.bytes)} ({known.bytes} bytes){took} by Job {job_name}"), known
    failed = _job_condition(job, "Failed")
    if failed is not None:
        why = failed.get("reason") or "Failed"
        return (False, "DownloadFailed", f"Job {job_name} failed ({why}): {known.error or 'no message'}"), known
    if _failed(job):
        return (
            False,
            "Downloading",
            f"Job {job_name} retrying after {_failed(job)} failed attempt(s); last: {known.error or 'no message'}",
        ), known
    return (False, "Downloading", f"Job {job_name} is downloading the model"), known
