"""pdctl plan --compare-colocated: loads, the goodput search, crossovers, the command."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pdcluster import perf
from pdcluster.sim import crossover, plan_cli, scoring
from pdcluster.sim.crossover import SweepConditions

SLO = scoring.SLO(1000.0, 50.0, plus_prefill=True)


@pytest.mark.parametrize("prompt", [512, 8192, 100_000])
def test_at_load_one_the_prompts_alone_keep_every_gpu_busy(prompt: int) -> None:
    profile = perf.load()
    rate = crossover.rate_at(profile, 8, prompt, 1.0)
    assert rate * crossover.prompt_seconds(profile, prompt) == pytest.approx(8.0)
    # Short prompts share a batch's fixed part; a long one pays it alone.
    a = profile.prefill_coef[0] / 1000
    assert crossover.prompt_seconds(profile, prompt) == pytest.approx(
        profile.prefill_one_ms(prompt) / 1000 - a + a * min(1.0, prompt / 8192)
    )


def test_a_sweep_trace_has_the_rate_and_shape_asked_for() -> None:
    workload = crossover.Workload(output_tokens=128, requests=2000, span_s=10.0, seed=1)
    trace = workload.trace(4096, rate=20.0)
    assert len(trace) == 2000
    assert set(trace.input_tokens) == {4096} and set(trace.output_tokens) == {128}
    assert len(trace) / trace.span_s == pytest.approx(20.0, rel=0.1)
    # At a high rate the span sets the size: queues get time to build up.
    assert len(crossover.Workload(128, 100, 30.0, 1).trace(4096, rate=500.0)) == 15000


def test_crossovers_name_the_lengths_around_each_change_and_skip_ties() -> None:
    caps = {
        1024: {"colocated": 10.0, "disaggregated": 5.0},
        2048: {"colocated": 4.0, "disaggregated": 4.2},  # within 10%: no winner
        4096: {"colocated": 1.0, "disaggregated": 2.0},
        8192: {"colocated": 0.5, "disaggregated": 0.9},
    }
    assert crossover.length_crossovers(caps) == [(1024, 4096, "disaggregated")]
    assert crossover.length_crossovers({1024: caps[1024]}) == []


def test_the_goodput_search_stops_where_the_best_configuration_still_holds_the_slo() -> None:
    setting = SweepConditions(perf.DEFAULT_PROFILE, 2, SLO)
    workload = crossover.Workload(output_tokens=64, requests=120, span_s=5.0, seed=3)
    caps = crossover.capacities(setting, [2048, 32768], workload, jobs=1, steps=5)
    profile = perf.load()
    for prompt, found in caps.items():
        for kind, per_gpu in found.items():
            assert per_gpu > 0, (prompt, kind)
            trace = workload.trace(prompt, per_gpu * 2)
            outcomes = [
                crossover.run_one(setting, trace, c)
                for c in crossover.configs(2, profile.gpus)
                if c.kind == kind
            ]
            assert max(o.attainment for o in outcomes) >= 0.9, (prompt, kind)
            # ... and not far above it (the bisection's last step failed there).
            faster = workload.trace(prompt, per_gpu * 2 * 1.6)
            over = [
                crossover.run_one(setting, faster, c)
                for c in crossover.configs(2, profile.gpus)
                if c.kind == kind
            ]
            assert max(o.attainment for o in over) < 0.9, (prompt, kind)


def test_a_point_compares_the_best_of_each_architecture() -> None:
    setting = SweepConditions(perf.DEFAULT_PROFILE, 3, SLO)
    cases = crossover.sweep_cases(setting, [16384], [0.7], crossover.Workload(64, 100, 5.0, 1))
    (point,) = crossover.compare(setting, cases, jobs=1)
    outcomes = [crossover.run_one(setting, cases[0][2], c) for c in crossover.configs(3, 1)]
    assert point.colocated.goodput_rps == max(o.goodput_rps for o in outcomes if o.config.kind == "colocated")
    assert point.disaggregated.goodput_rps == max(
        o.goodput_rps for o in outcomes if o.config.kind == "disaggregated"
    )
    assert {o.config.value for o in outcomes if o.config.kind == "disaggregated"} == {1, 2}


def test_the_command_prints_the_sweep_and_writes_its_data_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, png = tmp_path / "x.csv", tmp_path / "x.png"
    args = ["--compare-colocated", "--gpus", "2", "--slo-ttft-ms", "1000", "--ttft-plus-prefill"]
    args += ["--slo-itl-ms", "50", "--lengths", "1024,16384", "--loads", "0.2,0.6", "--requests", "60"]
    args += ["--span-s", "2", "--itl-targets", "20,50"]
    assert plan_cli.main([*args, "--csv", str(data), "--plot", str(png), "--json", "--jobs", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(p["prompt_tokens"], p["load"]) for p in report["points"]] == [
        (1024, 0.2),
        (1024, 0.6),
        (16384, 0.2),
        (16384, 0.6),
    ]
    assert set(report["goodput_per_gpu_at_90"]) == {"1024", "16384"}
    rows = list(csv.DictReader((tmp_path / "x-loads.csv").open()))
    assert [r["winner"] for r in rows] == [p["winner"] for p in report["points"]]
    plotted = {(float(r["itl_target_ms"]), int(r["prompt_tokens"])): r for r in csv.DictReader(data.open())}
    assert {itl for itl, _ in plotted} == {20.0, 50.0}
    main = float(plotted[(50.0, 16384)]["colocated_goodput_per_gpu"])
    assert main == report["goodput_per_gpu_at_90"]["16384"]["colocated"]
    assert report["goodput_per_gpu_at_90_by_itl_target"]["50"] == report["goodput_per_gpu_at_90"]
    # A tighter ITL target serves no more within the SLO.
    strict = report["goodput_per_gpu_at_90_by_itl_target"]["20"]
    assert all(strict[n][k] <= report["goodput_per_gpu_at_90"][n][k] for n in strict for k in strict[n])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_compares_on_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 200 * i, "input_length": 3000, "output_length": 40, "hash_ids": [i % 3]})
            + "\n"
            for i in range(80)
        )
    )
    args = ["--compare-colocated", "--trace", str(trace), "--gpus", "2", "--slo-ttft-ms", "800"]
    assert plan_cli.main([*args, "--slo-itl-ms", "40", "--rate-scale", "1", "--json", "--jobs", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    (point,) = report["points"]
    assert point["prompt_tokens"] == 0 and point["winner"] in ("colocated", "disaggregated", "tie")
    assert report["recommended_mode"].split()[0] in ("colocated", "disaggregated", "either")


def outcome(kind: str, goodput: float) -> crossover.Outcome:
    return crossover.Outcome(crossover.Config(kind, 1), goodput, 1.0)


@pytest.mark.parametrize(
    ("colocated", "disaggregated", "says"),
    [
        (10.0, 10.5, "either (goodput per GPU within 10%"),
        (10.0, 15.0, "disaggregated (1.50x the goodput per GPU)"),
        (6.0, 3.0, "colocated (2.00x the goodput per GPU)"),
        (0.0, 1.0, "disaggregated (only it holds the SLO)"),
    ],
)
def test_the_recommendation_names_the_mode_and_by_how_much(
    colocated: float, disaggregated: float, says: str
) -> None:
    point = crossover.Point(
        0, 1.0, 1.0, 2, outcome("colocated", colocated), outcome("disaggregated", disaggregated)
    )
    assert crossover.recommend(point).startswith(says)


def test_without_a_trace_or_the_sweep_the_command_says_what_it_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert plan_cli.main(["--gpus", "2", "--slo-ttft-ms", "1", "--slo-itl-ms", "1"]) == 2
    assert "--trace is required" in capsys.readouterr().err
