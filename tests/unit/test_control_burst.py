"""A TTFT miss that is a burst's wait, which the ready prefill engines drain before a new
one would start, holds prefill (control/bounds.py `burst_of`); a window that is not steady
cannot tell one."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from tests.unit.test_control_law import T0, explained, metrics, noted, ready, run, spec

from pdcluster.api.v1alpha1 import AutoscalingState, PDClusterSpec
from pdcluster.control import NoteKind, bounds
from pdcluster.control.cause import Cause
from pdcluster.control.outcome import Outcome
from pdcluster.control.types import MetricsSnapshot


def burst(
    busy: float, queue: float = 4.0, rate: float = 2.0, ttft: float = 2400.0, wait: float = 1800.0
) -> MetricsSnapshot:
    """A window whose TTFT missed in a burst: the wait (1.8 s) is far beyond what 2
    requests/s on 4 engines explain (110x M/M/c's); the engines show themselves `busy`."""
    m = metrics(rate=rate, ttft=ttft, wait=wait)
    prefill_ms = 200.0
    shown = replace(m.prefill, steps_per_s=busy * 4 * 1000.0 / prefill_ms, prefill_time_ms=prefill_ms)
    return replace(m, prefill=shown, prefill_queue=queue)


def one_joined(m: MetricsSnapshot) -> MetricsSnapshot:
    """`m` with a fourth prefill engine ready for half of the window."""
    return replace(m, prefill=replace(m.prefill, ready=3.5))


def seen_a_window(s: PDClusterSpec, m: MetricsSnapshot) -> AutoscalingState:
    """The state after a calm run a window before T0: traffic older than `m`'s window."""
    return run(s, metrics(rate=m.request_rate), at=T0 - timedelta(seconds=m.window_s))[0]


def after_a_window(s: PDClusterSpec, m: MetricsSnapshot) -> Outcome:
    return explained(s, m, seen_a_window(s, m))


def test_a_burst_the_engines_drain_before_a_start_up_holds_prefill() -> None:
    outcome = after_a_window(spec(), burst(busy=0.1))
    decision = outcome.decision
    assert (decision.action, decision.prefill) == ("hold", 4), decision.reason
    assert decision.cause == Cause.burst_drains
    drains = noted(outcome, NoteKind.burst_drains, "prefill")
    assert drains.figures["wait_x"] >= 10 and drains.figures["startup_s"] == 60
    assert drains.figures["drain_s"] < 60 and drains.figures["engines"] == 4
    assert "in a burst" in decision.summary and "within a start-up (60 s)" in decision.summary


@pytest.mark.parametrize(
    ("why", "window", "history"),
    [
        ("the engines show a load", burst(busy=0.8), True),
        ("the queue outlasts a start-up", burst(busy=0.1, queue=5000.0), True),
        ("the engines show no busy share", metrics(rate=2.0, ttft=2400, wait=1800), True),
        # The window's arrivals and busy share read low: they cannot tell a burst.
        ("traffic younger than the window", burst(busy=0.1), False),
        ("an engine joined within the window", one_joined(burst(busy=0.1)), True),
    ],
)
def test_a_ttft_miss_that_is_not_a_burst_adds_prefill(
    why: str, window: MetricsSnapshot, history: bool
) -> None:
    state = seen_a_window(spec(), window) if history else None
    decision = run(spec(), window, state)[1]
    assert decision.prefill > 4, (why, decision.reason)
    assert decision.cause != Cause.burst_drains


def test_a_wait_within_burst_wait_x_of_the_models_is_a_load(monkeypatch: pytest.MonkeyPatch) -> None:
    window = burst(busy=0.1)
    assert after_a_window(spec(), window).decision.cause == Cause.burst_drains
    monkeypatch.setattr(bounds, "BURST_WAIT_X", 1000.0)  # the window's wait is 110x the model's
    decision = after_a_window(spec(), window).decision
    assert decision.prefill > 4 and decision.cause == Cause.ttft_over_target


def test_engines_ready_since_the_window_leave_it_steady() -> None:
    # Two engines asked for earlier became ready after the window that saw four.
    s = spec(prefill=6)
    window = burst(busy=0.1)
    outcome = explained(s, window, seen_a_window(s, window), ready(6, 4))
    assert (outcome.decision.prefill, outcome.decision.cause) == (6, Cause.burst_drains), (
        outcome.decision.reason
    )
