"""The capacity models' margin: the whole tolerance, or half of it on a calm load, and a
scale-up on a calm, flat load only where the measured latency asks for it."""

from __future__ import annotations

from datetime import timedelta

from tests.unit.test_control_law import PROFILE, T0, metrics, ready, spec

from pdcluster.api.v1alpha1 import AutoscalingState, LoadSample
from pdcluster.control import MetricsSnapshot, decide_outcome
from pdcluster.control.context import Role, context
from pdcluster.control.needs import Need, View, calm_noise
from pdcluster.control.trend import demand, load_history, sizing_margin
from pdcluster.timestamps import time_ms


def _state(m: MetricsSnapshot, engines: tuple[int, int], shares: tuple[float, ...]) -> AutoscalingState:
    """The runs of the last 90 s, each at a share of this window's demand."""
    prefill, decode = demand(m)
    history = [
        LoadSample(
            time=time_ms(T0 - timedelta(seconds=30 * (len(shares) - i))),
            prefill=round(prefill * f),
            decode=round(decode * f),
        )
        for i, f in enumerate(shares)
    ]
    last = time_ms(T0 - timedelta(seconds=30))
    return AutoscalingState(prefill=engines[0], decode=engines[1], last_run_time=last, history=history)


CALM = (1.01, 0.99, 1.0)
BURSTY = (0.75, 1.0, 0.75)


def test_the_margin_is_half_the_tolerance_only_on_a_calm_load() -> None:
    s, m = spec(3, 4), metrics(rate=26.0, engines=(3, 4))
    for shares, margin in ((CALM, 0.05), (BURSTY, 0.10), ((1.0,), 0.10)):
        ctx = context(s, _state(m, (3, 4), shares), ready(3, 4), T0)
        history = load_history(ctx)
        assert sizing_margin(ctx, history) == margin, shares
    assert sizing_margin(context(s, None, ready(3, 4), T0), ()) == 0.10


def test_a_calm_load_gives_back_an_engine_the_whole_tolerance_keeps() -> None:
    """Four decode engines at 26 requests/s with 40% ITL headroom: the models at half the
    tolerance need three; at the whole tolerance, with the load bursty, they keep four."""
    s = spec(3, 4, scaleDownStabilizationSeconds=0, cooldownSeconds=0, maxStep=8)
    m = metrics(rate=26.0, engines=(3, 4), ttft=300.0, wait=30.0)
    calm = decide_outcome(s, m, _state(m, (3, 4), CALM), ready(3, 4), T0, profile=PROFILE)
    assert (calm.decision.prefill, calm.decision.decode) == (3, 3), calm.decision.reason
    bursty = decide_outcome(s, m, _state(m, (3, 4), BURSTY), ready(3, 4), T0, profile=PROFILE)
    assert (bursty.decision.prefill, bursty.decision.decode) == (3, 4), bursty.decision.reason


def _view(
    growth: float = 1.0, margin: float | None = 0.05, backlog: float = 0.0, decode_growth: float = 1.0
) -> View:
    return View(
        None,
        {Role.prefill: 4, Role.decode: 2},
        {Role.prefill: growth, Role.decode: decode_growth},
        None,
        backlog={Role.prefill: backlog, Role.decode: 0.0},
        margin=margin,
    )


def test_a_scale_up_the_models_alone_ask_for_on_a_calm_flat_load_may_be_noise() -> None:
    ctx = context(spec(4, 2), None, ready(4, 2), T0)
    wants_one = Need(up=5, down=5)
    assert calm_noise(ctx, _view(), Role.prefill, wants_one)
    # The measured quantile over its target, a rising load, a queue, a load not calm, or
    # no scale-up: the models are followed at once.
    assert not calm_noise(ctx, _view(), Role.prefill, Need(up=5, down=5, violated=True))
    assert not calm_noise(ctx, _view(growth=1.2), Role.prefill, wants_one)
    assert not calm_noise(ctx, _view(backlog=3.0), Role.prefill, wants_one)
    assert not calm_noise(ctx, _view(margin=None), Role.prefill, wants_one)
    assert not calm_noise(ctx, _view(), Role.prefill, Need(up=4, down=5))


def test_a_calm_scale_up_waits_for_the_next_run_to_want_it_too() -> None:
    """Three prefill engines at 38 requests/s answering within the TTFT target: on a
    calm load the models ask for a fourth. The run that first wants it waits; the next
    run, still wanting it, scales up. With the load bursty the models, at the whole
    tolerance, ask for it too, and are followed at once."""
    s = spec(3, 4, scaleDownStabilizationSeconds=0, cooldownSeconds=0, maxStep=8)
    m = metrics(rate=38.0, engines=(3, 4), ttft=300.0, wait=30.0)
    first = decide_outcome(s, m, _state(m, (3, 4), CALM), ready(3, 4), T0, profile=PROFILE)
    assert first.decision.prefill == 3, first.decision.reason
    assert "prefill scale-up wanted for 0/15 s" in first.decision.reason
    later = T0 + timedelta(seconds=30)
    second = decide_outcome(s, m, first.state, ready(3, 4), later, profile=PROFILE)
    assert second.decision.prefill == 4, second.decision.reason
    bursty = decide_outcome(s, m, _state(m, (3, 4), BURSTY), ready(3, 4), T0, profile=PROFILE)
    assert bursty.decision.prefill == 4, bursty.decision.reason


def test_decode_sizes_a_rising_load_with_the_whole_tolerance() -> None:
    """A decode short on a ramp slows every stream it holds (ServeGen's day at peak 8:
    hour 22 attained 95.1% with half the tolerance there, 99.4% with the whole)."""
    ctx = context(spec(4, 2), None, ready(4, 2), T0)
    calm, ramp = _view(), _view(growth=1.2, decode_growth=1.2)
    assert (calm.sizing_margin(ctx, Role.prefill), calm.sizing_margin(ctx, Role.decode)) == (0.05, 0.05)
    assert (ramp.sizing_margin(ctx, Role.prefill), ramp.sizing_margin(ctx, Role.decode)) == (0.05, 0.10)
    assert _view(margin=None).sizing_margin(ctx, Role.prefill) == 0.10
