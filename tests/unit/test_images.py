"""Images cannot be built here (no Docker engine): lint them with hadolint and check the
conventions we rely on, including that they run the same entry points as the tests."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# Our images run as an unprivileged user; the vLLM engine keeps its base image's root
# because GPU and RDMA device access expects it (docs/reliability.md lists why).
ROOT_ALLOWED = {"engine"}
THIRD_PARTY_ENTRYPOINTS = {"engine": "vllm", "mooncake": "mooncake_master"}


def test_every_image_is_here() -> None:
    assert {p.parent.name for p in DOCKERFILES} == {"operator", "router", "engine-sim", "engine", "mooncake"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(__file__).resolve().parents[2] / ".venv/bin/hadolint")
    result = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(dockerfile)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_conventions(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    name = dockerfile.parent.name
    bases = re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.M)
    assert bases and all(":" in b and not b.endswith(":latest") for b in bases), "base images must be pinned"
    for label in ("title", "description", "version", "licenses"):
        assert f"org.opencontainers.image.{label}=" in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    if name in ROOT_ALLOWED:
        assert not users
    else:
        assert users and users[-1].split(":")[0] not in ("0", "root")
    entry = re.search(r'^ENTRYPOINT \["([^"]+)"', text, re.M).group(1)
    if name in THIRD_PARTY_ENTRYPOINTS:
        assert entry == THIRD_PARTY_ENTRYPOINTS[name]
    else:
        assert entry in SCRIPTS, f"{entry} is not a console script of this distribution"
        assert SCRIPTS[entry].startswith("pdcluster.")
