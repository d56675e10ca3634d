"""The images the operator renders where a PDCluster names none, and the pull secrets of
the pods it renders where a PDCluster names none.

The chart sets them (values `images.*` and `images.pullSecrets`) through the operator's
flags, so one registry serves every image and an upgrade of the chart moves every
cluster that did not pin an image. The CRD therefore carries no default for these
fields: a stored PDCluster leaves them out and the operator fills them in when it reads
the spec. Without flags (pdctl, tests) the built-in defaults below apply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdcluster import __version__
from pdcluster import constants as C

ENGINE = "engine"
ENGINE_SIM = "engine-sim"
ROUTER = "router"
MOONCAKE = "mooncake"

BUILT_IN: Mapping[str, str] = {
    ENGINE: "vllm/vllm-openai:v0.32.0",
    ENGINE_SIM: f"{C.IMAGE_REPOSITORY}/engine-sim:{__version__}",
    ROUTER: C.DEFAULT_ROUTER_IMAGE,
    MOONCAKE: C.DEFAULT_MOONCAKE_IMAGE,
}
# The simulator's entry point: an engine that runs it gets the simulator's image by default.
ENGINE_SIM_COMMAND = "pdcluster-engine-sim"

_images: dict[str, str] = dict(BUILT_IN)
_pull_secrets: list[str] = []


def configure(images: Mapping[str, str | None], pull_secrets: Sequence[str] = ()) -> None:
    """The operator's defaults, from its flags; an image left None keeps the built-in one."""
    unknown = set(images) - set(BUILT_IN)
    if unknown:
        raise ValueError(f"no such image: {', '.join(sorted(unknown))}")
    _images.clear()
    _images.update(BUILT_IN)
    _images.update({kind: image for kind, image in images.items() if image})
    _pull_secrets[:] = [name for name in pull_secrets if name]


def default(kind: str) -> str:
    return _images[kind]


def pull_secrets() -> list[str]:
    return list(_pull_secrets)


def factory(kind: str) -> Callable[[], str]:
    """A pydantic default_factory: the operator's default at the time a spec is read."""
    return lambda: _images[kind]


def is_default(kind: str) -> Callable[[Any], bool]:
    """A pydantic exclude_if: the default is left out of `wire()`, and so out of the
    CRD's defaults for the sections that hold an image."""
    return lambda value: value == _images[kind]
