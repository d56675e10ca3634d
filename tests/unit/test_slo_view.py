"""One TTFT from the router to the dashboard: the control law, the status, the printer
columns and the demo's live line show the TTFT the target applies to under one name, and
never disagree on whether the targets are met."""

from __future__ import annotations

import math
import random
import re
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from pdcluster import perf, slo
from pdcluster.api.crd import PRINTER_COLUMNS
from pdcluster.api.v1alpha1 import AutoscalingSpec, Decision, PDClusterSpec, PDClusterStatus
from pdcluster.control import MetricsSnapshot, decide
from pdcluster.control.cause import Cause
from pdcluster.sim import scrapes
from pdcluster.sim.fleet import Fleet, FleetConfig, simulate
from pdcluster.sim.policies import EPOCH, PDCluster, observed
from pdcluster.sim.trace import Trace
from pddemo.observe import Snapshot as DemoSnapshot
from pddemo.view import slo_line

REPO = Path(__file__).resolve().parents[2]
DEMO = yaml.safe_load((REPO / "examples" / "pdcluster-sim.yaml").read_text())
OVER = {Cause.ttft_over_target, Cause.itl_over_target, Cause.decode_wait, Cause.kv_handoff_slow}


def auto(**fields) -> AutoscalingSpec:
    return AutoscalingSpec.model_validate({"slo": {"ttftMs": 1000, "itlMs": 25}, **fields})


def test_the_target_applies_to_the_ttft_beyond_prefill_with_the_whole_ttft_beside_it() -> None:
    window = MetricsSnapshot(30, 2.0, ttft_ms=1643.0, ttft_beyond_prefill_ms=304.0, itl_ms=17.0)
    reading = slo.of_snapshot(auto(ttftIncludesPrefill=False), window)
    assert (
        reading.line()
        == "TTFT beyond prefill p90 304 ms of 1000 ms (TTFT 1643 ms), ITL p90 17 ms of 25 ms: met"
    )
    status = reading.status()
    assert (status.verdict, status.ttft_beyond_prefill_ms, status.ttft_ms, status.itl_ms) == (
        "met",
        304,
        1643,
        17,
    )
    whole = slo.of_snapshot(auto(ttftIncludesPrefill=True), window)
    assert whole.line() == "TTFT p90 1643 ms of 1000 ms, ITL p90 17 ms of 25 ms: missed"
    assert whole.status().ttft_beyond_prefill_ms is None


@pytest.mark.parametrize(
    ("ttft", "itl", "verdict"),
    [(1100.0, 27.5, "met"), (1101.0, 10.0, "missed"), (500.0, 27.6, "missed"), (None, 10.0, "unseen")],
)
def test_missed_is_past_the_target_and_its_tolerance_as_the_law_judges(ttft, itl, verdict) -> None:
    window = MetricsSnapshot(30, 2.0, ttft_ms=ttft, ttft_beyond_prefill_ms=ttft, itl_ms=itl)
    assert slo.of_snapshot(auto(tolerancePercent=10), window).verdict == verdict


def test_without_the_routers_histogram_the_law_estimates_the_same_quantity() -> None:
    window = MetricsSnapshot(30, 2.0, ttft_ms=1500.0, itl_ms=10.0)
    # No engine figures either: the whole TTFT, which errs towards more engines.
    assert slo.of_snapshot(auto(ttftIncludesPrefill=False), window).ttft_ms == 1500.0


def test_kubectl_get_shows_the_slo_verdict_and_the_figures_at_the_slo_quantile() -> None:
    columns = {c["name"]: c for c in PRINTER_COLUMNS}
    names = ("SLO", "TTFT-Beyond-Prefill", "TTFT", "ITL")
    assert all(not columns[n].get("priority") for n in names)
    assert all(columns[n].get("priority") for n in ("TTFT-p99", "ITL-p99"))  # not the SLO's quantile: -o wide
    window = MetricsSnapshot(30, 2.0, ttft_ms=900.0, ttft_beyond_prefill_ms=80.0, itl_ms=9.0)
    reading = slo.of_snapshot(auto(ttftIncludesPrefill=False), window)
    status = PDClusterStatus.model_validate({"autoscaling": {"slo": reading.status().wire()}}).wire()
    values = {name: _json_path(status, columns[name]["jsonPath"]) for name in names}
    assert values == {"SLO": "met", "TTFT-Beyond-Prefill": 80, "TTFT": 900, "ITL": 9}


def _json_path(doc: dict, path: str):
    for key in path.removeprefix(".status.").split("."):
        doc = doc[key]
    return doc


# ------------------------------------------------- a recorded window, law and view


def _trace(n: int, rate: float, seed: int = 1) -> Trace:
    """Long prompts whose arrival rate triples halfway: windows met and missed."""
    rng = random.Random(seed)
    t, arrival, inputs, outputs, blocks = 0.0, [], [], [], []
    for k in range(n):
        t += rng.expovariate(rate if k < n // 2 else 3 * rate)
        arrival.append(t)
        inputs.append(rng.randint(2000, 30000))
        outputs.append(rng.randint(20, 400))
        root = rng.randrange(20)
        blocks.append(tuple(root * 1000 + j for j in range(math.ceil(inputs[-1] / 512))))
    return Trace("synthetic", arrival, inputs, outputs, blocks)


class Recording(PDCluster):
    """The control law on the simulated fleet, keeping each window it judged."""

    def __init__(self, spec: PDClusterSpec) -> None:
        super().__init__(spec, perf.load())
        self.windows: list[tuple[Decision, MetricsSnapshot | None]] = []

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int]:
        a = self.spec.autoscaling
        window = scrapes.snapshot(fleet.scrapes, now_s, a.window_seconds, a.slo.quantile.fraction)
        now = EPOCH + timedelta(seconds=now_s)
        self.state, decision = decide(
            self.spec, window, self.state, observed(fleet), now, profile=self.profile
        )
        self.windows.append((decision, window))
        return decision.prefill, decision.decode


def test_the_law_and_the_demos_view_never_disagree_on_a_recorded_window() -> None:
    """The demo's example (ttftIncludesPrefill false, p90): each window the fleet
    simulator recorded, replayed through the law (its decision) and through the demo's
    view (its live line), names the same figure and reaches the same verdict."""
    spec = PDClusterSpec.model_validate(DEMO["spec"])
    law = Recording(spec)
    simulate(
        _trace(2000, 3.0), perf.load(), law, FleetConfig(gpus=spec.autoscaling.gpu_budget, link_gbps=200.0)
    )
    verdicts = set()
    for decision, window in law.windows:
        line = slo_line(DemoSnapshot(reading=slo.of_snapshot(spec.autoscaling, window)))
        verdict = re.search(r": (met|missed|unseen) \(operator", line)[1]
        verdicts.add(verdict)
        quoted = re.search(r"TTFT beyond prefill p90 (\d+ ms|unseen)", decision.reason)
        if quoted:  # the law's reason and the view quote one figure under one name
            assert f"TTFT beyond prefill p90 {quoted[1]}" in line, (decision.reason, line)
        if decision.cause == Cause.within_targets:
            assert verdict == "met", (decision.summary, line)
        if decision.cause in OVER:
            assert verdict == "missed", (decision.summary, line)
        if verdict == "missed":
            assert "within targets" not in decision.summary, (decision.summary, line)
    assert {"met", "missed"} <= verdicts
