"""The colocated engine model: an isolated request takes exactly the profile's time
(chunked where the prompt exceeds the token budget), a prompt sharing steps with a
stream slows it by exactly its work, and nothing is lost."""

from __future__ import annotations

import math
import random

import pytest

from pdcluster import perf
from pdcluster.sim.colocated import ColocatedConfig, simulate_colocated
from pdcluster.sim.trace import Trace

PROFILES = ["h200-llama3.1-8b", "distserve-vllm-opt-13b-tp1"]


def one(prompt: int, output: int) -> Trace:
    return Trace("one", [2.0], [prompt], [output], [()])


def decode_ms(profile: perf.Profile, batch: int, kv: int) -> float:
    d0, d1, d2 = profile.decode_coef
    return d0 + d1 * batch + d2 * kv


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize(("prompt", "output"), [(100, 2), (3000, 150), (8192, 40)])
def test_an_isolated_request_within_the_budget_takes_the_profiles_time(
    name: str, prompt: int, output: int
) -> None:
    profile = perf.load(name)
    result = simulate_colocated(one(prompt, output), profile, ColocatedConfig(engines=1))
    assert result.ttft_s[0] * 1000 == pytest.approx(profile.prefill_one_ms(prompt))
    # Tokens 2..n: one decode step each, over the prompt and the tokens so far.
    steps = [decode_ms(profile, 1, prompt + k) for k in range(1, output)]
    assert result.itl_s[0] * 1000 == pytest.approx(sum(steps) / len(steps))
    assert result.finished == [True]


@pytest.mark.parametrize("budget", [2048, 8192])
def test_a_prompt_over_the_budget_is_computed_in_chunks_each_paying_the_fixed_part(budget: int) -> None:
    profile = perf.load()
    prompt = 20000
    result = simulate_colocated(
        one(prompt, 1), profile, ColocatedConfig(engines=1, max_batched_tokens=budget)
    )
    chunks = math.ceil(prompt / budget)
    a = profile.prefill_coef[0]
    assert result.ttft_s[0] * 1000 == pytest.approx(profile.prefill_one_ms(prompt) + (chunks - 1) * a)
    # Smaller chunks: more fixed parts, so a longer TTFT (the price of chunked prefill).
    assert result.ttft_s[0] * 1000 > profile.prefill_one_ms(prompt)


def test_a_prompt_sharing_steps_with_a_stream_slows_it_by_exactly_its_work() -> None:
    """Request 0 streams alone; request 1 (a 6000-token prompt, one output token more)
    arrives meanwhile: its whole prompt rides in one of request 0's steps and its one
    decode in the next."""
    profile = perf.load()
    a, b, c = profile.prefill_coef
    d0, d1, d2 = profile.decode_coef
    alone = simulate_colocated(one(1000, 200), profile, ColocatedConfig(engines=1))
    both = Trace("two", [2.0, 2.5], [1000, 6000], [200, 2], [(), ()])
    shared = simulate_colocated(both, profile, ColocatedConfig(engines=1))
    slower_ms = (shared.itl_s[0] - alone.itl_s[0]) * 199 * 1000
    prompt_step = max(a, d0) - d0 + b * 6000 + c * 6000**2
    decode_step = d1 + d2 * 6001  # request 1's second token: one sequence more, its KV
    assert slower_ms == pytest.approx(prompt_step + decode_step, rel=1e-9)


def test_a_shared_prefix_is_not_computed_twice() -> None:
    profile = perf.load()
    blocks = tuple(range(20))  # 20 x 512 tokens
    trace = Trace("again", [1.0, 30.0], [10240, 10240], [2, 2], [blocks, blocks])
    result = simulate_colocated(trace, profile, ColocatedConfig(engines=2))
    assert result.reused_tokens == 10239  # all but the last token, on the same engine
    assert result.ttft_s[1] < result.ttft_s[0] / 10


def test_a_loaded_fleet_finishes_every_request_deterministically() -> None:
    rng = random.Random(3)
    n, t = 400, 0.0
    arrival, inputs, outputs = [], [], []
    for _ in range(n):
        t += rng.expovariate(20.0)
        arrival.append(t)
        inputs.append(rng.randint(100, 30000))
        outputs.append(rng.randint(1, 300))
    trace = Trace("load", arrival, inputs, outputs, [()] * n)
    config = ColocatedConfig(engines=4, max_batched_tokens=2048)
    first = simulate_colocated(trace, perf.load(), config)
    assert all(first.finished)
    assert all(ttft > 0 for ttft in first.ttft_s)
    # Every first token comes after the isolated prefill time: nobody computes faster.
    assert all(first.ttft_s[i] * 1000 >= perf.load().prefill_one_ms(inputs[i]) - 1e-6 for i in range(n))
    assert first.gpu_seconds == pytest.approx(4 * first.end_s)
    again = simulate_colocated(trace, perf.load(), config)
    assert again.ttft_s == first.ttft_s and again.itl_s == first.itl_s


