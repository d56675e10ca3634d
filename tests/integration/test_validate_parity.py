"""`pdctl validate` (offline: schema, CEL rules, name, apiVersion) against the apiserver's
own verdict, a server-side dry-run apply, on generated specs (tests/e2e/specgen.py):
the same verdict every time."""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from specgen import pdcluster, shape_name

from pdcluster.api.validate import problems
from pdcluster.io.kube import ApiError, Kube

pytestmark = pytest.mark.cluster

BATCH = 10
serial = itertools.count()
verdicts: Counter[str] = Counter()


async def server_accepts(kube: Kube, doc: dict) -> tuple[bool, str]:
    try:
        await kube.apply(doc, field_manager="pdctl-validate-parity", dry_run=True)
    except ApiError as e:
        # A value of the wrong type fails server-side apply before validation: a 500
        # "failed to create typed patch object", which is a refusal all the same.
        typed = e.status == 500 and "failed to create typed patch object" in e.message
        if e.status not in (400, 422) and not typed:
            raise
        return False, e.message
    return True, ""


# 30 batches of 10: 300 specs, a dry-run each (milliseconds; no object is stored).
# Derandomized, so every run checks the same specs (runs with fresh draws agreed too).
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate], derandomize=True)
@given(batch=st.lists(pdcluster(), min_size=BATCH, max_size=BATCH))
async def test_pdctl_validate_agrees_with_the_apiserver(kube: Kube, namespace: str, crd: None, batch) -> None:
    for doc in batch:
        doc["metadata"] = {"name": shape_name(doc["metadata"]["name"], next(serial)), "namespace": namespace}
        accepted, message = await server_accepts(kube, doc)
        offline = problems(doc)
        verdicts["accepted" if accepted else "rejected"] += 1
        assert accepted == (not offline), f"server: {message or 'accepted'}\noffline: {offline}\nspec: {doc['spec']}"


def test_both_verdicts_were_seen() -> None:
    """The comparison means something only if the specs reached both verdicts (runs after
    the test above, in file order)."""
    print("\nverdicts:", dict(verdicts))
    assert verdicts["accepted"] > 0 and verdicts["rejected"] > 0, dict(verdicts)


def test_pdctl_validate_server_is_a_dry_run(local_cluster, crd: None, namespace: str, tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "pdcluster-sim.yaml"
    broken = copy.deepcopy(yaml.safe_load(example.read_text()))
    broken["spec"]["prefill"]["replicas"] = 99  # over maxReplicas: a CEL rule
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    pdctl = [sys.executable, "-m", "pdcluster.cli", "validate", "--server", "--kubeconfig", local_cluster.kubeconfig,
             "-n", namespace]
    ok = subprocess.run([*pdctl, "-f", str(example)], capture_output=True, text=True)
    assert (ok.returncode, ok.stdout) == (0, "demo: valid (server dry-run)\n"), ok.stderr
    refused = subprocess.run([*pdctl, "-f", str(tmp_path / "broken.yaml")], capture_output=True, text=True)
    assert refused.returncode == 1 and "replicas must be <= maxReplicas" in refused.stderr, refused.stderr
