"""The colocated pool's control law: decision tables for each guard, and trajectories
against a small model of a colocated fleet (latency rising with each engine's load)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from pdcluster import slo
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
from pdcluster.control.pool import engines_for

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
CAPACITY = 2.0  # requests/s one engine of the model serves


def spec(replicas: int = 2, most: int = 10, **autoscaling: Any) -> PDClusterSpec:
    auto = {
        "enabled": True,
        "slo": {"ttftMs": 500, "itlMs": 25},
        "intervalSeconds": 30,
        "windowSeconds": 60,
        "scaleDownStabilizationSeconds": 120,
        "cooldownSeconds": 60,
        **autoscaling,
    }
    return PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "mode": "colocated",
            "colocated": {"replicas": replicas, "minReplicas": 1, "maxReplicas": most},
            "autoscaling": auto,
        }
    )


def pool(desired: int, ready: int | None = None, unschedulable: int = 0) -> Observed:
    ready = desired if ready is None else ready
    none = RoleObserved(0, 0, 0)
    return Observed(none, none, RoleObserved(desired, desired, ready, unschedulable))


def fleet(rate: float, engines: int, kv: float = 0.3) -> MetricsSnapshot:
    """A window of the model fleet: TTFT grows as M/M/1 queueing, ITL with the batch."""
    u = min(rate / (engines * CAPACITY), 0.97)
    return MetricsSnapshot(
        window_s=60,
        request_rate=rate,
        ttft_ms=150.0 / (1.0 - u),
        itl_ms=10.0 + 12.0 * u,
        mean_input_tokens=1000.0,
        mean_output_tokens=200.0,
        colocated=RoleMetrics(kv_usage=kv, ready=engines),
    )


def noted(outcome: Outcome, kind: NoteKind) -> Note:
    """The outcome's one note of that kind."""
    (found,) = [n for n in outcome.notes if n.kind == kind]
    return found


def run(s: PDClusterSpec, rates: list[float], start: int | None = None) -> list[tuple[int, str]]:
    """The law every 30 s against the model; pods become ready at once."""
    state, engines, out = None, start or s.colocated.replicas, []
    for i, rate in enumerate(rates):
        state, decision = decide(
            s, fleet(rate, engines), state, pool(engines), T0 + timedelta(seconds=30 * i)
        )
        engines = state.colocated
        out.append((engines, decision.cause))
    return out


def test_load_rising_then_falling_scales_up_fast_and_down_slowly_without_flapping() -> None:
    rates = [2.0] * 4 + [9.0] * 12 + [2.0] * 20
    trajectory = run(spec(replicas=2), rates)
    counts = [n for n, _ in trajectory]
    # Up: TTFT over target at 9 req/s on 2 engines; never more than maxStep (2) a change.
    assert counts[:4] == [2, 2, 2, 2]
    assert max(b - a for a, b in itertools.pairwise(counts)) <= 2
    peak = max(counts)
    assert peak >= 6, trajectory  # 9 req/s needs at least 5 engines of 2 req/s within targets
    # Under the steady 9 req/s: up, then at most a trim of the overshoot, never up again.
    high = counts[3:16]
    moves = [b - a for a, b in itertools.pairwise(high) if b != a]
    assert moves == sorted(moves, reverse=True) and sum(m < 0 for m in moves) <= 1, trajectory
    assert trajectory[15][1] == Cause.within_targets and counts[14] == counts[15], trajectory
    # Down: only after the stabilization (120 s = 4 runs), one cooldown apart, never below 1.
    after = counts[16:]
    assert after[:4] == [counts[15]] * 4, trajectory
    assert after[-1] < peak and min(after) >= 1
    assert any(c == Cause.pool_headroom for _, c in trajectory[16:])
    assert any(c in (Cause.ttft_over_target, Cause.itl_over_target) for _, c in trajectory[4:8])


def test_steady_load_inside_the_band_holds() -> None:
    trajectory = run(spec(replicas=4), [5.0] * 20)
    assert {n for n, _ in trajectory} == {4}
    assert {c for _, c in trajectory} == {Cause.within_targets}


def test_the_gpu_budget_and_max_replicas_bound_scale_ups() -> None:
    s = spec(replicas=2, gpuBudget=3)
    trajectory = run(s, [30.0] * 8)
    assert max(n for n, _ in trajectory) == 3
    outcome = decide_outcome(s, fleet(30.0, 3), None, pool(3), T0)
    assert outcome.state.colocated == 3
    assert noted(outcome, NoteKind.beyond_limit).figures["limit"] == 3


