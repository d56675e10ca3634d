"""The demo reads the autoscaler's decisions from the PDCluster's status and its latency
through the project's PromQL, and shows each decision once."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from pdcluster import observability as obs
from pdcluster import slo
from pdcluster.api.v1alpha1 import AutoscalingSpec
from pdcluster.control import MetricsSnapshot
from pdcluster.io.prometheus import watched_queries
from pddemo.observe import Snapshot, is_new_scaling, read_status
from pddemo.replay import Outcomes
from pddemo.view import View


def status(time: str, action: str, prefill: int = 2, decode: int = 3) -> dict:
    decision = {
        "time": time,
        "prefill": prefill,
        "decode": decode,
        "action": action,
        "cause": "TTFTOverTarget",
        "summary": f"prefill 1 -> {prefill}: TTFT p90 3955 ms over 2000 ms",
        "reason": "the figures",
    }
    return {
        "prefill": {"desired": prefill, "ready": 1},
        "decode": {"desired": decode, "ready": decode},
        "conditions": [{"type": "Ready", "status": "True", "message": "ok"}],
        "autoscaling": {"lastDecision": decision},
    }


def test_the_status_gives_replicas_readiness_and_the_last_decision() -> None:
    s = read_status(status("2026-01-02T10:11:12.345Z", "scale"))
    assert s.roles == {"prefill": (2, 1), "decode": (3, 3)}
    assert s.ready == "True"
    assert (s.last_decision.prefill, s.last_decision.decode, s.last_decision.action) == (2, 3, "scale")
    assert read_status({}).last_decision is None


def test_each_scaling_decision_counts_once_and_holds_not_at_all() -> None:
    first = read_status(status("2026-01-02T10:11:12.345Z", "scale")).last_decision
    again = read_status(status("2026-01-02T10:11:12.345Z", "scale")).last_decision
    hold = read_status(status("2026-01-02T10:11:22.345Z", "hold")).last_decision
    recommended = read_status(status("2026-01-02T10:11:32.345Z", "recommend")).last_decision
    assert is_new_scaling(first, None)
    assert not is_new_scaling(again, first)
    assert not is_new_scaling(hold, first)
    assert is_new_scaling(recommended, first)
    assert not is_new_scaling(None, first)


def test_the_live_view_queries_the_router_of_its_cluster() -> None:
    qs = watched_queries("demo", "demo", 30, 0.9)
    assert set(qs) == {"requests_rate"}
    assert qs["requests_rate"] == (
        f'sum(rate({obs.ROUTER_REQUESTS}_total{{{obs.PROM_LABEL_CLUSTER}="demo",namespace="demo"}}[30s]))'
    )


def test_plain_lines_show_each_decision_once() -> None:
    out = io.StringIO()
    console = Console(file=out, width=200)
    decision = read_status(status("2026-01-02T10:11:12.345Z", "scale")).last_decision
    auto = AutoscalingSpec.model_validate({"slo": {"ttftMs": 2000, "itlMs": 25}, "ttftIncludesPrefill": False})
    window = MetricsSnapshot(30, 1.0, ttft_ms=2500.0, ttft_beyond_prefill_ms=1234.0, itl_ms=20.0)
    reading = slo.of_snapshot(auto, window)
    snapshot = Snapshot(roles={"prefill": (2, 1), "decode": (3, 3)}, reading=reading, last_decision=decision)
    observer = SimpleNamespace(snapshot=snapshot, decisions=[decision])
    with View(console, "demo", total=10, plain=True) as view:
        view.update(Outcomes(sent=3, ok=2), observer, "replaying")
        view.update(Outcomes(sent=4, ok=3), observer, "replaying")
    text = out.getvalue()
    assert text.count("scale at 10:11:12: prefill 2, decode 3: prefill 1 -> 2: TTFT p90 3955 ms") == 1
    line = "TTFT beyond prefill p90 1234 ms of 2000 ms (TTFT 2500 ms), ITL p90 20 ms of 25 ms: met (operator: none yet)"
    assert line in text and "prefill 1/2  decode 3/3" in text


def test_the_status_carries_the_operators_slo_verdict() -> None:
    raw = status("2026-01-02T10:11:12.345Z", "hold")
    raw["autoscaling"]["slo"] = {"verdict": "missed", "quantile": "p90", "ttftName": "TTFT beyond prefill"}
    assert read_status(raw).operator_slo.verdict == "missed"
    assert read_status(status("2026-01-02T10:11:12.345Z", "hold")).operator_slo is None
