"""Routing policies and SLO admission (pure code shared with the fleet simulator)."""

from __future__ import annotations

import pytest

from pdcluster.router.policy import Admission, Backend, LeastLoaded, PrefixAware, make_policy


def fleet(*loads: tuple[int, int]) -> list[Backend]:
    return [Backend(f"b{i}", "prefill", requests, tokens) for i, (requests, tokens) in enumerate(loads)]


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([(1, 500), (3, 100), (0, 900)], "b1"),  # fewest tokens wins over fewest requests
        ([(2, 100), (1, 100), (5, 400)], "b1"),  # token tie: fewer requests
        ([(0, 0)], "b0"),
    ],
)
def test_least_loaded(loads: list[tuple[int, int]], expected: str) -> None:
    backend = LeastLoaded().pick(fleet(*loads), 100)
    assert backend is not None and backend.id == expected


def test_least_loaded_rotates_among_equals() -> None:
    policy, backends = LeastLoaded(), fleet((0, 0), (0, 0), (0, 0), (4, 10))
    picked = [policy.pick(backends, 1).id for _ in range(6)]  # type: ignore[union-attr]
    assert sorted(picked) == ["b0", "b0", "b1", "b1", "b2", "b2"]


def test_empty_fleet_gives_none() -> None:
    assert LeastLoaded().pick([], 10) is None
    assert PrefixAware(block_tokens=16).pick([], 10, [1, 2]) is None


def test_prefix_aware_follows_the_cached_prefix() -> None:
    policy = PrefixAware(block_tokens=100, max_imbalance_tokens=1000)
    backends = fleet((0, 0), (0, 0), (0, 0))
    policy.record("b2", [11, 12, 13])
    # 4 blocks, 3 cached on b2: it computes 100 tokens, the others 400.
    assert policy.pick(backends, 400, [11, 12, 13, 14]).id == "b2"  # type: ignore[union-attr]
    assert policy.matched_blocks("b2", [11, 12, 99, 13]) == 2  # a prefix, not any overlap


@pytest.mark.parametrize(
    ("b2_tokens", "expected"),
    [
        (250, "b2"),  # 250 + 100 uncached < 0 + 400
        (350, "b0"),  # 350 + 100 > 400: the cache no longer pays
        (1001, "b0"),  # beyond the imbalance bound, never considered
    ],
)
def test_prefix_aware_is_bounded_by_load(b2_tokens: int, expected: str) -> None:
    policy = PrefixAware(block_tokens=100, max_imbalance_tokens=1000)
    backends = fleet((0, 0), (1, 400), (1, b2_tokens))
    policy.record("b2", [11, 12, 13])
    assert policy.pick(backends, 400, [11, 12, 13, 14]).id == expected  # type: ignore[union-attr]


def test_prefix_aware_imbalance_bound_even_for_a_full_hit() -> None:
    policy = PrefixAware(block_tokens=1000, max_imbalance_tokens=500)
    policy.record("b1", [1, 2, 3, 4])
    assert policy.pick(fleet((0, 0), (1, 501)), 4000, [1, 2, 3, 4]).id == "b0"  # type: ignore[union-attr]
    assert policy.pick(fleet((0, 0), (1, 500)), 4000, [1, 2, 3, 4]).id == "b1"  # type: ignore[union-attr]


def test_prefix_aware_lru_forgets_old_blocks_and_departed_backends() -> None:
    policy = PrefixAware(block_tokens=10, capacity_blocks=3)
    policy.record("b0", [1, 2, 3])
    policy.record("b0", [7, 8])  # evicts 1 and 2
    assert policy.matched_blocks("b0", [1, 2, 3]) == 0
    assert policy.matched_blocks("b0", [3]) == 1
    policy.record("b0", [3])  # refreshes 3, so 7 is now the oldest
    policy.record("b0", [9])
    assert policy.matched_blocks("b0", [7]) == 0 and policy.matched_blocks("b0", [3]) == 1
    policy.forget("b0")
    assert policy.matched_blocks("b0", [3]) == 0


def test_make_policy() -> None:
    assert isinstance(make_policy("least-loaded", 64), LeastLoaded)
    assert make_policy("prefix-aware", 64).block_tokens == 64  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        make_policy("random", 64)


# ------------------------------------------------------------------------ admission
@pytest.mark.parametrize(
    ("queued", "prompt", "admitted", "predicted_ms", "retry_after"),
    [
        # rate 10000 tok/s (prior), target 500 ms x factor 2 = 1000 ms
        (0, 1000, True, 100.0, 0),
        (8000, 2000, True, 1000.0, 0),  # exactly at the limit
        (8001, 2000, False, 1000.1, 1),
        (30000, 1000, False, 3100.0, 3),  # retry when ~2.6 s of excess queue has drained
        # A prompt too long for the target even alone: the limit is 2 x its own 1500 ms.
        (0, 15000, True, 1500.0, 0),
        (5000, 15000, True, 2000.0, 0),
        (20000, 15000, False, 3500.0, 3),
    ],
)
def test_admission_decisions(
    queued: int, prompt: int, admitted: bool, predicted_ms: float, retry_after: int
) -> None:
    admission = Admission(ttft_target_ms=500, factor=2.0, default_tokens_per_s=10000)
    decision = admission.decide(Backend("p", "prefill", 1, queued), prompt)
    assert decision.predicted_ttft_ms == pytest.approx(predicted_ms)
    assert decision.admitted is admitted
    assert decision.retry_after_s == retry_after


