"""The apiserver's verdict on what `pdctl bench` renders (server-side dry run, nothing
runs): the Job and its trace ConfigMap are valid objects, and the Job's pod is admitted
where the `restricted` Pod Security level is enforced. The client itself (AIPerf, 1.2 GB
installed) is too heavy for the tests: docs/benchmarking.md has the figures of a run."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from pdcluster import bench
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.io.kube import Kube
from pdcluster.render import Owner

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
TRACE = "\n".join(
    json.dumps({"timestamp": 50 * k, "input_length": 700, "output_length": 30}) for k in range(4)
)


@pytest.fixture
async def restricted(kube: Kube) -> AsyncIterator[str]:
    name = f"bench-{uuid.uuid4().hex[:6]}"
    labels = {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
    yield name
    await kube.delete("v1", "Namespace", name)


CACHED = bench.BenchOptions(tokenizer="meta-llama/Llama-3.1-8B-Instruct", tokenizer_claim="model-cache")


@pytest.mark.parametrize(
    ("trace", "opts"),
    [(None, bench.BenchOptions(tokenizer="builtin")), (TRACE, CACHED)],
    ids=["synthetic", "trace-from-a-cache-claim"],
)
async def test_the_bench_job_validates_against_the_apiserver(
    kube: Kube, restricted: str, trace: str | None, opts: bench.BenchOptions
) -> None:
    raw = yaml.safe_load((ROOT / "examples" / "pdcluster-sim.yaml").read_text())["spec"]
    raw["router"] = {**raw.get("router", {}), "apiKeySecret": {"name": "router-key", "key": "token"}}
    spec = PDClusterSpec.model_validate(raw)
    objs = bench.render(spec, Owner("demo", restricted, ""), opts, trace)
    for obj in objs:
        applied = await kube.apply(obj, field_manager="pdctl-bench-test", dry_run=True)
        assert applied["metadata"]["name"] == obj["metadata"]["name"]
    job = objs[-1]
    template = copy.deepcopy(job["spec"]["template"])
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": "bench-check", "namespace": restricted},
        "spec": template["spec"],
    }
    admitted = await kube.create(pod, dry_run=True)  # refused with a 403 if it broke `restricted`
    assert admitted["spec"]["containers"][0]["args"][0] == "profile"
