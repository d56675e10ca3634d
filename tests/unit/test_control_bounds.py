"""A measured bound that outranks the capacity model: what prefill engines show (busy
share and TTFT) against the model's busy cap."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
from tests.unit.test_control_law import PROFILE, T0, metrics, ready, spec

from pdcluster import perf
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.control import NoteKind, Observed, RoleObserved, decide_outcome, models
from pdcluster.control.bounds import prefill_busy, prefill_busy_at
from pdcluster.control.types import MetricsSnapshot, assemble

NOW = datetime(2026, 12, 1, tzinfo=UTC)
ISL = 1500.0


def _spec(prefill: int) -> PDClusterSpec:
    return PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "prefill": {"replicas": prefill, "minReplicas": 1, "maxReplicas": 8},
            "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 8},
            "autoscaling": {
                "enabled": True,
                "gpuBudget": 8,
                "scaleDownStabilizationSeconds": 0,
                "profile": perf.DEFAULT_PROFILE,
            },
        }
    )


def _window(rps: float, ttft_ms: float, busy: float, engines: int, isl: float = ISL) -> MetricsSnapshot:
    """A window of `rps` prompts of `isl` tokens whose prefill engines are each `busy` (40 ms
    prefills) and answer the first token at `ttft_ms`; decode far from its targets."""
    tokens = rps * isl
    return assemble(
        window_s=120,
        prompt_tokens_rate=tokens,
        prefilled_tokens_rate=tokens,
        prefilled_rate=rps,
        finished_rate=rps,
        generated_tokens_rate=rps * 200,
        prefill_time_ms=40.0,
        prefill_steps_rate=busy * engines / 0.040,
        prefill_ready=float(engines),
        prefix_queries_rate=tokens,
        prefix_hits_rate=0.0,
        decode_running=rps * 200 * 0.008,
        decode_tokens_rate=rps * 200,
        decode_kv_usage=0.05,
        decode_ready=1.0,
        ttft_ms=ttft_ms,
        itl_ms=8.0,
        prefill_ttft_ms=ttft_ms,
        queue_time_ms=10.0,
        queue_time_q_ms=20.0,
    )


def _decide(prefill: int, m: MetricsSnapshot):
    observed = Observed(RoleObserved(prefill, prefill, prefill), RoleObserved(1, 1, 1))
    return decide_outcome(_spec(prefill), m, None, observed, NOW, profile=perf.load())


def _held(outcome) -> set[str | None]:
    return {n.role for n in outcome.notes if n.kind == NoteKind.measured_holds}


def test_the_busy_share_is_steps_times_the_prefill_time_per_engine() -> None:
    assert prefill_busy(_window(20.0, 150.0, busy=0.6, engines=2)) == 0.6
    unseen = MetricsSnapshot(window_s=120, request_rate=20.0)
    assert prefill_busy(unseen) is None


def test_a_measured_prefill_bound_outranks_the_models_busy_cap() -> None:
    """At 25 requests/s of 4,000-token prompts the model's queue asks for a second prefill
    engine. One engine at 70% busy answering in 150 ms is bound to keep the 500 ms target
    at the load plus its tolerance: it is held. Nearer the target, or busier, the model is
    followed."""
    calm = _decide(1, _window(25.0, 150.0, busy=0.7, engines=1, isl=4000.0))
    assert calm.decision.prefill == 1, calm.decision.reason
    assert _held(calm) == {"prefill"}
    near = _decide(1, _window(25.0, 300.0, busy=0.7, engines=1, isl=4000.0))
    assert near.decision.prefill == 2, near.decision.reason
    busy = _decide(1, _window(25.0, 150.0, busy=0.9, engines=1, isl=4000.0))
    assert busy.decision.prefill == 2, busy.decision.reason
    assert not _held(near) and not _held(busy)


def test_a_measured_prefill_bound_lets_go_of_an_engine_the_model_would_keep() -> None:
    """Two engines at 25% busy each, 100 ms TTFT: one is bound to carry both at the load
    plus its tolerance, though the model's busy cap less its tolerance keeps two."""
    light = _decide(2, _window(23.0, 100.0, busy=0.25, engines=2))
    assert light.decision.prefill == 1, light.decision.reason
    loaded = _decide(2, _window(23.0, 100.0, busy=0.6, engines=2))
    assert loaded.decision.prefill == 2, loaded.decision.reason


