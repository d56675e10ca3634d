"""Decision tables of the control law: each guard and bound, invariants, restart safety."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster import perf
from pdcluster.api.v1alpha1 import AutoscalingState, PDClusterSpec
from pdcluster.control import (
    MetricsSnapshot,
    NoteKind,
    Observed,
    RoleMetrics,
    RoleObserved,
    decide,
    decide_outcome,
)
from pdcluster.control.cause import Cause
from pdcluster.control.notes import Note
from pdcluster.control.outcome import Outcome
from pdcluster.timestamps import parse

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
PROFILE = perf.load()


def spec(prefill: int = 4, decode: int = 4, **autoscaling: Any) -> PDClusterSpec:
    auto = {"enabled": True, "gpuBudget": 16, **autoscaling}
    return PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "prefill": {"replicas": prefill, "minReplicas": 1, "maxReplicas": 12},
            "decode": {"replicas": decode, "minReplicas": 1, "maxReplicas": 12},
            "autoscaling": auto,
        }
    )


def ready(prefill: int, decode: int, **kw: int) -> Observed:
    return Observed(RoleObserved(prefill, prefill, prefill), RoleObserved(decode, decode, decode, **kw))


def metrics(
    *,
    rate: float = 4.0,
    ttft: float = 300.0,
    itl: float = 15.0,
    wait: float = 5.0,
    kv: float = 0.3,
    engines: tuple[float, float] = (4, 4),
    isl: float = 3000.0,
    osl: float = 200.0,
) -> MetricsSnapshot:
    """A window in which each engine served its share of `rate` requests/s."""
    return MetricsSnapshot(
        window_s=120,
        request_rate=rate,
        ttft_ms=ttft,
        itl_ms=itl,
        mean_input_tokens=isl,
        mean_output_tokens=osl,
        prefill_queue=wait / 1000.0 * rate,
        decode_kv_usage=kv,
        prefix_hit_ratio=0.0,
        prefill=RoleMetrics(
            ttft_ms=ttft * 0.8, queue_time_ms=wait, tokens_per_s=rate * isl, ready=engines[0]
        ),
        decode=RoleMetrics(itl_ms=itl, tokens_per_s=rate * osl, ready=engines[1]),
    )


def run(s, m, state=None, observed=None, at=T0):
    return decide(s, m, state, observed or ready(s.prefill.replicas, s.decode.replicas), at, profile=PROFILE)


def explained(s, m, state=None, observed=None, at=T0) -> Outcome:
    """`run`, with the figures and notes behind the decision."""
    seen = observed or ready(s.prefill.replicas, s.decode.replicas)
    return decide_outcome(s, m, state, seen, at, profile=PROFILE)


def noted(outcome: Outcome, kind: NoteKind, role: str | None = None) -> Note:
    """The outcome's one note of that kind (and role)."""
    (found,) = [n for n in outcome.notes if n.kind == kind and (role is None or n.role == role)]
    return found


# ---------------------------------------------------------------- holding
def test_missing_metrics_hold_and_say_so() -> None:
    state, decision = run(spec(), None)
    assert (decision.action, decision.prefill, decision.decode) == ("hold", 4, 4)
    assert decision.cause == Cause.metrics_unavailable
    assert (state.prefill, state.decode) == (4, 4)
    assert decision.metrics is None


def test_no_traffic_holds_instead_of_scaling_to_the_minimum() -> None:
    _, decision = run(spec(), MetricsSnapshot(window_s=120, request_rate=0.0))
    assert decision.action == "hold"
    assert decision.cause == Cause.no_traffic


def test_missing_metrics_break_a_scale_down_wish() -> None:
    s = spec(prefill=8, decode=8)
    state, decision = run(s, metrics(rate=1.0, ttft=150, itl=8, engines=(8, 8)), observed=ready(8, 8))
    assert state.down_wanted_since, decision.reason
    state, _ = run(s, None, state, ready(8, 8), T0 + timedelta(seconds=30))
    assert not state.down_wanted_since and not state.up_wanted_since


def test_disabled_autoscaling_holds() -> None:
    s = spec()
    s.autoscaling.enabled = False
    _, decision = run(s, metrics(ttft=5000, wait=4000))
    assert decision.action == "hold" and decision.cause == Cause.disabled


