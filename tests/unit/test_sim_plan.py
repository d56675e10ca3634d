"""`pdctl plan` end to end on a small generated trace, and its scoring."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from pdcluster.sim import plan, plan_cli, scoring
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
    assert plan_cli.main([*args, "--json", "--jobs", "1"]) == 0
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
    low, high = scoring.band(0.9)
    assert low <= best["attainment"] <= high


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
    s = scoring.score(result, trace, [0.5] * 4, itl_ms=25.0)
    assert s.good == 2 and s.unfinished == 1  # 0.7 s misses TTFT; the last never finished
    assert s.attainment == 0.5
    assert s.goodput_rps == pytest.approx(2 / 3.0)
    assert s.gpu_hours == 2.0 and s.goodput_per_gpu_hour == 1.0


def test_a_per_prompt_ttft_target_adds_the_isolated_prefill() -> None:
    from pdcluster import perf

    profile = perf.load()
    trace = Trace("t", [0.0, 1.0], [100, 50000], [5, 5], [(), ()])
    targets = scoring.SLO(500, 25, plus_prefill=True).ttft_targets_s(trace, profile)
    assert targets[1] * 1000 == pytest.approx(500 + profile.prefill_one_ms(50000))
    assert scoring.SLO(500, 25, plus_prefill=False).ttft_targets_s(trace, profile) == [0.5, 0.5]


def test_parallel_runs_take_an_empty_or_single_list() -> None:
    """The rate search can ask for no splits at all (`--jobs` above 1 crashed on it)."""
    assert plan.run_many(None, [], jobs=4) == []  # type: ignore[arg-type]


def _generated(rng: random.Random, kind: str) -> list[dict]:
    """Well-formed traces of shapes the public ones do not have."""
    n = {"tiny": 2, "burst": 60, "flat": 80, "huge": 12, "mixed": 150}[kind]
    rows, t = [], 0.0
    for i in range(n):
        if kind == "burst":
            t = 0.0 if i < n // 2 else 30.0  # everything arrives at two instants
        else:
            t += rng.expovariate(2.0)
        length = {
            "tiny": 1,
            "burst": 300,
            "flat": 2000,
            "huge": rng.randint(60_000, 130_000),
            "mixed": rng.choice([0, 1, 50, 4000, 32_000]),
        }[kind]
        rows.append(
            {
                "timestamp": round(t * 1000),
                "input_length": length,
                "output_length": rng.choice([0, 1, 40, 900]),
            }
        )
    return rows


@pytest.mark.parametrize("kind", ["tiny", "burst", "flat", "huge", "mixed"])
def test_plan_runs_on_generated_traces(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every well-formed trace gives a report: the rate search, every policy, the text."""
    rng = random.Random(kind)
    path = tmp_path / f"{kind}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _generated(rng, kind)))
    report = plan_json(
        capsys, "--trace", str(path), "--gpus", "4", "--slo-ttft-ms", "800", "--slo-itl-ms", "40"
    )
    assert report["requests"] == len(_generated(random.Random(kind), kind))
    assert set(report["policies"]) >= {"pdcluster", "dynamo"}
    for score in report["policies"].values():
        assert 0.0 <= score["attainment"] <= 1.0
    assert report["recommendation"]


def test_plan_runs_on_a_generated_azure_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "azure.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [
        f"2023-11-16 18:{m:02d}:{s:02d}.1234567,{300 + 7 * s},{20 + s}"
        for m in range(2)
        for s in range(0, 60, 3)
    ]
    path.write_text("\n".join(rows) + "\n")
    report = plan_json(
        capsys, "--trace", str(path), "--gpus", "3", "--slo-ttft-ms", "500", "--slo-itl-ms", "30"
    )
    assert report["requests"] == 40


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "a.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1\n',
            "a.jsonl:2: not JSON",
        ),
        (
            "b.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n\n{"timestamp": 9, "input_length": 5}\n',
            "b.jsonl:3: missing output_length",
        ),
        (
            "c.jsonl",
            '{"timestamp": 0, "input_length": -5, "output_length": 1}\n',
            "c.jsonl:1: input_length -5 is not a whole number >= 0",
        ),
        (
            "d.jsonl",
            '{"timestamp": "soon", "input_length": 5, "output_length": 1}\n',
            "d.jsonl:1: timestamp 'soon' is not a number",
        ),
        ("e.jsonl", "[1, 2]\n", "e.jsonl:1: a JSON object is expected"),
        (
            "f.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}\n',
            "f.jsonl:1: hash_ids must be a list",
        ),
        ("g.jsonl", "", "g.jsonl: no requests"),
        (
            "h.jsonl",
            '{"timestamp": 7, "input_length": 5, "output_length": 1}\n' * 3,
            "h.jsonl: requests at two different times",
        ),
        (
            "i.csv",
            "TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,5\n",
            "i.csv:1: header lacks GeneratedTokens",
        ),
        (
            "j.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5,1\nyesterday,5,1\n",
            "j.csv:3: TIMESTAMP 'yesterday' is not an ISO time",
        ),
        (
            "k.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5,1\n2023-11-16 18:00:01,5.5,1\n",
            "k.csv:3: ContextTokens 5.5 is not a whole number",
        ),
        (
            "l.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5\n",
            "l.csv:2: 3 columns expected",
        ),
    ],
)
def test_plan_rejects_a_bad_trace_naming_the_line(
    name: str, text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    path.write_text(text)
    code = plan_cli.main(["--trace", str(path), "--gpus", "4", "--slo-ttft-ms", "500", "--slo-itl-ms", "30"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err


def test_plan_rejects_a_budget_of_one_engine(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = plan_cli.main(
        ["--trace", str(small_trace), "--gpus", "1", "--slo-ttft-ms", "500", "--slo-itl-ms", "30"]
    )
    assert code == 2
    assert "prefill and decode need one each" in capsys.readouterr().err


def test_plan_follows_a_rate_curve_over_the_traces_lengths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--rate-curve: the load over time from the curve (times --rate-scale), the lengths from --trace."""
    rng = random.Random("curve")
    base = tmp_path / "base.jsonl"
    base.write_text("".join(json.dumps(r) + "\n" for r in _generated(rng, "flat")))
    curve = tmp_path / "day.csv"
    curve.write_text("t_s,rate_rps\n0,1\n60,3\n120,1\n")  # a three-minute day with a busy middle
    report = plan_json(
        capsys, "--trace", str(base), "--rate-curve", str(curve), "--rate-scale", "2",
        "--gpus", "4", "--slo-ttft-ms", "800", "--slo-itl-ms", "40", "--policy", "pdcluster",
    )
    assert report["rate_mode"] == "curve" and report["rate_scale"] == 2
    assert report["requests"] == pytest.approx(2 * (60 + 180 + 60), rel=0.15)
    assert report["span_s"] <= 180
    for score in report["policies"].values():
        assert 0.0 <= score["attainment"] <= 1.0
