"""Where things live: the repository, the binary cache, each cluster's run directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

LOCAL_DIR = Path(__file__).resolve().parent.parent  # e2e/local
REPO_ROOT = LOCAL_DIR.parent.parent
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")


def versions() -> dict[str, str]:
    """The pins in versions.env (shared with build.sh)."""
    pins = {}
    for line in (LOCAL_DIR / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pins[key] = value
    return pins


def cache_dir() -> Path:
    return Path(os.environ.get("PDCLUSTER_CACHE") or Path.home() / ".cache" / "pdcluster")


def run_dir(name: str) -> Path:
    """PDCLUSTER_RUN_DIR replaces <cache>/run; each cluster gets <that>/<name>."""
    base = os.environ.get("PDCLUSTER_RUN_DIR") or cache_dir() / "run"
    return Path(base) / name


def memory_dir(name: str) -> Path:
    """Backing store of the cluster's emptyDir volumes with medium: Memory (tmpfs)."""
    return Path("/dev/shm/pdcluster") / name


def bin_dir() -> Path:
    """The cached binaries; builds them with build.sh when any is missing."""
    v = versions()
    name = (
        f"k8s-v{v['KUBERNETES_VERSION']}-etcd-v{v['ETCD_VERSION']}"
        f"-kwok-{v['KWOK_VERSION']}-helm-{v['HELM_VERSION']}"
    )
    path = cache_dir() / "bin" / name
    if (
        all(os.access(path / b, os.X_OK) for b in BINARIES)
        and lws_dir(path).is_dir()
        and os.access(otelcol_binary(path), os.X_OK)
        and os.access(kstatus_binary(path), os.X_OK)
    ):
        return path
    out = subprocess.run([str(LOCAL_DIR / "build.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def lws_dir(bins: Path) -> Path:
    """The LeaderWorkerSet controller, its CRDs and webhook manifests (build.sh)."""
    return bins / f"lws-{versions()['LWS_VERSION']}"


def otelcol_binary(bins: Path) -> Path:
    """The minimal OpenTelemetry Collector (gomod/otelcol, built by build.sh)."""
    return bins / f"otelcol-{versions()['OTELCOL_VERSION']}" / "otelcol"


def kstatus_binary(bins: Path) -> Path:
    """kstatus's verdict on one object, JSON in and out (gomod/kstatus, built by build.sh)."""
    return bins / f"kstatus-{versions()['KSTATUS_VERSION']}" / "kstatus"
