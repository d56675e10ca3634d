"""Images and pull secrets a PDCluster does not name come from the operator's flags (the
chart's values): the CRD pins none, a spec's own win, and every pod the operator renders,
of every workload kind, pulls with the same secrets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdcluster import images
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.main import configure_images, parse_args
from pdcluster.render import Owner, Replicas, pod_specs, render_all

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "pdcluster.io_pdclusters.yaml").read_text())
SPEC = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
OWNER = Owner("demo", "serving", "uid-1")


@pytest.fixture(autouse=True)
def built_in() -> Iterator[None]:
    yield
    images.configure({})


def rendered(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = PDClusterSpec.model_validate(doc)
    return render_all(spec, OWNER, Replicas.choose(spec, None))


def containers(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Container name (with its object's) -> image."""
    return {
        f"{o['metadata']['name']}/{c['name']}": c["image"]
        for o in objects
        for pod in pod_specs(o)
        for c in pod.get("initContainers", []) + pod["containers"]
    }


def test_the_crd_pins_no_image() -> None:
    for section in ("engine", "router", "mooncake"):
        assert "default" not in SPEC["properties"][section]["properties"]["image"]
        assert "image" not in SPEC["properties"][section]["default"]
    assert "default" not in SPEC["properties"]["imagePullSecrets"]


def test_the_operators_flags_set_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_ROUTER_IMAGE", "mirror/router:1")
    monkeypatch.setenv("PDCLUSTER_IMAGE_PULL_SECRETS", "regcred,other")
    configure_images(parse_args(["--mooncake-image=mirror/mooncake:1", "--engine-image=mirror/engine:1"]))
    images_by_container = containers(rendered({"model": {"name": "m"}, "mooncake": {"store": {"enabled": True}}}))
    assert set(images_by_container.values()) == {"mirror/router:1", "mirror/mooncake:1", "mirror/engine:1"}
    assert images_by_container["demo-router/router"] == "mirror/router:1"
    assert images_by_container["demo-mooncake-master/master"] == "mirror/mooncake:1"


def test_a_spec_names_its_own() -> None:
    images.configure({images.ROUTER: "mirror/router:1"}, ["regcred"])
    doc = {"model": {"name": "m"}, "router": {"image": "mine/router:2"}, "imagePullSecrets": []}
    objects = rendered(doc)
    assert containers(objects)["demo-router/router"] == "mine/router:2"
    assert not any("imagePullSecrets" in pod for o in objects for pod in pod_specs(o))


def test_the_simulator_command_gets_the_simulator_image() -> None:
    images.configure({images.ENGINE_SIM: "mirror/engine-sim:1"})
    spec = PDClusterSpec.model_validate(
        {"model": {"name": "m"}, "engine": {"command": ["pdcluster-engine-sim", "serve"]}}
    )
    assert spec.engine.image == "mirror/engine-sim:1"
    assert PDClusterSpec.model_validate({"model": {"name": "m"}}).engine.image == images.BUILT_IN[images.ENGINE]


@pytest.mark.parametrize("example", ["pdcluster-multinode.yaml", "pdcluster-flexible.yaml", "pdcluster-sim.yaml"])
def test_every_pod_of_every_kind_pulls_with_the_secrets(example: str) -> None:
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())["spec"]
    objects = rendered({**doc, "imagePullSecrets": [{"name": "regcred"}]})
    pods = [(o["kind"], pod) for o in objects for pod in pod_specs(o)]
    assert {kind for kind, _ in pods} >= {"Deployment"}
    for kind, pod in pods:
        assert pod["imagePullSecrets"] == [{"name": "regcred"}], kind
    if example == "pdcluster-multinode.yaml":
        assert sum(kind == "LeaderWorkerSet" for kind, _ in pods) == 2 * sum(
            o["kind"] == "LeaderWorkerSet" for o in objects
        )  # its leader and its workers


def test_an_unknown_image_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="no such image: operator"):
        images.configure({"operator": "x"})