def test_steady_load_within_the_band_holds() -> None:
    _, decision = run(spec(), metrics())
    assert decision.action == "hold", decision.reason
    # 40% headroom on both: fewer engines are wanted, after the stabilization window.
    assert decision.cause == Cause.stabilizing
    assert decision.summary == "hold 4:4: prefill change waits out its 300 s stabilization window"
    _, decision = run(spec(prefill=1, decode=1), metrics(engines=(1, 1), ttft=420, itl=21))
    assert (decision.action, decision.cause) == ("hold", Cause.within_targets), decision.reason
    assert decision.summary == "hold 1:1: TTFT p90 420 ms of 500 ms, ITL p90 21 ms of 25 ms: within targets"


# ---------------------------------------------------------------- scaling up
def test_ttft_miss_with_prefill_queueing_adds_prefill() -> None:
    _, decision = run(spec(), metrics(rate=14.0, ttft=2400, wait=1800))
    assert decision.action == "scale"
    assert decision.prefill > 4 and decision.decode >= 4
    assert decision.cause == Cause.ttft_over_target
    assert decision.summary.endswith(": TTFT p90 2400 ms over 500 ms")


def test_itl_miss_adds_decode() -> None:
    _, decision = run(spec(), metrics(rate=20.0, itl=40.0, kv=0.8))
    assert decision.decode > 4, decision.reason
    assert decision.cause == Cause.itl_over_target


def test_a_step_moves_at_most_max_step() -> None:
    _, decision = run(spec(maxStep=1), metrics(rate=40.0, ttft=9000, wait=8000, itl=60, kv=0.95))
    assert decision.prefill - 4 <= 1 and decision.decode - 4 <= 1
    _, decision = run(spec(maxStep=3), metrics(rate=40.0, ttft=9000, wait=8000, itl=60, kv=0.95))
    assert 1 < max(decision.prefill - 4, decision.decode - 4) <= 3


def test_max_replicas_bound_a_scale_up() -> None:
    s = spec(prefill=11, decode=2, gpuBudget=None)
    _, decision = run(s, metrics(rate=60.0, ttft=9000, wait=8000, engines=(11, 2)), observed=ready(11, 2))
    assert decision.prefill == 12


def test_scale_up_stabilization_delays_a_scale_up() -> None:
    s = spec(scaleUpStabilizationSeconds=60, scaleDownStabilizationSeconds=300)
    hot = metrics(rate=14.0, ttft=2400, wait=1800)
    state, decision = run(s, hot)
    assert decision.action == "hold" and decision.cause == Cause.stabilizing
    state, decision = run(s, hot, state, at=T0 + timedelta(seconds=30))
    assert decision.action == "hold"
    _, decision = run(s, hot, state, at=T0 + timedelta(seconds=60))
    assert decision.action == "scale" and decision.prefill > 4


# ---------------------------------------------------------------- scaling down
def idle_for_eight() -> tuple[PDClusterSpec, MetricsSnapshot, Observed]:
    return spec(prefill=8, decode=8), metrics(rate=1.0, ttft=150, itl=8, kv=0.02, engines=(8, 8)), ready(8, 8)


def test_scale_down_waits_for_the_stabilization_window() -> None:
    s, quiet, seen = idle_for_eight()
    state, decision = run(s, quiet, observed=seen)
    assert decision.action == "hold" and decision.cause == Cause.stabilizing
    for seconds in range(30, 300, 30):
        state, decision = run(s, quiet, state, seen, T0 + timedelta(seconds=seconds))
        assert decision.action == "hold", seconds
    state, decision = run(s, quiet, state, seen, T0 + timedelta(seconds=300))
    assert decision.action == "scale"
    assert decision.cause in (Cause.prefill_headroom, Cause.decode_headroom)
    assert decision.prefill == 6 and decision.decode == 6  # max_step 2 per role
    assert decision.prefill >= 1


def test_scale_down_stops_at_min_replicas() -> None:
    s, quiet, _ = idle_for_eight()
    s = spec(prefill=2, decode=2, scaleDownStabilizationSeconds=0, cooldownSeconds=0)
    quiet = metrics(rate=0.2, ttft=100, itl=6, kv=0.01, engines=(2, 2))
    state, decision = run(s, quiet, observed=ready(2, 2))
    for k in range(1, 5):
        state, decision = run(
            s, quiet, state, ready(state.prefill, state.decode), T0 + timedelta(seconds=30 * k)
        )
    assert (decision.prefill, decision.decode) == (1, 1)


def test_a_scale_down_needs_observed_headroom_not_only_the_model() -> None:
    s = spec(prefill=8, decode=8, scaleDownStabilizationSeconds=0)
    # The model sees little load, but the observed TTFT is at the target: no scale-down.
    _, decision = run(s, metrics(rate=1.0, ttft=480, itl=8, kv=0.02, engines=(8, 8)), observed=ready(8, 8))
    assert decision.prefill == 8, decision.reason


