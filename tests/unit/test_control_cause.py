"""Every cause's one-line summary (the Event's, the Autoscaling condition's and
lastDecision's) quotes the figure that decided it, with its unit and its threshold."""

from __future__ import annotations

import pytest

from pdcluster.control.cause import Cause, Figures, summary

FIGURES = Figures(
    quantile="p90",
    ttft_ms=1234.0,
    ttft_target_ms=1000,
    itl_ms=31.0,
    itl_target_ms=25,
    kv_usage=0.93,
    budget=16,
    kv_handoff_ms=777.0,
    decode_wait_ms=555.0,
    kv_limit=0.9,
    needed={"prefill": 6, "decode": 3},
    ready={"prefill": 4, "decode": 5},
    prefill_load=5.2,
    stabilization_s={"prefill": 300, "decode": 120},
    scale_up_timeout_s={"prefill": 600, "decode": 900},
    cooldown_s=60,
    ahead={"prefill": 1.8, "decode": 1.4},
    horizon_s={"prefill": 120, "decode": 120},
    queue={"prefill": 42.0, "decode": 17.0},
    drain_s=120,
    max_step=2,
    peak={"prefill": 2.5, "decode": 1.5},
    peak_span_s={"prefill": 3600, "decode": 300},
    floor={"prefill": 7, "decode": 4},
    asked={"prefill": 7, "decode": 2},
    burst_wait_x=42.0,
    burst_drain_s=12.0,
    startup_s={"prefill": 60, "decode": 90},
)

# cause -> (the role it names, what its summary must quote: the driver and its threshold)
DRIVERS: dict[Cause, tuple[str | None, tuple[str, ...]]] = {
    Cause.disabled: (None, ()),
    Cause.suspended: (None, ()),
    Cause.metrics_unavailable: (None, ()),
    Cause.no_traffic: (None, ()),
    Cause.scale_up_timed_out: ("decode", ("900 s",)),
    Cause.ttft_over_target: ("prefill", ("1234 ms", "1000 ms")),
    Cause.prefill_short: ("prefill", ("5.2 engines", "needs 6 engines", "4 ready")),
    Cause.burst_drains: ("prefill", ("1234 ms", "1000 ms", "42x", "12 s", "60 s", "4 ready")),
    Cause.itl_over_target: ("decode", ("31 ms", "25 ms")),
    Cause.kv_cache_full: ("decode", ("93%", "limit 90%")),
    Cause.decode_short: ("decode", ("needs 3 engines", "5 ready")),
    Cause.prefill_headroom: ("prefill", ("1234 ms", "1000 ms", "needs 6 engines", "4 ready")),
    Cause.decode_headroom: ("decode", ("31 ms", "25 ms", "needs 3 engines", "5 ready")),
    Cause.decode_wait: ("decode", ("1234 ms", "1000 ms", "555 ms")),
    Cause.kv_handoff_slow: ("prefill", ("1234 ms", "1000 ms", "777 ms")),
    Cause.rebalanced: ("decode", ("1234 ms", "1000 ms", "31 ms", "25 ms")),
    Cause.budget_full: ("decode", ("needs 3 engines", "5 ready", "budget of 16")),
    Cause.stabilizing: ("prefill", ("300 s",)),
    Cause.cooling_down: (None, ("60 s",)),
    Cause.scale_up_blocked: ("prefill", ()),
    Cause.within_targets: (None, ("1234 ms", "1000 ms", "31 ms", "25 ms")),
    Cause.pool_headroom: ("colocated", ("1234 ms", "31 ms", "1000", "25 ms")),
    Cause.forecast_ramp: ("prefill", ("needs 6 engines", "4 ready", "120 s", "1.80x")),
    Cause.queue_backlog: ("decode", ("17 requests", "120 s", "needs 3 engines", "5 ready")),
    Cause.queue_growing: ("prefill", ("42 requests", "maxStep 2", "needs 6 engines")),
    Cause.peak_floor: ("prefill", ("7 engines", "3600 s", "2.50x")),
    Cause.split_flipped: (None, ("prefill wants 7 engines", "decode 2")),
}


def test_the_table_covers_every_cause():
    assert set(DRIVERS) == set(Cause)


@pytest.mark.parametrize("cause", list(Cause), ids=lambda c: c.value)
def test_each_summary_quotes_its_driver_and_threshold(cause):
    role, quoted = DRIVERS[cause]
    line = summary(cause, FIGURES, {"prefill": 4, "decode": 5}, {"prefill": 4, "decode": 5}, role)
    for figure in quoted:
        assert figure in line, (cause, figure, line)
    if role is not None and cause not in (
        Cause.ttft_over_target,
        Cause.itl_over_target,
        Cause.pool_headroom,
        Cause.decode_wait,
        Cause.kv_handoff_slow,
    ):
        assert role in line


def test_a_move_leads_the_summary():
    line = summary(
        Cause.prefill_short, FIGURES, {"prefill": 4, "decode": 5}, {"prefill": 6, "decode": 5}, "prefill"
    )
    assert line.startswith("prefill 4 -> 6: prefill needs 6 engines (load of 5.2 engines), 4 ready")