def test_a_full_kv_cache_adds_engines_with_its_own_cause() -> None:
    s = spec(replicas=2)
    state, decision = decide(s, fleet(1.0, 2, kv=0.99), None, pool(2), T0)
    assert state.colocated == 3 and decision.cause == Cause.kv_cache_full
    assert decision.summary.startswith("colocated 2 -> 3: colocated KV cache")


def test_guards_hold_and_say_why() -> None:
    s = spec(replicas=3)
    for snapshot, cause in ((None, Cause.metrics_unavailable), (MetricsSnapshot(60, 0.0), Cause.no_traffic)):
        state, decision = decide(s, snapshot, None, pool(3), T0)
        assert (state.colocated, decision.cause, decision.action) == (3, cause, "hold")
    state, decision = decide(spec(replicas=3, enabled=False), fleet(20.0, 3), None, pool(3), T0)
    assert (state.colocated, decision.cause) == (3, Cause.disabled)


def test_recommend_mode_records_and_changes_nothing() -> None:
    s = spec(replicas=2, mode="recommend")
    state, decision = decide(s, fleet(9.0, 2), None, pool(2), T0)
    assert decision.action == "recommend" and decision.colocated > 2
    # The next run starts again from what runs (the StatefulSet's replicas), not the advice.
    state, decision = decide(s, fleet(9.0, 2), state, pool(2), T0 + timedelta(seconds=30))
    assert decision.action == "recommend" and state.last_change_time is None


def test_a_scale_up_that_never_becomes_ready_falls_back_and_blocks() -> None:
    s = spec(replicas=2, scaleUpTimeoutSeconds=60)
    state, decision = decide(s, fleet(9.0, 2), None, pool(2), T0)
    assert state.colocated == 4
    t = T0
    for _ in range(2):  # two of the four pods never get a node
        t += timedelta(seconds=30)
        outcome = decide_outcome(s, fleet(9.0, 2), state, pool(4, ready=2, unschedulable=2), t)
        state, decision = outcome.state, outcome.decision
    assert (state.colocated, decision.cause) == (2, Cause.scale_up_timed_out)
    assert noted(outcome, NoteKind.scale_up_timed_out).figures["unschedulable"] == 2
    t += timedelta(seconds=30)
    state, decision = decide(s, fleet(9.0, 2), state, pool(2), t)
    assert (state.colocated, decision.cause) == (2, Cause.scale_up_blocked)


def test_a_restarted_operator_continues_from_status() -> None:
    s = spec(replicas=4)
    state, _ = decide(s, fleet(1.0, 4), None, pool(4), T0)
    assert state.down_wanted_since == {"colocated": state.last_run_time}
    # Through status (JSON) and back, as a restarted operator reads it.
    for seconds in (60, 120):
        restored = AutoscalingState.model_validate(state.model_dump(by_alias=True, exclude_none=True))
        state, decision = decide(s, fleet(1.0, 4), restored, pool(4), T0 + timedelta(seconds=seconds))
    assert state.colocated < 4 and decision.cause == Cause.pool_headroom
    # A gap longer than three intervals discards the timers: "wanted since" must mean continuously.
    state, _ = decide(s, fleet(1.0, 4), None, pool(4), T0)
    state, decision = decide(s, fleet(1.0, 4), state, pool(4), T0 + timedelta(seconds=150))
    assert state.colocated == 4 and decision.cause == Cause.stabilizing


def test_while_engines_start_the_window_counts_only_the_ready_ones() -> None:
    s = spec(replicas=4)
    state = AutoscalingState(colocated=4, last_run_time="2026-12-01T11:59:30.000Z")
    # 2 of 4 ready, TTFT 1.5x its target: 3 engines of the measured kind would do; 4 are coming.
    slow = MetricsSnapshot(60, 4.0, ttft_ms=750.0, itl_ms=12.0, colocated=RoleMetrics(kv_usage=0.3))
    outcome = decide_outcome(s, slow, state, pool(4, ready=2), T0)
    state, decision = outcome.state, outcome.decision
    assert (state.colocated, decision.cause) == (4, Cause.stabilizing)
    starting = noted(outcome, NoteKind.starting).figures
    assert (starting["target"], starting["ready"]) == (4, 2)
    # Three times over: 2 ready engines x 3 = 6, more than is coming.
    worse = MetricsSnapshot(60, 4.0, ttft_ms=1500.0, itl_ms=12.0, colocated=RoleMetrics(kv_usage=0.3))
    state, decision = decide(s, worse, state, pool(4, ready=2), T0 + timedelta(seconds=30))
    assert (state.colocated, decision.cause) == (6, Cause.ttft_over_target)


