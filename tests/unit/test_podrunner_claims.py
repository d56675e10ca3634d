"""The pod runner's PersistentVolumeClaims (a bound claim is its PV's host directory) and
termination messages (the file at terminationMessagePath, read through the container's
mounts; the log's tail for a failure that wrote none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fakekube import FakeKube

from localcluster.podrunner import volumes


def claim(phase: str, volume: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "weights", "namespace": "ns"},
        "spec": {"volumeName": volume} if volume else {}, "status": {"phase": phase},
    }  # fmt: skip


def pod() -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": "weights"}}]},
    }


async def test_a_bound_claim_is_its_volumes_host_directory(tmp_path: Path) -> None:
    kube = FakeKube()
    kube.put(claim("Bound", "pv-1"))
    kube.put({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pv-1"},
              "spec": {"hostPath": {"path": str(tmp_path / "pv-1"), "type": "DirectoryOrCreate"}}})  # fmt: skip
    paths = await volumes.prepare(kube, pod(), tmp_path / "volumes", tmp_path / "memory", {})  # type: ignore[arg-type]
    assert paths == {"model": tmp_path / "pv-1"} and paths["model"].is_dir()


@pytest.mark.parametrize("stored", [None, claim("Pending", None)], ids=["missing", "pending"])
async def test_a_claim_not_bound_is_a_mount_to_retry(tmp_path: Path, stored: dict[str, Any] | None) -> None:
    kube = FakeKube()
    if stored:
        kube.put(stored)
    with pytest.raises(volumes.VolumeError, match="weights"):
        await volumes.prepare(kube, pod(), tmp_path / "volumes", tmp_path / "memory", {})  # type: ignore[arg-type]


def test_the_termination_message_is_read_through_the_mounts(tmp_path: Path) -> None:
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    (private_tmp / "report").write_text('{"bytes": 5}')
    log = tmp_path / "c.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    mounts = volumes.with_private_dirs([], tmp=private_tmp, shm=tmp_path / "shm")
    spec = {"terminationMessagePath": "/tmp/report", "terminationMessagePolicy": "FallbackToLogsOnError"}
    assert volumes.termination_message(spec, mounts, 0, log) == '{"bytes": 5}'
    (private_tmp / "report").unlink()
    assert volumes.termination_message(spec, mounts, 0, log) == ""  # success: never the log
    tail = volumes.termination_message(spec, mounts, 1, log)
    assert tail.splitlines() == [f"line {i}" for i in range(20, 100)]
    assert volumes.termination_message({**spec, "terminationMessagePolicy": "File"}, mounts, 1, log) == ""
