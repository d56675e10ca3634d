"""Trace loading: the two public formats, jitter of quantised timestamps, rate scaling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcluster.sim.trace import load_trace


def write_mooncake(path: Path, stamps: list[int]) -> Path:
    rows = [
        {"timestamp": t, "input_length": 1000 + i, "output_length": 10 + i, "hash_ids": [i, i + 1]}
        for i, t in enumerate(stamps)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_azure_timestamps_with_seven_digits_parse(tmp_path: Path) -> None:
    csv = tmp_path / "azure.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.1234567,1000,0\n"
        "2023-11-16 18:16:46.6805910,20,7\n"
    )
    trace = load_trace(csv)
    assert trace.arrival_s == pytest.approx([0.0, 0.442866, 60.000001])
    assert trace.input_tokens == [374, 1000, 20]
    assert trace.output_tokens == [44, 1, 7]  # an empty output still takes one token
    assert trace.blocks == [(), (), ()]


def test_quantised_mooncake_timestamps_are_spread_inside_their_quantum(tmp_path: Path) -> None:
    stamps = sorted([3000 * (i // 5) for i in range(100)])  # 20 distinct stamps, 3 s apart
    path = write_mooncake(tmp_path / "conv.jsonl", stamps)
    trace = load_trace(path, seed=7)
    again = load_trace(path, seed=7)
    other = load_trace(path, seed=8)
    assert trace.arrival_s == again.arrival_s != other.arrival_s
    assert trace.arrival_s == sorted(trace.arrival_s)
    assert len(set(trace.arrival_s)) == 100
    assert min(trace.arrival_s) >= 0 and max(trace.arrival_s) < 60.0
    # Each request stays inside its 3 s bucket.
    buckets = sorted(int(t // 3) for t in trace.arrival_s)
    assert buckets == sorted(s // 3000 for s in stamps)


def test_distinct_mooncake_timestamps_are_kept(tmp_path: Path) -> None:
    stamps = [0, 170, 400, 910, 1500, 2200]
    trace = load_trace(write_mooncake(tmp_path / "synth.jsonl", stamps))
    assert trace.arrival_s == pytest.approx([s / 1000 for s in stamps])
    assert trace.blocks[2] == (2, 3)


def test_compressing_time_keeps_the_requests(tmp_path: Path) -> None:
    trace = load_trace(write_mooncake(tmp_path / "synth.jsonl", [1000, 2000, 5000]))
    fast = trace.scaled(4.0)
    assert fast.arrival_s == pytest.approx([0.0, 0.25, 1.0])
    assert fast.input_tokens == trace.input_tokens


def test_replicas_are_other_users_on_the_same_clock(tmp_path: Path) -> None:
    stamps = list(range(0, 600_000, 500))  # 1200 requests over 10 minutes
    trace = load_trace(write_mooncake(tmp_path / "synth.jsonl", stamps))
    more = trace.replicated(2.5, seed=1)
    assert len(more) == pytest.approx(2.5 * len(trace), rel=0.05)
    assert more.arrival_s == sorted(more.arrival_s)
    assert trace.arrival_s[0] <= more.arrival_s[0] and more.arrival_s[-1] <= trace.arrival_s[-1]
    # The originals keep their prefix hashes; copies get private ones.
    originals = {b for blocks in trace.blocks for b in blocks}
    copied = [blocks for blocks in more.blocks if not set(blocks) <= originals]
    assert len(copied) == pytest.approx(1.5 * len(trace), rel=0.08)
    assert all(not set(blocks) & originals for blocks in copied)
    # Load over minutes is preserved: 2.5x the requests in each 2-minute span.
    for start in range(0, 480, 120):
        base = sum(start + 30 <= t < start + 90 for t in trace.arrival_s)
        scaled = sum(start + 30 <= t < start + 90 for t in more.arrival_s)
        assert scaled == pytest.approx(2.5 * base, rel=0.2)
    # Copies jittered past the trace's ends are reflected inside, not piled up as a
    # burst on its first or last instant.
    for end in (trace.arrival_s[0], trace.arrival_s[-1]):
        assert more.arrival_s.count(end) == 1