def test_itl_is_predicted_to_grow_faster_than_the_load_per_engine_ttft_and_kv_in_proportion() -> None:
    """4 engines at 40% of the ITL target: in proportion 2 engines would be at 80%, but
    ITL grows as the load per engine ^ 1.5, so 2 would be at 113%: the pool keeps 3.
    TTFT or the KV cache at the same share scale in proportion: 2 engines."""
    s = spec(replicas=4, scaleDownStabilizationSeconds=0, cooldownSeconds=0)
    low_itl = MetricsSnapshot(60, 4.0, ttft_ms=100.0, itl_ms=10.0, colocated=RoleMetrics(kv_usage=0.0))
    state, decision = decide(s, low_itl, None, pool(4), T0)
    assert (state.colocated, decision.cause) == (3, Cause.pool_headroom)
    assert engines_for({"itl": 0.4}, 4, 0.9) == 3
    assert engines_for({"ttft": 0.4}, 4, 0.9) == engines_for({"kv": 0.4}, 4, 0.9) == 2
    # Up: 2 engines at 1.5x the ITL target need 2 x 1.5 ^ (1 / 1.5) = 2.6, so 3; KV at
    # 1.5x its limit needs 3 as well, in proportion.
    assert engines_for({"itl": 1.5}, 2, 1.0) == 3 and engines_for({"kv": 1.5}, 2, 1.0) == 3
    assert engines_for({"itl": 2.0, "kv": 1.2}, 4, 1.0) == 7  # 4 x 2 ^ (2/3) = 6.3


def test_a_saturated_pool_is_sized_by_its_throughput_not_by_its_queue() -> None:
    """A queue makes TTFT 40x its target; the engines compute half the prompt tokens that
    arrive, so twice the engines serve the load, not forty times."""
    s = spec(replicas=2, maxStep=10)
    saturated = MetricsSnapshot(
        60,
        10.0,
        ttft_ms=20000.0,
        itl_ms=20.0,
        mean_input_tokens=1000.0,
        colocated=RoleMetrics(kv_usage=0.5, tokens_per_s=5000.0, ready=2.0),
    )
    outcome = decide_outcome(s, saturated, None, pool(2), T0)
    assert (outcome.state.colocated, outcome.decision.cause) == (4, Cause.ttft_over_target)
    assert noted(outcome, NoteKind.saturated).figures["backlog"] == 2.0
    # Without the throughput series the pressure sizes it (up to maxReplicas).
    blind = MetricsSnapshot(60, 10.0, ttft_ms=20000.0, itl_ms=20.0, colocated=RoleMetrics(kv_usage=0.5))
    state, _ = decide(s, blind, None, pool(2), T0)
    assert state.colocated == 10


def window(itl_ms: float, ttft_ms: float = 100.0, seen: float | None = None) -> MetricsSnapshot:
    """A window at 4 req/s; `seen`: the engines serving in it, on average."""
    return MetricsSnapshot(
        60, 4.0, ttft_ms=ttft_ms, itl_ms=itl_ms, colocated=RoleMetrics(kv_usage=0.1, ready=seen)
    )


def test_itl_alone_asks_for_one_step_more_ttft_in_proportion() -> None:
    """ITL's tail at twice its target asks for one more engine (a tolerance band more of a
    larger pool); TTFT at twice its target for twice the engines."""
    for engines, itl_wants in ((4, 5), (20, 22)):
        s = spec(replicas=engines, most=40, maxStep=20)
        state, decision = decide(s, window(50.0, seen=engines), None, pool(engines), T0)
        assert (state.colocated, decision.cause) == (itl_wants, Cause.itl_over_target)
    s = spec(replicas=4, maxStep=20)
    state, decision = decide(s, window(12.0, ttft_ms=1000.0, seen=4), None, pool(4), T0)
    assert (state.colocated, decision.cause) == (8, Cause.ttft_over_target)
    # A queue that grows (10 waiting on 4 engines, 5% more prompt tokens arrive than they
    # compute) confirms ITL's tail: 4 x 2 ^ (1 / 1.5) = 6.3, so 7.
    pool_seen = RoleMetrics(kv_usage=0.1, ready=4, waiting=10, tokens_per_s=4000.0 / 1.05)
    queued = replace(window(50.0), mean_input_tokens=1000.0, colocated=pool_seen)
    state, decision = decide(s, queued, None, pool(4), T0)
    assert (state.colocated, decision.cause) == (7, Cause.itl_over_target)