@pytest.mark.parametrize(
    ("queued", "prompt", "admitted"),
    [
        # The target comes on top of the prompt's own prefill: 2 x (500 + 1500) = 4000 ms.
        (24000, 15000, True),  # 3900 ms predicted
        (26000, 15000, False),  # 4100 ms
        (0, 1000, True),
        (9000, 1000, True),  # 1000 ms against 2 x (500 + 100) = 1200 ms
        (12000, 1000, False),
    ],
)
def test_admission_with_the_target_on_top_of_the_prefill(queued: int, prompt: int, admitted: bool) -> None:
    admission = Admission(ttft_target_ms=500, factor=2.0, default_tokens_per_s=10000, plus_prefill=True)
    assert admission.decide(Backend("p", "prefill", 1, queued), prompt).admitted is admitted


def test_admission_learns_the_rate_from_batched_completions() -> None:
    admission = Admission(ttft_target_ms=500, factor=2.0, default_tokens_per_s=1000, prior_seconds=0.01)
    # Ten 1000-token prefills dispatched at t=0 to an idle backend, all done in one
    # 0.5 s batch: the backend did 10000 tokens in 0.5 s busy time = 20000 tok/s.
    admission.started("p", 0.0, was_idle=True)
    for _ in range(10):
        admission.completed("p", 1000, 0.5)
    assert admission.tokens_per_s("p") == pytest.approx(20000, rel=0.05)


def test_admission_rate_measures_busy_time_only() -> None:
    admission = Admission(ttft_target_ms=500, factor=2.0, default_tokens_per_s=5000, prior_seconds=0.001)
    for start in (0.0, 10.0, 20.0):  # idle gaps of ~10 s between single 0.1 s prefills
        admission.started("p", start, was_idle=True)
        admission.completed("p", 1000, start + 0.1)
    assert admission.tokens_per_s("p") == pytest.approx(10000, rel=0.05)


def test_admission_rates_are_per_backend() -> None:
    admission = Admission(ttft_target_ms=500, factor=2.0, default_tokens_per_s=5000)
    admission.started("fast", 0.0, True)
    for i in range(50):
        admission.completed("fast", 4000, 0.1 * (i + 1))
    assert admission.tokens_per_s("fast") > 30000
    assert admission.tokens_per_s("slow") == pytest.approx(5000)
    admission.forget("fast")
    assert admission.tokens_per_s("fast") == pytest.approx(5000)


def test_a_prefill_finishing_after_its_backend_was_forgotten_leaves_no_rate() -> None:
    """A pod deleted mid-prefill is forgotten before its last prefill ends; its successor
    under the same id (a StatefulSet's pod name) starts from the prior, not from a rate
    measured over the time since the clock's origin (which refused every request 429)."""
    admission = Admission(ttft_target_ms=500, factor=2.0, default_tokens_per_s=5000)
    admission.started("p", 100.0, was_idle=True)
    admission.forget("p")
    admission.completed("p", 1000, 40_000.0)
    assert admission.tokens_per_s("p") == pytest.approx(5000)
    assert admission.decide(Backend("p", "prefill", 1, 0), 1000).admitted
    admission.completed("p", 1000, 40_001.0)  # still no interval begun: nothing measured
    assert admission.tokens_per_s("p") == pytest.approx(5000)


def test_the_itl_histogram_reads_as_prometheus_would() -> None:
    """The router's per-token histogram is plain arithmetic behind a collector: its
    exposition is a Prometheus histogram's, n equal observations included."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pdcluster import observability as obs
    from pdcluster.router.metrics import RouterMetrics

    metrics = RouterMetrics(lambda: ([], {}))
    metrics.itl.observe(0.004, 3)
    metrics.itl.observe(0.03)
    metrics.itl.observe(99.0)  # past the last bound: +Inf only
    samples = {
        (s.name, s.labels.get("le")): s.value
        for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in f.samples
        if s.name.startswith(obs.ROUTER_ITL)
    }
    first = next(b for b in obs.ROUTER_ITL_BUCKETS if b >= 0.004)
    assert samples[(obs.ROUTER_ITL + "_bucket", str(first))] == 3
    assert samples[(obs.ROUTER_ITL + "_bucket", "+Inf")] == samples[(obs.ROUTER_ITL + "_count", None)] == 5
    assert abs(samples[(obs.ROUTER_ITL + "_sum", None)] - (0.012 + 0.03 + 99.0)) < 1e-9
    counts = [samples[(obs.ROUTER_ITL + "_bucket", str(b))] for b in obs.ROUTER_ITL_BUCKETS]
    assert counts == sorted(counts) and counts[-1] == 4  # cumulative