def test_a_request_larger_than_the_kv_cache_still_runs_alone() -> None:
    profile = perf.load("distserve-vllm-opt-13b-tp1")  # about 56k KV tokens
    big = Trace("big", [1.0, 1.1], [60000, 500], [3, 3], [(), ()])
    result = simulate_colocated(big, profile, ColocatedConfig(engines=1))
    assert result.finished == [True, True]
    assert result.ttft_s[1] > result.ttft_s[0] - 0.1  # it waited for the big one's KV


def test_a_lower_step_fixed_part_keeps_an_isolated_ttft_and_frees_engine_time() -> None:
    """With the fixed part at d0, the rest of a is the request's latency on its way in:
    alone it sees the profile's TTFT, in either model; and each prompt step costs the
    engine (a - d0) less."""
    from pdcluster.sim.fleet import FleetConfig, simulate
    from pdcluster.sim.policies import Static

    profile = perf.load()
    a, d0 = profile.prefill_coef[0], profile.decode_coef[0]
    alone = one(3000, 1)
    for fixed in (None, d0):
        colocated = simulate_colocated(alone, profile, ColocatedConfig(engines=1, prefill_fixed_ms=fixed))
        assert colocated.ttft_s[0] * 1000 == pytest.approx(profile.prefill_one_ms(3000))
    disaggregated = [
        simulate(alone, profile, Static(1, 1), FleetConfig(gpus=2, prefill_fixed_ms=fixed))
        for fixed in (None, d0)
    ]
    assert disaggregated[0].ttft_s == pytest.approx(disaggregated[1].ttft_s)
    # A long prompt holds the engine; two short ones behind it share the next step.
    three = Trace("three", [1.0, 1.05, 1.05], [8000, 1000, 1000], [1, 1, 1], [(), (), ()])
    runs = [
        simulate(three, profile, Static(1, 1), FleetConfig(gpus=2, prefill_fixed_ms=f)) for f in (None, d0)
    ]
    saved_ms = (runs[0].prefill_gpu_seconds - runs[1].prefill_gpu_seconds) * 1000
    assert saved_ms == pytest.approx(2 * (a - d0), rel=1e-6)  # two batches
    co = [
        simulate_colocated(three, profile, ColocatedConfig(engines=1, prefill_fixed_ms=f)) for f in (None, d0)
    ]
    assert co[0].ttft_s[0] == pytest.approx(co[1].ttft_s[0])
    assert (co[0].ttft_s[1] - co[1].ttft_s[1]) * 1000 == pytest.approx(a - d0, rel=1e-6)


def poisson(rng: random.Random, rates: list[tuple[float, float]], prompt: int, output: int) -> Trace:
    """Arrivals at each (seconds, requests/s) phase in turn."""
    arrival, t, start = [], 0.0, 0.0
    for seconds, rate in rates:
        while True:
            t += rng.expovariate(rate)
            if t >= start + seconds:
                t = start + seconds
                break
            arrival.append(t)
        start += seconds
    n = len(arrival)
    return Trace("phases", arrival, [prompt] * n, [output] * n, [()] * n)


def test_the_pool_law_sizes_a_simulated_colocated_fleet_up_and_back_down() -> None:
    """The operator's law (control/pool.py) on the colocated fleet: a load four times
    what one engine serves within the SLO, between two quiet phases."""
    from pdcluster.api.v1alpha1 import PDClusterSpec

    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "mode": "colocated",
            "colocated": {"replicas": 1, "minReplicas": 1, "maxReplicas": 8},
            "autoscaling": {
                "enabled": True,
                "slo": {"ttftMs": 1000, "itlMs": 25},
                "intervalSeconds": 15,
                "windowSeconds": 30,
                "scaleDownStabilizationSeconds": 60,
                "cooldownSeconds": 15,
            },
        }
    )
    trace = poisson(random.Random(3), [(120, 1.0), (300, 24.0), (480, 1.0)], 4000, 200)
    profile = perf.load()
    dynamic = simulate_colocated(trace, profile, ColocatedConfig(engines=1, autoscaling=spec, startup_s=30))
    static = simulate_colocated(trace, profile, ColocatedConfig(engines=1))
    assert all(dynamic.finished)
    peak = max(row[3] for row in dynamic.timeline)
    assert peak >= 3, dynamic.decisions
    assert dynamic.timeline[-1][3] < peak, "never scaled back down"
    # The engines' queues (vLLM's num_requests_waiting, as the operator reads it) size
    # the first steps of the burst.
    assert {cause for _, _, _, cause in dynamic.decisions} >= {"QueueGrowing", "PoolHeadroom"}

    def within(result: object) -> int:
        return sum(
            t <= 1.0 and (i <= 0.025 or o <= 1)
            for t, i, o in zip(result.ttft_s, result.itl_s, trace.output_tokens, strict=True)  # type: ignore[attr-defined]
        )

    assert within(dynamic) > 1.5 * within(static)
    # Fewer GPU-seconds than holding the peak for the whole trace.
    assert dynamic.gpu_seconds < peak * dynamic.end_s