def test_a_window_that_has_not_seen_the_engines_now_serving_holds() -> None:
    """4 engines serve, the window saw 2.5 on average: ITL over its target waits for a
    window at the new count, and so does a scale-down."""
    s = spec(replicas=4, scaleDownStabilizationSeconds=0, cooldownSeconds=0)
    outcome = decide_outcome(s, window(50.0, seen=2.5), None, pool(4), T0)
    assert (outcome.state.colocated, outcome.decision.cause) == (4, Cause.stabilizing)
    assert noted(outcome, NoteKind.unmeasured).figures == {"measured": 2.5, "engines": 4}
    state, decision = decide(s, window(5.0, ttft_ms=50.0, seen=2.5), None, pool(4), T0)
    assert (state.colocated, decision.cause) == (4, Cause.within_targets)
    # Seen by a whole window, the same ITL adds one engine.
    state, _ = decide(s, window(50.0, seen=4.0), None, pool(4), T0)
    assert state.colocated == 5


def test_a_scale_down_is_sized_from_the_engines_the_window_saw() -> None:
    """Just down from 5 to 3, the window saw 4 engines on average at 40% of the ITL target:
    4 engines' load on 3 keeps ITL under 90%, on 2 it would not (as on 3 engines' load)."""
    s = spec(replicas=3, scaleDownStabilizationSeconds=0, cooldownSeconds=0)
    state, decision = decide(s, window(10.0, ttft_ms=50.0, seen=4.0), None, pool(3), T0)
    assert (state.colocated, decision.cause) == (3, Cause.within_targets)
    assert engines_for({"itl": 0.4}, 3, 0.9) == 2
    state, decision = decide(s, window(10.0, ttft_ms=50.0, seen=3.0), None, pool(3), T0)
    assert (state.colocated, decision.cause) == (2, Cause.pool_headroom)


def test_the_pool_reads_each_streams_time_per_output_token_before_the_token_gaps() -> None:
    """A prompt chunk in a step delays every stream on its engine once: the token gaps'
    tail at 150 ms while each stream's mean time per output token is 12 ms is no reason
    for more engines, and a window of streams at 50 ms each is one, whatever the gaps'
    tail. Without the per-stream series the gaps' tail is read, as before."""
    s = spec(replicas=4, maxStep=20)
    chunked = replace(window(150.0, seen=4), tpot_ms=12.0)
    state, decision = decide(s, chunked, None, pool(4), T0)
    assert state.colocated == 4 and decision.cause == Cause.stabilizing  # well under: only a scale-down waits
    slow = replace(window(9.0, seen=4), tpot_ms=50.0)
    state, decision = decide(s, slow, None, pool(4), T0)
    assert (state.colocated, decision.cause) == (5, Cause.itl_over_target)
    state, decision = decide(s, window(150.0, seen=4), None, pool(4), T0)
    assert (state.colocated, decision.cause) == (5, Cause.itl_over_target)
    reading = slo.of_snapshot(s.autoscaling, chunked, colocated=True)
    assert (reading.itl_ms, reading.verdict) == (12.0, slo.MET)


def test_a_scale_down_goes_to_the_most_engines_wanted_while_it_waited() -> None:
    """As a HorizontalPodAutoscaler's scale-down: a window that wanted 4 of 6 engines and
    four lulls after it that want 3 end the 120 s wait at 4, not at the last wish."""
    s = spec(replicas=6, maxStep=20, cooldownSeconds=0)

    def after(itls: list[float]) -> tuple[int, AutoscalingState]:
        state = None
        for i, itl in enumerate(itls):
            state, _ = decide(s, window(itl, seen=6), state, pool(6), T0 + timedelta(seconds=30 * i))
        assert state is not None
        return state.colocated or 0, state

    busy, lull = 12.0, 5.0  # ITL's share 0.48 wants 4 engines, 0.2 wants 3
    assert after([lull] * 5)[0] == 3
    waiting, state = after([busy, lull, lull, lull])
    assert waiting == 6 and state.down_wanted_most == {"colocated": 4}
    outcome = decide_outcome(s, window(lull, seen=6), state, pool(6), T0 + timedelta(seconds=120))
    assert (outcome.state.colocated, outcome.decision.cause) == (4, Cause.pool_headroom)
    # A wish at the count held ends the scale-down and what it remembered.
    _, state = after([busy, lull, 25.0])
    assert state.down_wanted_since is None and state.down_wanted_most is None
