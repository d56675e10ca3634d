"""Generated PDCluster specs against the real apiserver and operator: each is rejected with
a message naming a field, or accepted and reconciled without an exception in the
operator (a Degraded condition with a message is fine). Specs that once broke this are
kept in tests/fixtures/crashers/ and replayed. benchmarks/specs_property.py runs the same
check on 10,000 specs."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import OperatorProcess
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from specgen import check_spec, pdcluster, shape_name

from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster

CRASHERS = Path(__file__).resolve().parents[1] / "fixtures" / "crashers"
BATCH = 8  # reconciled concurrently by the one operator
serial = itertools.count()
seen: Counter[str] = Counter()


async def check_batch(
    kube: Kube, namespace: str, operator: OperatorProcess, docs: list[dict[str, Any]]
) -> None:
    outcomes = await asyncio.gather(*(check_spec(kube, namespace, doc) for doc in docs))
    for o in outcomes:
        seen["accepted" if o.accepted else "rejected"] += 1
        if o.accepted:
            seen[f"  {o.reason}"] += 1
    broken = [(o.name, o.problems) for o in outcomes if o.problems]
    assert not broken, broken
    assert operator.failures() == []


# No shrinking: each example costs seconds of a real cluster; the failing batch is printed whole.
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(batch=st.lists(pdcluster(), min_size=BATCH, max_size=BATCH))
async def test_generated_specs(
    kube: Kube, namespace: str, operator: OperatorProcess, batch: list[dict]
) -> None:
    for doc in batch:
        doc["metadata"]["name"] = shape_name(doc["metadata"]["name"], next(serial))
    await check_batch(kube, namespace, operator, batch)


def test_the_generated_specs_reached_both_outcomes() -> None:
    """The generator is worth its time only if it makes specs the schema refuses and
    specs the operator reconciles (runs after test_generated_specs, in file order)."""
    print("\ngenerated specs:", dict(seen))
    assert seen["accepted"] > 0 and seen["rejected"] > 0, dict(seen)


@pytest.mark.parametrize("path", sorted(CRASHERS.glob("*.yaml")), ids=lambda p: p.stem)
async def test_recorded_crashers(kube: Kube, namespace: str, operator: OperatorProcess, path: Path) -> None:
    """Each once broke the operator or could not be applied; now it is accepted and
    reconciled with nothing to report."""
    outcome = await check_spec(kube, namespace, yaml.safe_load(path.read_text()))
    assert outcome.accepted and not outcome.problems, outcome
    assert outcome.reason == "AsExpected", outcome.message
    assert operator.failures() == []