def test_cooldown_holds_the_next_change() -> None:
    s = spec(cooldownSeconds=120)
    hot = metrics(rate=14.0, ttft=2400, wait=1800)
    state, decision = run(s, hot)
    assert decision.action == "scale"
    grown = ready(state.prefill, state.decode)
    state, decision = run(s, hot, state, grown, T0 + timedelta(seconds=60))
    assert decision.action == "hold" and decision.cause == Cause.cooling_down
    _, decision = run(s, hot, state, grown, T0 + timedelta(seconds=120))
    assert decision.action == "scale"


# ---------------------------------------------------------------- GPU budget
def test_at_the_budget_a_missing_role_takes_from_one_with_lasting_headroom() -> None:
    s = spec(prefill=8, decode=8, gpuBudget=16)
    # 40 req/s of 3000 + 200 tokens hold ~21k KV tokens per decode engine: ITL ~7 ms.
    hot_prefill = metrics(rate=40.0, ttft=2500, wait=2000, itl=9, kv=0.03, engines=(8, 8))
    first = explained(s, hot_prefill, observed=ready(8, 8))
    state, decision = first.state, first.decision
    # Moving engines costs a drain and a start-up: the shortfall and the donor's
    # headroom must both last a whole metrics window (120 s).
    assert (decision.prefill, decision.decode) == (8, 8)
    taking = noted(first, NoteKind.taking_waits, "prefill")
    assert (taking.figures["wanted"], taking.figures["window"], taking.figures["donor"]) == (0, 120, "decode")
    giving = noted(first, NoteKind.down_waiting, "decode")
    assert (giving.figures["waited"], giving.figures["needed"]) == (0, 120)
    for seconds in (30, 60, 90):
        state, decision = run(s, hot_prefill, state, ready(8, 8), T0 + timedelta(seconds=seconds))
        assert (decision.prefill, decision.decode) == (8, 8)
    _, decision = run(s, hot_prefill, state, ready(8, 8), T0 + timedelta(seconds=120))
    assert (decision.prefill, decision.decode) == (10, 6), decision.reason


def test_a_donor_keeps_its_engines_while_the_taker_waits_with_the_free_gpus() -> None:
    s = spec(prefill=7, decode=8, gpuBudget=16)
    # Decode has headroom (ITL 9 ms) for a whole window, less than its own stabilization
    # (300 s); then prefill turns short. It takes the one free GPU at once, and decode's
    # engines only once its shortfall has lasted a window: decode keeps them meanwhile,
    # rather than drain two engines nobody takes.
    calm = metrics(rate=30.0, ttft=300, itl=9, kv=0.03, engines=(7, 8))
    state, decision = run(s, calm, observed=ready(7, 8))
    for seconds in (30, 60, 90, 120):
        state, decision = run(s, calm, state, ready(7, 8), T0 + timedelta(seconds=seconds))
    assert (decision.prefill, decision.decode) == (7, 8), decision.reason
    hot = metrics(rate=40.0, ttft=2500, wait=2000, itl=9, kv=0.03, engines=(7, 8))
    _, decision = run(s, hot, state, ready(7, 8), T0 + timedelta(seconds=150))
    assert (decision.prefill, decision.decode) == (8, 8), decision.reason


def test_at_the_budget_nothing_moves_when_the_other_role_is_at_its_target() -> None:
    s = spec(prefill=8, decode=8, gpuBudget=16)
    # 22 req/s of 8000 + 1000 tokens fill 60% of each decode engine's KV: ITL ~24 ms.
    both_hot = metrics(rate=22.0, ttft=2500, wait=2000, itl=24, kv=0.6, engines=(8, 8), isl=8000, osl=1000)
    _, decision = run(s, both_hot, observed=ready(8, 8))
    assert decision.prefill + decision.decode <= 16
    assert decision.decode >= 8 or decision.prefill <= 8, decision.reason


def test_a_lowered_budget_cuts_at_once() -> None:
    s = spec(prefill=8, decode=8, gpuBudget=10)
    state, decision = run(s, metrics(engines=(8, 8)), AutoscalingState(prefill=8, decode=8), ready(8, 8))
    assert decision.prefill + decision.decode <= 10
    assert state.prefill + state.decode <= 10


