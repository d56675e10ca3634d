"""SIGTERM while the operator reconciles many PDClusters: it starts no new reconcile, lets
those in flight finish (or cancels them after --shutdown-grace-seconds) and exits inside
the termination grace period its pod gets (Kubernetes' default, 30 s); the next operator
finishes the work."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from harness import start_operator

from localcluster import State
from pdcluster import constants as C
from pdcluster.controller import MAX_CONCURRENT_RECONCILES
from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster

CLUSTERS = 60
TERMINATION_GRACE_S = 30  # a pod's default terminationGracePeriodSeconds; the chart sets none


def _described(body: dict[str, Any]) -> bool:
    return (body.get("status") or {}).get("observedGeneration") == body["metadata"]["generation"]


async def test_sigterm_while_reconciling_many_pdclusters_exits_within_the_grace_period(
    kube: Kube,
    namespace: str,
    local_cluster: State,
    crd: None,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
    tmp_path: Path,
) -> None:
    # Suspended: every child is written, no pod starts; 60 of them keep 8 reconcile slots busy.
    for i in range(CLUSTERS):
        await pdc.apply(sim_cluster(f"load-{i}", suspend=True))
    log = tmp_path / "operator.log"
    op = start_operator(local_cluster.kubeconfig, namespace, log, "--shutdown-grace-seconds=10")
    writes = re.compile(rf" (?:Created|Updated) {re.escape(namespace)}/(load-\d+)-")
    try:
        await wait_until(
            lambda: len(writes.findall(op.log())) >= 20, timeout=120, message="reconciles under way"
        )
        pending = [b for b in await kube.list(C.API_VERSION, C.KIND, namespace) if not _described(b)]
        op.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(op.proc.wait, TERMINATION_GRACE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {TERMINATION_GRACE_S}s after SIGTERM:\n{op.log()[-3000:]}")
    finally:
        op.kill(signal.SIGKILL)
    assert pending, "every PDCluster was reconciled before SIGTERM: the stop proves nothing"
    assert code == 0, op.log()[-3000:]
    assert op.failures() == []
    text = op.log()
    assert "stopping: no new reconciles" in text
    after_stop = text[text.index("stopping: no new reconciles") :]
    # Only the reconciles in flight at the stop may still write; none starts after it.
    finishing = set(writes.findall(after_stop))
    assert len(finishing) <= MAX_CONCURRENT_RECONCILES, sorted(finishing)
    print(
        f"{len(pending)} of {CLUSTERS} PDClusters not yet reconciled at SIGTERM; {len(finishing)} finished after it"
    )

    # What was cut short is redone by the next operator.
    op = start_operator(local_cluster.kubeconfig, namespace, log)
    try:

        async def all_described() -> bool:
            return all(_described(b) for b in await kube.list(C.API_VERSION, C.KIND, namespace))

        await wait_until(all_described, timeout=240, interval=1, message="every PDCluster has a status")
        assert op.failures() == []
    finally:
        op.kill(signal.SIGTERM)
