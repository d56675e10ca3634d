"""Every fault at once, under load, for two minutes (benchmarks/chaos.py runs the same for
twenty): streamed and whole completions through the router while a seeded schedule
SIGKILLs and deletes engine pods of both roles, deletes a router pod, SIGKILLs the
operator and the Mooncake master, stops Prometheus for a minute and restarts the
apiserver, overlapping; the autoscaler runs throughout. No request is lost or answered
twice, save those that came while a role had no engine at all (a clear 503); the
operator logs no traceback; at the end the cluster is as its spec renders, no orphans."""

from __future__ import annotations

from pathlib import Path

import pytest
from chaosfaults import KINDS, run_chaos

from localcluster import State
from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster

SEED = 31
DURATION_S = 120


async def test_chaos_under_load(
    kube: Kube, namespace: str, local_cluster: State, crd: None, tmp_path: Path
) -> None:
    run = await run_chaos(
        kube, local_cluster, namespace, "chaos", tmp_path / "operator.log", seed=SEED, duration=DURATION_S
    )
    print(*run.lines(), sep="\n")
    v = run.verdicts
    # Each kind of fault landed (none skipped for want of a target, none refused).
    assert sorted(i.fault.kind for i in run.injected) == sorted(KINDS)
    missed = [i.target for i in run.injected if i.target.startswith(("no ready", "not injected"))]
    assert not missed, missed
    assert 0 < v.streamed < v.sent, "streamed and whole completions both"
    assert v.whole > 0 and v.sent == v.whole + v.no_engine + v.lost + v.duplicated
    assert v.lost == 0, v.line()
    assert v.duplicated == 0 and v.tokens_lost == 0, v.line()
    assert run.tracebacks == [], run.tracebacks[:3]
    assert run.operator_restarts == 1
    # One decision every 5 s when the operator is up: it kept deciding through the faults.
    assert run.autoscaler_decisions >= 5, "the autoscaler did not keep running"
    assert run.final_problems == []
