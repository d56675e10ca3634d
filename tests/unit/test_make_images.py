"""`make images` builds and pushes every image in images/ under the names the chart's
values take, and prints those values: a container tool that records its arguments
stands in for docker or podman (no engine runs here; tests/unit/test_images.py lints the
Dockerfiles), and helm renders the chart with the printed values."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_chart_render import CHART, template

from pdcluster import images

ROOT = Path(__file__).resolve().parents[2]
IMAGES = sorted(p.parent.name for p in (ROOT / "images").glob("*/Dockerfile"))
REGISTRY, TAG = "registry.test/team", "9.9.9"
# The operator's environment variable for each image of values.images.
ENV = {
    "router": "PDCLUSTER_ROUTER_IMAGE",
    "mooncake": "PDCLUSTER_MOONCAKE_IMAGE",
    "engine": "PDCLUSTER_ENGINE_IMAGE",
    "engineSim": "PDCLUSTER_ENGINE_SIM_IMAGE",
}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_images(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    log = tmp_path / "calls"
    tool = tmp_path / "container"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    tool.chmod(0o755)
    result = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "images", f"CONTAINER={tool}", *args],
        capture_output=True,
        text=True,
    )
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def test_every_image_is_built_and_pushed(tmp_path: Path) -> None:
    result, calls = make_images(tmp_path, f"REGISTRY={REGISTRY}", f"TAG={TAG}")
    assert result.returncode == 0, result.stderr
    builds = {c[c.index("-f") + 1]: c for c in calls if c[0] == "build"}
    assert set(builds) == {f"images/{name}/Dockerfile" for name in IMAGES}
    for name in IMAGES:
        build = builds[f"images/{name}/Dockerfile"]
        assert build[build.index("-t") + 1] == f"{REGISTRY}/{name}:{TAG}"
        assert f"VERSION={TAG}" in build and build[-1] == "."  # the repository root as context
    assert sorted(c[1] for c in calls if c[0] == "push") == sorted(f"{REGISTRY}/{n}:{TAG}" for n in IMAGES)


def test_without_push_nothing_is_pushed(tmp_path: Path) -> None:
    result, calls = make_images(tmp_path, f"REGISTRY={REGISTRY}", "PUSH=0")
    assert result.returncode == 0, result.stderr
    assert [c[0] for c in calls] == ["build"] * len(IMAGES)


def test_a_registry_is_required(tmp_path: Path) -> None:
    result, calls = make_images(tmp_path)
    assert result.returncode != 0 and "set REGISTRY=" in result.stderr
    assert calls == []


def test_the_printed_values_point_the_chart_at_every_pushed_image(tmp_path: Path) -> None:
    result, _ = make_images(tmp_path, f"REGISTRY={REGISTRY}", f"TAG={TAG}", "PUSH=0")
    words = shlex.split(result.stdout)
    args = [x for i, w in enumerate(words) if w == "--set" for x in ("--set", words[i + 1])]
    assert len(args) == 2 * len(IMAGES)
    out = template(*args)
    assert out.returncode == 0, out.stderr
    deployment = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    pushed = {f"{REGISTRY}/{n}:{TAG}" for n in IMAGES}
    named = {container["image"], *(env[v] for v in ENV.values())}
    assert named == pushed, "the chart and `make images` disagree on the images"


def test_the_chart_names_every_image_the_operator_renders() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values["images"]) - {"pullSecrets"} == set(ENV)
    camel = {re.sub(r"-(\w)", lambda m: m.group(1).upper(), kind) for kind in images.BUILT_IN}
    assert camel == set(ENV)
