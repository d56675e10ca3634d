"""The demo's workload is the trace's: arrival times scaled per phase, prompt lengths,
shared prefixes where the trace's block hashes are equal, output lengths."""

from __future__ import annotations

import argparse
import itertools

import pytest

from pdcluster.sim.trace import Trace, TraceError
from pddemo import workload


def trace(n: int = 100) -> Trace:
    return Trace(
        "t",
        [float(i) for i in range(n)],
        [1000 + i for i in range(n)],
        [10 + i for i in range(n)],
        [(1, 2, 3 + i) for i in range(n)],
    )


def test_phases_scale_time_and_keep_order() -> None:
    requests = workload.workload(trace(), 0.0, [(10, 1.0), (10, 2.0)])
    assert len(requests) == 30  # 10 s of the trace, then 20 s of it in 10 s
    assert [r.at_s for r in requests[:3]] == [0.0, 1.0, 2.0]
    assert [r.at_s for r in requests[10:13]] == [10.0, 10.5, 11.0]
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(requests))
    assert max(r.at_s for r in requests) < 20
    # Lengths travel with their request.
    assert (requests[12].input_tokens, requests[12].output_tokens) == (1012, 22)


def test_start_skips_into_the_trace() -> None:
    requests = workload.workload(trace(), 50.0, [(5, 1.0)])
    assert [r.input_tokens for r in requests] == [1050, 1051, 1052, 1053, 1054]
    assert requests[0].at_s == 0.0


def test_prompts_share_exactly_the_prefix_the_trace_shares() -> None:
    a = workload.Request(0, 1300, 1, (7, 8, 9), salt=1)
    b = workload.Request(0, 1300, 1, (7, 8, 10), salt=2)
    ids_a, ids_b = workload.prompt_ids(a), workload.prompt_ids(b)
    assert len(ids_a) == len(ids_b) == 1300
    assert ids_a[:1024] == ids_b[:1024]  # blocks 7 and 8: 2 x 512 tokens
    assert ids_a[1024:] != ids_b[1024:]  # the partial third block differs
    assert all(0 < t < workload.VOCABULARY for t in ids_a)


def test_prompts_longer_than_their_blocks_get_private_filler() -> None:
    a = workload.Request(0, 700, 1, (7,), salt=1)
    b = workload.Request(0, 700, 1, (7,), salt=2)
    ids_a, ids_b = workload.prompt_ids(a), workload.prompt_ids(b)
    assert len(ids_a) == 700 and ids_a[:512] == ids_b[:512] and ids_a[512:] != ids_b[512:]
    assert len(workload.prompt_ids(workload.Request(0, 300, 1, (), salt=3))) == 300


def test_parse_phases() -> None:
    assert workload.parse_phases("60:1,150:3,150:0.7") == [
        workload.Phase(60.0, 1.0),
        workload.Phase(150.0, 3.0),
        workload.Phase(150.0, 0.7),
    ]
    assert workload.parse_phases("180:6:azure*3") == [workload.Phase(180.0, 6.0, "azure", 3.0)]
    for bad in ("60:0", "60:1:nowhere", "60:1:azure*0", "x:1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            workload.parse_phases(bad)


def test_a_phase_switches_traces_and_each_resumes_where_it_stopped() -> None:
    other = Trace("b", [float(t) for t in range(100)], [5] * 100, [10] * 100, [() for _ in range(100)])
    phases = [workload.Phase(10, 1.0), workload.Phase(10, 1.0, "b", 3.0), workload.Phase(10, 1.0)]
    requests = workload.workload({None: trace(), "b": other}, 0.0, phases)
    assert [r.input_tokens for r in requests[:10]] == list(range(1000, 1010))
    assert {(r.input_tokens, r.output_tokens) for r in requests[10:20]} == {(5, 30)}  # answers x3
    assert [r.input_tokens for r in requests[20:30]] == list(range(1010, 1020))  # where it stopped
    assert len({r.salt for r in requests}) == 30  # no two requests share filler tokens


def test_without_a_trace_the_demo_replays_generated_stand_ins(monkeypatch) -> None:
    monkeypatch.delenv("PDCLUSTER_TRACES", raising=False)
    phases = workload.parse_phases("30:1,30:2:azure*3")
    traces = workload.load_traces(None, phases, 0.0)
    assert set(traces) == {None, "azure"}
    assert traces[None].name == "conversation" and traces["azure"].name == "azure-conversation"
    assert traces[None].span_s >= 90 - 5  # long enough for both phases at their speeds
    requests = workload.workload(traces, 0.0, phases)
    assert requests and max(r.at_s for r in requests) < 60
    with pytest.raises(TraceError, match="synthetic"):
        workload.load_traces(None, workload.parse_phases("10:1:synthetic"), 0.0)


def test_a_real_trace_that_is_not_there_is_named(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PDCLUSTER_TRACES", str(tmp_path))
    with pytest.raises(TraceError, match=r"mooncake_conversation_trace\.jsonl"):
        workload.load_traces(None, workload.parse_phases("10:1"), 0.0)