def test_gpus_per_pod_count_against_the_budget() -> None:
    s = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "prefill": {"replicas": 2, "maxReplicas": 8, "tensorParallelSize": 2},
            "decode": {"replicas": 2, "maxReplicas": 8, "tensorParallelSize": 4},
            "autoscaling": {"enabled": True, "gpuBudget": 16},
        }
    )
    _, decision = run(
        s, metrics(rate=60.0, ttft=9000, wait=8000, itl=60, kv=0.95, engines=(2, 2)), None, ready(2, 2)
    )
    assert decision.prefill * 2 + decision.decode * 4 <= 16


# ---------------------------------------------------------------- stuck scale-ups
def test_a_scale_up_that_never_gets_ready_times_out_and_falls_back() -> None:
    s = spec(scaleUpTimeoutSeconds=300)
    hot = metrics(rate=14.0, ttft=2400, wait=1800)
    state, decision = run(s, hot)
    wanted = state.prefill
    assert wanted > 4
    stuck = Observed(RoleObserved(wanted, wanted, 4, unschedulable=wanted - 4), RoleObserved(4, 4, 4))
    for seconds in (60, 120, 240):
        state, decision = run(s, hot, state, stuck, T0 + timedelta(seconds=seconds))
        assert state.prefill >= wanted, decision.reason
    timed_out = explained(s, hot, state, stuck, T0 + timedelta(seconds=300))
    state, decision = timed_out.state, timed_out.decision
    assert (decision.action, decision.prefill, decision.cause) == ("scale", 4, Cause.scale_up_timed_out)
    why = noted(timed_out, NoteKind.scale_up_timed_out, "prefill")
    assert (why.figures["waited"], why.figures["unschedulable"]) == (300, wanted - 4)
    assert state.blocked_until and "prefill" in state.blocked_until
    # No new prefill scale-up while blocked, even though TTFT is still missed.
    back = ready(4, 4)
    for seconds in (390, 480, 570):
        blocked = explained(s, hot, state, back, T0 + timedelta(seconds=seconds))
        state = blocked.state
        assert state.prefill == 4, blocked.decision.reason
    assert noted(blocked, NoteKind.blocked, "prefill")
    state, decision = run(s, hot, state, back, T0 + timedelta(seconds=660))
    assert state.prefill > 4


def test_pods_that_are_starting_get_two_start_ups_before_the_timeout() -> None:
    """Scheduled pods that download the model for 900 s are not given up on at the spec's
    600 s (that deletes them just before they serve), only after two start-ups."""
    s = spec()  # scaleUpTimeoutSeconds 600
    hot = metrics(rate=14.0, ttft=2400, wait=1800)
    state, _ = run(s, hot)
    wanted = state.prefill
    assert wanted > 4

    def starting(role_startup_s: float) -> Observed:
        return Observed(
            RoleObserved(wanted, wanted, 4, startup_s=role_startup_s),
            RoleObserved(4, 4, 4, startup_s=role_startup_s),
        )

    for seconds in (300, 900, 1500, 1770):
        state, decision = run(s, hot, state, starting(900.0), T0 + timedelta(seconds=seconds))
        assert state.prefill >= wanted and decision.cause != Cause.scale_up_timed_out, decision.reason
    timed_out = explained(s, hot, state, starting(900.0), T0 + timedelta(seconds=1800))
    assert (timed_out.decision.cause, timed_out.decision.prefill) == (Cause.scale_up_timed_out, 4)
    assert "not ready after 1800 s" in timed_out.decision.reason, timed_out.decision.reason
    # A 60 s start-up leaves the spec's 600 s as it was.
    state, _ = run(s, hot)
    state, decision = run(s, hot, state, starting(60.0), T0 + timedelta(seconds=600))
    assert decision.cause == Cause.scale_up_timed_out, decision.reason


def test_repeated_scale_ups_do_not_restart_the_timeout() -> None:
    s = spec(scaleUpTimeoutSeconds=300, cooldownSeconds=0)
    state, _ = run(s, metrics(rate=10.0, ttft=2400, wait=1800))
    first = state.pending_since["prefill"]
    stuck = Observed(RoleObserved(state.prefill, state.prefill, 4), RoleObserved(4, 4, 4))
    state, _ = run(s, metrics(rate=20.0, ttft=5000, wait=4000), state, stuck, T0 + timedelta(seconds=60))
    assert state.pending_since["prefill"] == first


# ---------------------------------------------------------------- state hygiene
def test_timers_from_a_long_gap_are_discarded() -> None:
    s, quiet, seen = idle_for_eight()
    state, _ = run(s, quiet, observed=seen)
    since = state.down_wanted_since["prefill"]
    later = T0 + timedelta(hours=2)
    state, decision = run(s, quiet, state, seen, later)
    assert decision.action == "hold"
    assert parse(state.down_wanted_since["prefill"]) == later
    assert parse(since) == T0


