"""Every console script answers --version, and the operator's and the router's metrics
say which build runs (pdcluster_build_info)."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest

from pdcluster import __version__
from pdcluster import observability as O

SCRIPTS = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize(("script", "entry"), sorted(SCRIPTS.items()))
def test_every_console_script_says_its_version(script, entry, capsys):
    module, _, function = entry.partition(":")
    main = getattr(importlib.import_module(module), function)
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code in (0, None)
    assert capsys.readouterr().out.strip() == f"{script} {__version__}"


def build_info(exposition: bytes) -> list[str]:
    return [line for line in exposition.decode().splitlines() if line.startswith(O.BUILD_INFO + "{")]


def test_the_operator_and_the_router_expose_their_build():
    import pdcluster.metrics  # noqa: F401  (registers the operator's metrics)
    from pdcluster.router.metrics import RouterMetrics

    assert build_info(generate_latest(REGISTRY)) == [
        f'{O.BUILD_INFO}{{component="operator",version="{__version__}"}} 1.0'
    ]
    router = RouterMetrics(lambda: ([], {}))
    assert build_info(generate_latest(router.registry)) == [
        f'{O.BUILD_INFO}{{component="router",version="{__version__}"}} 1.0'
    ]
