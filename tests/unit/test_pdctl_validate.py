"""pdctl validate gives the apiserver's verdict offline: the schema, the CRD's CEL rules,
apiVersion, kind and name; and a clean line, not a traceback, for a file it cannot read.
tests/integration/test_validate_parity.py compares it with a server-side dry-run."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pdcluster import cli
from pdcluster.api.validate import problems

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BASE = next(d for d in yaml.safe_load_all((EXAMPLES / "pdcluster-sim.yaml").read_text()) if d)


def changed(**paths) -> dict:
    doc = copy.deepcopy(BASE)
    for path, value in paths.items():
        node = doc
        *parents, last = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return doc


def test_every_example_is_valid():
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "PDCluster":
                assert problems(doc) == [], path.name


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (changed(spec__prefill__replicas=9), "spec.prefill.replicas"),  # over maxReplicas (CEL)
        (changed(spec__prefill__tensorParallelSize=3, spec__prefill__gpusPerPod=2), "spec.prefill.gpusPerPod"),
        (changed(spec__prefill__tensorParallelSize=3, spec__decode__tensorParallelSize=2), "spec.prefill.tensorParallelSize"),
        (changed(spec__mooncake={"store": {"enabled": True, "engineBufferSize": "0"}}), "spec.mooncake.store"),
        (changed(metadata={"name": "x" * 41}), "<object>: metadata.name"),  # the CRD's root rule
        (changed(metadata={"name": "Demo"}), "metadata.name"),
        (changed(apiVersion="pdcluster.io/v1"), "apiVersion"),
        (changed(spec__prefill__replicas="two"), "spec.prefill.replicas"),
    ],
)
def test_what_the_apiserver_refuses_is_refused_naming_the_field(doc, field):
    found = problems(doc)
    assert found, doc
    assert any(p.startswith(field) for p in found), found


def test_unreadable_input_is_one_clean_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["validate", "-f", str(bad)])
    assert str(e.value).startswith(f"pdctl: {bad}: not YAML (line 2)")
    with pytest.raises(SystemExit) as e:
        cli.main(["validate", "-f", str(tmp_path / "missing.yaml")])
    assert str(e.value).endswith("missing.yaml: No such file or directory")
    other = tmp_path / "v1.yaml"
    other.write_text(yaml.safe_dump(changed(apiVersion="pdcluster.io/v1")))
    with pytest.raises(SystemExit) as e:
        cli.main(["validate", "-f", str(other)])
    assert "apiVersion must be pdcluster.io/v1alpha1" in str(e.value)


def test_the_exit_status_says_whether_every_cluster_is_valid(tmp_path, capsys):
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump_all([BASE, changed(metadata={"name": "other"}, spec__decode__replicas=0)]))
    assert cli.main(["validate", "-f", str(both)]) == 1
    out = capsys.readouterr()
    assert out.out == f"{BASE['metadata']['name']}: valid\n"
    assert "spec.decode" in out.err
    assert cli.main(["validate", "-f", str(EXAMPLES / "pdcluster-sim.yaml")]) == 0