def test_recommend_mode_records_without_acting() -> None:
    s = spec(mode="recommend")
    state, decision = run(s, metrics(rate=14.0, ttft=2400, wait=1800))
    assert decision.action == "recommend" and decision.prefill > 4
    assert state.last_change_time is None and state.decisions == 0 and not state.pending_since
    # The recommendation starts from what runs, not from the last recommendation.
    _, again = run(s, metrics(rate=14.0, ttft=2400, wait=1800), state, at=T0 + timedelta(seconds=30))
    assert again.prefill == decision.prefill


def test_another_writer_does_not_move_the_target() -> None:
    s = spec()
    state, _ = run(s, metrics())
    edited = Observed(RoleObserved(9, 9, 9), RoleObserved(4, 4, 4))  # someone scaled the StatefulSet
    state, decision = run(s, metrics(), state, edited, T0 + timedelta(seconds=30))
    assert state.prefill == 4 and decision.prefill == 4


# ---------------------------------------------------------------- invariants
snapshots = st.builds(
    metrics,
    rate=st.floats(0.05, 80.0),
    ttft=st.floats(20.0, 20000.0),
    itl=st.floats(4.0, 90.0),
    wait=st.floats(0.0, 15000.0),
    kv=st.floats(0.0, 1.0),
    engines=st.tuples(st.floats(0.0, 12.0), st.floats(0.0, 12.0)),
    isl=st.floats(50.0, 100000.0),
    osl=st.floats(1.0, 2000.0),
)


@settings(max_examples=200, deadline=None)
@given(
    snaps=st.lists(st.one_of(snapshots, st.none()), min_size=1, max_size=8),
    start=st.tuples(st.integers(1, 12), st.integers(1, 12)),
    budget=st.integers(2, 24),
    ready_share=st.floats(0.0, 1.0),
)
def test_bounds_budget_and_step_always_hold(snaps, start, budget, ready_share) -> None:
    p, d = min(start[0], budget - 1), min(start[1], max(budget - start[0], 1))
    s = spec(prefill=p, decode=d, gpuBudget=budget, maxStep=2)
    state: AutoscalingState | None = None
    for k, m in enumerate(snaps):
        before = (state.prefill, state.decode) if state else (p, d)
        seen = Observed(
            RoleObserved(before[0], before[0], round(before[0] * ready_share)),
            RoleObserved(before[1], before[1], round(before[1] * ready_share)),
        )
        state, decision = run(s, m, state, seen, T0 + timedelta(seconds=30 * k))
        assert 1 <= state.prefill <= 12 and 1 <= state.decode <= 12
        assert state.prefill + state.decode <= budget
        falling_back = decision.cause == Cause.scale_up_timed_out
        assert falling_back or abs(state.prefill - before[0]) <= 2
        assert falling_back or abs(state.decode - before[1]) <= 2


@settings(max_examples=100, deadline=None)
@given(snaps=st.lists(st.one_of(snapshots, st.none()), min_size=2, max_size=10), gaps=st.integers(10, 400))
def test_a_restarted_operator_decides_exactly_as_a_running_one(snaps, gaps) -> None:
    """State round-tripped through the status (JSON) gives the same decisions."""
    s = spec(prefill=6, decode=6)
    live: AutoscalingState | None = None
    restarted: AutoscalingState | None = None
    for k, m in enumerate(snaps):
        at = T0 + timedelta(seconds=gaps * k)
        seen = ready(*((live.prefill, live.decode) if live else (6, 6)))
        live, a = run(s, m, live, seen, at)
        stored = (
            None if restarted is None else AutoscalingState.model_validate_json(restarted.model_dump_json())
        )
        restarted, b = run(s, m, stored, seen, at)
        assert a == b
        assert live == restarted


def test_the_figures_quote_the_observed_quantiles_against_their_targets() -> None:
    s = spec(prefill=8, decode=8, gpuBudget=16)
    outcome = explained(
        s, metrics(rate=40.0, ttft=820, wait=500, itl=15, kv=0.1, engines=(8, 8)), observed=ready(8, 8)
    )
    f = outcome.figures
    assert (f.quantile, f.ttft_ms, f.ttft_target_ms, f.itl_ms, f.itl_target_ms) == ("p90", 820, 500, 15, 25)


@pytest.mark.parametrize("quantile", ["p50", "p90", "p95", "p99"])
def test_every_quantile_is_understood(quantile: str) -> None:
    s = spec()
    s.autoscaling.slo.quantile = quantile
    assert explained(s, metrics()).figures.quantile == quantile