def test_a_steps_fixed_cost_does_not_grow_with_the_load() -> None:
    """Two engines at 45% busy, steps of 40 ms of which the profile's 16.5 ms are fixed:
    on one engine the prompts fill fuller steps, and the busy share grows to 77%, not 99%.
    Bound to keep the target there, one engine is let go; a profile whose steps have no
    fixed cost keeps both."""
    m = _window(23.0, 100.0, busy=0.45, engines=2)
    assert prefill_busy_at(m, 0.45, 2.2, None) == pytest.approx(0.99)
    assert prefill_busy_at(m, 0.45, 2.2, 16.5) == pytest.approx(0.186 + 0.264 * 2.2, abs=1e-3)
    assert _decide(2, m).decision.prefill == 1
    h200 = perf.load()
    unbatched = replace(h200, prefill_coef=(0.0, *h200.prefill_coef[1:]))
    observed = Observed(RoleObserved(2, 2, 2), RoleObserved(1, 1, 1))
    kept = decide_outcome(_spec(2), m, None, observed, NOW, profile=unbatched)
    assert kept.decision.prefill == 2, kept.decision.reason


def test_the_bound_holds_at_the_forecasts_load_not_the_trends() -> None:
    """A step in the load reads as a ramp in the window's mean for a whole window; the
    trend would carry it a window past the new level (here 1.5x). The bound holds one
    engine at 60% busy regardless; the model, which does follow the trend, asks for two."""
    from datetime import timedelta

    from pdcluster.api.v1alpha1 import AutoscalingState, LoadSample
    from pdcluster.timestamps import time_ms

    ramp = [
        LoadSample(time=time_ms(NOW - timedelta(seconds=s)), prefill=int(25 * ISL * f), decode=100)
        for s, f in ((90, 0.62), (60, 0.75), (30, 0.88))
    ]
    state = AutoscalingState(
        prefill=1, decode=1, last_run_time=time_ms(NOW - timedelta(seconds=30)), history=ramp
    )
    observed = Observed(RoleObserved(1, 1, 1), RoleObserved(1, 1, 1))
    outcome = decide_outcome(
        _spec(1), _window(25.0, 150.0, busy=0.6, engines=1), state, observed, NOW, profile=perf.load()
    )
    assert outcome.decision.prefill == 1, outcome.decision.reason
    assert _held(outcome) == {"prefill"}


@pytest.mark.parametrize(
    ("busy", "reads_served"),
    [(0.15, False), (0.9, True), (None, True)],  # None: the engines show no busy share
)
def test_a_served_rate_under_the_arrivals_is_the_service_time_only_on_busy_engines(
    busy: float | None, reads_served: bool
) -> None:
    # A night window on the Azure code weekday: two engines served 5.67 of 5.80 requests/s
    # while a few prompts that came together waited (50 ms on average).
    profile = perf.load()
    model = models.calibrate_prefill(
        profile,
        rate=5.80,
        input_tokens=1950.0,
        hit_ratio=0.0,
        quantile=0.9,
        engines=2.0,
        observed_ttft_ms=290.0,
        observed_wait_ms=50.0,
        served_rate=5.67,
        measured_busy=busy,
    )
    engines_over_served = 2.0 / 5.67
    alone = models.mean_prefill_service_s(profile, 1950.0, 0.0, ())
    assert alone < engines_over_served / 5
    assert model.service_s == pytest.approx(engines_over_served if reads_served else alone)


def test_a_scale_down_judges_a_wait_no_lower_than_mm1s() -> None:
    """Engines mostly idle wait far less than M/M/1 says (the router finds an idle one),
    which says little about fewer of them: the scale-down's model never scales the
    measured wait below M/M/1's, while the scale-up's keeps what was measured."""
    mm1 = models.PrefillModel(rate=6.0, service_s=0.36, fixed_ms=200.0, quantile=0.9, wait_scale=1.0)
    idle = replace(mm1, wait_scale=0.15)
    assert idle.for_scale_down() == mm1
    assert idle.for_scale_down().ttft_ms(5) > idle.ttft_ms(5)
    slow = replace(mm1, wait_scale=4.8)
    assert slow.for_scale_down() is slow
    unmeasured = replace(mm1, wait_scale=None)
    assert unmeasured.for_scale_down() is unmeasured


def test_mostly_idle_engines_do_not_talk_the_law_into_a_deep_scale_down() -> None:
    """Eight prefill engines at 14 requests/s of 10,000-token prompts wait 0.5 ms on
    average, far under M/M/1's: scaled by that, the model would keep five; judged at
    M/M/1's wait at least, the scale-down stops at seven."""
    s = spec(8, 2, gpuBudget=16, scaleDownStabilizationSeconds=0, cooldownSeconds=0, maxStep=4)
    m = metrics(rate=14.0, engines=(8, 2), ttft=250.0, wait=0.5, isl=10000.0, itl=10.0, kv=0.1)
    outcome = decide_outcome(s, m, None, ready(8, 2), T0, profile=PROFILE)
    assert outcome.decision.prefill == 7, outcome.decision.reason