def test_the_law_reads_the_series_the_engines_and_the_router_export() -> None:
    """The fleet exports the contract's series (pdcluster.series) as counters, histograms
    and gauges, and the law reads them only through the scrapes' window evaluator, as
    the operator reads Prometheus: every request is counted once, the ITL histogram
    holds every token gap and the TPOT histogram every stream's mean, and each window the
    law read had every field it sizes on."""
    from pdcluster.api.v1alpha1 import PDClusterSpec
    from pdcluster.sim import colocated as C
    from pdcluster.sim import scrapes as M

    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "mode": "colocated",
            "colocated": {"replicas": 1, "minReplicas": 1, "maxReplicas": 6},
            "autoscaling": {"enabled": True, "slo": {"ttftMs": 500, "itlMs": 25}, "intervalSeconds": 15},
        }
    )
    rng = random.Random(5)
    arrival = sorted(rng.uniform(0, 600) for _ in range(3000))
    inputs = [rng.choice([50, 900, 4000, 12000]) for _ in arrival]
    outputs = [rng.choice([1, 2, 40, 300]) for _ in arrival]
    trace = Trace("mixed", arrival, inputs, outputs, [()] * len(arrival))
    seen = []

    class Reading(C.ColocatedFleet):
        def control(self) -> None:
            auto = spec.autoscaling
            seen.append(M.snapshot(self.scrapes, self.now, auto.window_seconds, auto.slo.quantile.fraction))
            super().control()

    fleet = Reading(trace, perf.load(), C.ColocatedConfig(engines=1, autoscaling=spec, startup_s=30))
    result = fleet.run()
    assert all(result.finished)
    n = len(trace)
    assert fleet.counters[M.ROUTER_PROMPT_TOKENS] == fleet.counters[C.PROMPT_TOKENS] == sum(inputs)
    assert fleet.counters[M.ROUTER_FINISHED] == fleet.counters[C.SUCCESS] == n
    assert fleet.counters[M.ROUTER_GENERATION_TOKENS] == sum(outputs)
    for name in (M.ROUTER_TTFT, C.TTFT, C.QUEUE_TIME):
        assert fleet.hist[name].count == n
    gaps = sum(out - 1 for out in outputs)
    streamed = sum(
        (f - t) for f, t, out in zip(fleet.finish, fleet.first_token, outputs, strict=True) if out > 1
    )
    for name in (M.ROUTER_ITL, C.ITL):
        assert fleet.hist[name].count == gaps
        assert fleet.hist[name].sum == pytest.approx(streamed)  # the gaps add up to each stream
    # Each stream's mean time per output token, once per stream: its mean ITL as scored.
    streams = [itl for itl, out in zip(result.itl_s, outputs, strict=True) if out > 1]
    assert fleet.hist[M.ROUTER_TPOT].count == len(streams)
    assert fleet.hist[M.ROUTER_TPOT].sum == pytest.approx(sum(streams))
    # Each window after the first minute held arrivals, first tokens and finishes.
    read = [s for s in seen[4:] if s is not None and s.request_rate > 0]
    assert len(read) > 20
    for s in read:
        pool = s.colocated
        assert None not in (s.ttft_ms, s.itl_ms, s.tpot_ms, pool.ttft_ms, pool.itl_ms, pool.queue_time_q_ms)
        assert None not in (pool.tokens_per_s, pool.ready, pool.waiting, pool.kv_usage)
    mean_rate = sum(s.request_rate for s in read) / len(read)
    assert mean_rate == pytest.approx(n / 600, rel=0.15)
