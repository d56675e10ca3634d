"""`pdctl plan` end to end on a small generated trace, and its scoring."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from pdcluster.sim import plan
from pdcluster.sim.fleet import Result
from pdcluster.sim.trace import Trace


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(11)
    path = tmp_path_factory.mktemp("trace") / "small.jsonl"
    t, lines = 0.0, []
    for _ in range(900):
        t += rng.expovariate(3.0)
        length = rng.randint(500, 6000)
        root = rng.randrange(30)
        lines.append(
            json.dumps(
                {
                    "timestamp": int(t * 1000),
                    "input_length": length,
                    "output_length": rng.randint(20, 300),
                    "hash_ids": [root * 100 + k for k in range(math.ceil(length / 512))],
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert plan.main([*args, "--json", "--jobs", "1"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_compares_the_policies(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--trace", str(small_trace), "--gpus", "4", "--slo-ttft-ms", "500", "--slo-itl-ms", "25"]
    report = plan_json(capsys, *base, "--rate-scale", "3")
    names = list(report["policies"])
    assert names[0].startswith("static-best (") and names[1:] == ["dynamo", "pdcluster"]
    for figures in report["policies"].values():
        assert 0.0 <= figures["attainment"] <= 1.0
        assert figures["gpu_hours"] > 0 and figures["unfinished"] == 0
        assert set(figures) >= {
            "attainment",
            "goodput_rps",
            "gpu_hours",
            "ttft_p90_ms",
            "itl_p90_ms",
            "decisions",
        }
    assert report["rate_scale"] == 3 and not report["rate_scale_searched"]
    assert "deploy" in report["recommendation"] and "start at" in report["recommendation"]


def test_static_best_is_the_best_static_split(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--trace", str(small_trace), "--gpus", "4", "--slo-ttft-ms", "500", "--slo-itl-ms", "25"]
    splits = ["static:1:3", "static:2:2", "static:3:1"]
    policies = [arg for split in splits for arg in ("--policy", split)]
    report = plan_json(capsys, *base, "--rate-scale", "3", "--policy", "static-best", *policies)
    best = next(v for k, v in report["policies"].items() if k.startswith("static-best"))
    assert best["attainment"] == max(report["policies"][s]["attainment"] for s in splits)
    assert best["gpu_hours"] == pytest.approx(report["policies"]["static:2:2"]["gpu_hours"], rel=0.05)


def test_without_a_rate_scale_one_is_searched(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--trace", str(small_trace), "--gpus", "4", "--slo-ttft-ms", "500", "--slo-itl-ms", "25"]
    report = plan_json(capsys, *base, "--policy", "static-best")
    assert report["rate_scale_searched"]
    best = next(iter(report["policies"].values()))
    assert plan.BAND[0] <= best["attainment"] <= plan.BAND[1]


def test_score_counts_both_targets_and_unfinished_requests() -> None:
    trace = Trace("t", [0.0, 1.0, 2.0, 3.0], [100, 100, 100, 100], [10, 10, 1, 10], [()] * 4)
    result = Result(
        "x",
        ttft_s=[0.2, 0.7, 0.1, math.nan],
        itl_s=[0.020, 0.010, 0.0, math.nan],
        finished=[True, True, True, False],
        gpu_seconds=7200.0,
        end_s=10.0,
        timeline=[],
    )
    s = plan.score(result, trace, [0.5] * 4, itl_ms=25.0)
    assert s.good == 2 and s.unfinished == 1  # 0.7 s misses TTFT; the last never finished
    assert s.attainment == 0.5
    assert s.goodput_rps == pytest.approx(2 / 3.0)
    assert s.gpu_hours == 2.0 and s.goodput_per_gpu_hour == 1.0


def test_a_per_prompt_ttft_target_adds_the_isolated_prefill() -> None:
    from pdcluster import perf

    profile = perf.load()
    trace = Trace("t", [0.0, 1.0], [100, 50000], [5, 5], [(), ()])
    targets = plan.SLO(500, 25, plus_prefill=True).ttft_targets_s(trace, profile)
    assert targets[1] * 1000 == pytest.approx(500 + profile.prefill_one_ms(50000))
    assert plan.SLO(500, 25, plus_prefill=False).ttft_targets_s(trace, profile) == [0.5, 0.5]


def test_parallel_runs_take_an_empty_or_single_list() -> None:
    """The rate search can ask for no splits at all (`--jobs` above 1 crashed on it)."""
    assert plan.run_many(None, [], jobs=4) == []  # type: ignore[arg-type]
