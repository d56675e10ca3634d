"""Each image installs the wheel with one extra (images/*/Dockerfile): every library its
console script can import, at start or later, must come from the base dependencies or
that extra, or the image fails where the tests (which install everything) pass."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "operator"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Console script -> (its extra, libraries it imports only for an optional feature).
EXTRA_OF_SCRIPT = {
    "pdcluster-operator": ("operator", set()),
    "pdcluster-router": ("router", set()),
    "pdcluster-engine-sim": ("enginesim", {"mooncake"}),  # the store client: Mooncake's wheel
    "pdctl": ("pdctl", {"matplotlib"}),  # --plot: the `plot` extra
}


def _module_file(name: str) -> Path | None:
    base = SOURCE.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_names(name: str, path: Path) -> set[str]:
    """Every module an import statement of the file names, wherever the statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def third_party_imports(entry_module: str) -> set[str]:
    """Top-level names of the libraries outside the standard library that `entry_module`
    and the project modules it imports import."""
    seen: set[str] = set()
    libraries: set[str] = set()
    todo = [entry_module]
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        for imported in _imported_names(name, path):
            top = imported.split(".")[0]
            if top == "pdcluster":
                parts = imported.split(".")
                todo += [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
            elif top not in sys.stdlib_module_names and top != "__future__":
                libraries.add(top)
    return libraries


def installed_by(extra: str) -> set[str]:
    """Distributions the base dependencies and `extra` bring, following the extras of
    this project that `extra` names, and theirs."""
    own = canonicalize_name(PROJECT["name"])
    names = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    wanted, done = [extra], set()
    while wanted:
        current = wanted.pop()
        if current in done:
            continue
        done.add(current)
        for text in PROJECT["optional-dependencies"][current]:
            r = Requirement(text)
            if canonicalize_name(r.name) == own:
                wanted += sorted(r.extras)
            else:
                names.add(canonicalize_name(r.name))
    return with_their_dependencies(names)


def with_their_dependencies(names: set[str]) -> set[str]:
    """`names` and what installing them installs (as their installed metadata says)."""
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        try:
            declared = requires(name) or []
        except PackageNotFoundError:
            continue
        for text in declared:
            r = Requirement(text)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(r.name))
    return out


def distributions_imported(entry_module: str, optional: set[str] = frozenset()) -> set[str]:
    """The distributions (as installed here: the test extra holds them all) that provide
    what `entry_module` imports, less the `optional` libraries."""
    providers = packages_distributions()
    libraries = third_party_imports(entry_module) - optional
    unknown = {top for top in libraries if top not in providers}
    assert not unknown, f"{entry_module} imports {unknown}, which nothing installed provides"
    return {canonicalize_name(providers[top][0]) for top in libraries}


@pytest.mark.parametrize("script", sorted(EXTRA_OF_SCRIPT))
def test_a_console_script_needs_only_its_extra(script: str) -> None:
    extra, optional = EXTRA_OF_SCRIPT[script]
    entry_module = PROJECT["scripts"][script].partition(":")[0]
    outside = distributions_imported(entry_module, optional) - installed_by(extra)
    assert not outside, f"{script} imports {outside}, which [{extra}] does not install"


def test_the_base_dependencies_are_what_every_image_runs() -> None:
    entries = ("pdcluster.main", "pdcluster.router.main", "pdcluster.enginesim.main")
    common = set.intersection(*(distributions_imported(m, {"mooncake"}) for m in entries))
    base = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert base <= common and common <= with_their_dependencies(base)
