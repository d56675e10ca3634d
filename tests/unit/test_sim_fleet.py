"""The fleet simulator: calibration against the profile, conservation, determinism, GPU
accounting, and its Prometheus emulation."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from pdcluster import perf
from pdcluster.observability import Histogram
from pdcluster.sim.fleet import FleetConfig, simulate
from pdcluster.sim.policies import Static
from pdcluster.sim.scrapes import histogram_quantile, snapshot
from pdcluster.sim.trace import Trace

PROFILE = perf.load()
LINK_GBPS = 200.0


def trace(
    n: int, rate: float, seed: int = 1, isl: tuple[int, int] = (500, 8000), osl: tuple[int, int] = (20, 400)
):
    rng = random.Random(seed)
    t, arrival, inputs, outputs, blocks = 0.0, [], [], [], []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrival.append(t)
        inputs.append(rng.randint(*isl))
        outputs.append(rng.randint(*osl))
        # A few shared conversation prefixes, so that prefix caching has work to do.
        root = rng.randrange(20)
        blocks.append(tuple(root * 1000 + k for k in range(math.ceil(inputs[-1] / 512))))
    return Trace("synthetic", arrival, inputs, outputs, blocks)


def then(first: Trace, second: Trace, at_s: float) -> Trace:
    """`first`, then `second` from `at_s` on."""
    return Trace(
        f"{first.name}-then-{second.name}", [*first.arrival_s, *(at_s + t for t in second.arrival_s)],
        [*first.input_tokens, *second.input_tokens], [*first.output_tokens, *second.output_tokens],
        [*first.blocks, *second.blocks],
    )  # fmt: skip


class Scripted:
    """A policy that moves the fleet along a fixed schedule."""

    name = "scripted"
    interval_s = 20.0

    def __init__(self, start: tuple[int, int], steps: list[tuple[int, int]]) -> None:
        self.start, self.steps = start, list(steps)

    def initial(self) -> tuple[int, int]:
        return self.start

    def decide(self, now_s, fleet):
        return self.steps.pop(0) if self.steps else None


@pytest.mark.parametrize(("prompt", "output"), [(100, 2), (3000, 150), (16000, 40)])
def test_an_isolated_request_takes_exactly_the_profiles_time(prompt: int, output: int) -> None:
    single = Trace("one", [5.0], [prompt], [output], [()])
    result = simulate(single, PROFILE, Static(1, 1), FleetConfig(gpus=2, link_gbps=LINK_GBPS))
    d0, d1, d2 = PROFILE.decode_coef
    transfer_ms = PROFILE.kv_transfer_ms(prompt, LINK_GBPS)
    first_step_ms = d0 + d1 + d2 * prompt
    assert result.ttft_s[0] * 1000 == pytest.approx(
        PROFILE.prefill_one_ms(prompt) + transfer_ms + first_step_ms
    )
    # Tokens 2..n come one decode step apart; the KV grows by one token per step.
    steps = [d0 + d1 + d2 * (prompt + k) for k in range(1, output)]
    assert result.itl_s[0] * 1000 == pytest.approx(sum(steps) / len(steps))
    assert result.finished == [True]


def test_prompts_that_queue_together_are_prefilled_in_one_batch() -> None:
    # A long prompt keeps the one prefill engine busy; two short ones queue behind it.
    three = Trace("three", [1.0, 1.05, 1.05], [8000, 1000, 1000], [1, 2, 2], [(), (), ()])
    result = simulate(three, PROFILE, Static(1, 2), FleetConfig(gpus=3))
    a, b, c = PROFILE.prefill_coef
    batch_starts = 1.0 + PROFILE.prefill_one_ms(8000) / 1000
    batch_ms = a + 2 * (b * 1000 + c * 1000**2)
    rest_ms = PROFILE.kv_transfer_ms(1000, 200.0) + PROFILE.decode_step_ms(1, 1000)
    expected_ms = (batch_starts - 1.05) * 1000 + batch_ms + rest_ms
    assert result.ttft_s[1] * 1000 == pytest.approx(expected_ms)


def test_a_cached_prefix_skips_prefill_work() -> None:
    first = tuple(range(20))  # 10240 tokens in 20 blocks
    second = first[:12] + tuple(range(100, 108))  # the same conversation, a new turn
    pair = Trace("two", [1.0, 30.0], [10240, 10240], [2, 2], [first, second])
    result = simulate(pair, PROFILE, Static(1, 1), FleetConfig(gpus=2))
    a, b, c = PROFILE.prefill_coef
    cached = 12 * 512
    again_ms = a + b * (10240 - cached) + c * (10240**2 - cached**2)
    rest_ms = PROFILE.kv_transfer_ms(10240, 200.0) + PROFILE.decode_step_ms(1, 10240)
    assert result.ttft_s[1] * 1000 == pytest.approx(again_ms + rest_ms)
    assert result.ttft_s[1] < result.ttft_s[0]


def test_every_request_finishes_through_scale_ups_and_drains() -> None:
    busy = trace(1500, rate=12.0)
    policy = Scripted((2, 2), [(4, 3), (1, 1), (3, 2), (1, 4), (5, 1), (2, 2)])
    result = simulate(busy, PROFILE, policy, FleetConfig(gpus=8, startup_s=15.0))
    assert all(result.finished)
    assert not any(math.isnan(t) for t in result.ttft_s)
    assert all(t > 0 for t in result.ttft_s)
    assert len(result.decisions) == 6


def test_the_same_seed_gives_the_same_run() -> None:
    one = simulate(trace(800, 8.0, seed=3), PROFILE, Static(2, 2), FleetConfig(gpus=4))
    two = simulate(trace(800, 8.0, seed=3), PROFILE, Static(2, 2), FleetConfig(gpus=4))
    other = simulate(trace(800, 8.0, seed=4), PROFILE, Static(2, 2), FleetConfig(gpus=4))
    assert one.ttft_s == two.ttft_s and one.itl_s == two.itl_s and one.gpu_seconds == two.gpu_seconds
    assert one.ttft_s != other.ttft_s


def test_gpu_hours_count_starting_and_draining_engines() -> None:
    quiet = Trace("quiet", [1.0, 400.0], [100, 100], [2, 2], [(), ()])
    static = simulate(quiet, PROFILE, Static(3, 2), FleetConfig(gpus=8))
    assert static.gpu_seconds == pytest.approx(5 * static.end_s)
    grow = Scripted((1, 1), [(3, 1)])  # at 20 s: two more prefill engines start (60 s) and stay
    grown = simulate(quiet, PROFILE, grow, FleetConfig(gpus=8, startup_s=60.0))
    assert grown.gpu_seconds == pytest.approx(2 * grown.end_s + 2 * (grown.end_s - 20.0))


def test_no_more_gpus_are_held_than_the_cluster_has() -> None:
    busy = trace(600, 10.0)
    greedy = Scripted((2, 2), [(6, 6), (6, 6), (2, 6), (6, 2)])
    result = simulate(busy, PROFILE, greedy, FleetConfig(gpus=8, startup_s=10.0))
    assert max(row[5] for row in result.timeline) <= 8
    assert all(result.finished)


def test_observe_steps_is_observing_every_step() -> None:
    bounds = (0.005, 0.01, 0.0125, 0.02, 0.05)
    fast, slow = Histogram(bounds), Histogram(bounds)
    first, growth, steps, batch, fresh = 0.0061, 0.00037, 40, 7, 3
    fast.observe_steps(first, growth, steps, batch, fresh)
    for k in range(steps):
        for _ in range(batch - (fresh if k == 0 else 0)):
            slow.observe(first + growth * k)
    assert fast.counts == slow.counts
    assert fast.count == slow.count
    assert fast.sum == pytest.approx(slow.sum)


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    bounds = (0.1, 0.2, 0.5)
    assert histogram_quantile(0.5, bounds, [0, 10, 0, 0]) == pytest.approx(0.15)
    assert histogram_quantile(0.9, bounds, [10, 0, 0, 0]) == pytest.approx(0.09)
    assert histogram_quantile(0.99, bounds, [0, 0, 0, 5]) == 0.5  # +Inf: the last finite bound
    assert histogram_quantile(0.9, bounds, [0, 0, 0, 0]) is None


def test_policies_see_scraped_windows_not_exact_latencies() -> None:
    busy = trace(2000, 10.0)

    class Watch(Static):
        interval_s = 60.0
        seen: list = []

        def decide(self, now_s, fleet):
            self.seen.append(snapshot(fleet.scrapes, now_s, 120, 0.9))

    result = simulate(busy, PROFILE, Watch(2, 2), FleetConfig(gpus=4, scrape_s=15.0))
    seen = [s for s in Watch.seen if s is not None and s.request_rate > 0]
    assert len(seen) >= 3
    exact_p90 = perf.percentile([t * 1000 for t in result.ttft_s], 90)
    for s in seen:
        # Arrival rate within a window, from prompt tokens: near the trace's 10 req/s.
        assert 5.0 < s.request_rate < 16.0
        assert s.ttft_ms is not None and s.ttft_ms > 0
        # Histogram quantiles land on bucket-interpolated values, never the exact ones.
        assert s.ttft_ms != pytest.approx(exact_p90, rel=1e-9)
        assert s.prefill.ready == pytest.approx(2.0) and s.decode.ready == pytest.approx(2.0)
        assert 0 <= (s.prefix_hit_ratio or 0.0) < 1


def test_a_restarted_autoscaler_replays_the_same_run() -> None:
    """pdcluster through the simulator, its state stored as status JSON at every decision."""
    from pdcluster.api.v1alpha1 import AutoscalingState, PDClusterSpec
    from pdcluster.sim.policies import PDCluster

    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "prefill": {"replicas": 1, "maxReplicas": 7},
            "decode": {"replicas": 1, "maxReplicas": 7},
            "autoscaling": {"enabled": True, "gpuBudget": 8, "cooldownSeconds": 30},
        }
    )

    class Restarted(PDCluster):
        def decide(self, now_s, fleet):
            if self.state is not None:
                self.state = AutoscalingState.model_validate_json(self.state.model_dump_json())
            return super().decide(now_s, fleet)

    busy = trace(6000, 35.0, seed=9)
    live = simulate(busy, PROFILE, PDCluster(spec, PROFILE), FleetConfig(gpus=8, startup_s=30.0))
    again = simulate(busy, PROFILE, Restarted(spec, PROFILE), FleetConfig(gpus=8, startup_s=30.0))
    assert live.decisions, "the load should make the autoscaler act"
    assert live.decisions == again.decisions
    assert live.ttft_s == again.ttft_s


def test_the_engines_events_reuse_at_least_what_the_routers_guess_does() -> None:
    # Five conversations, a turn each every few seconds, on two prefill engines whose caches
    # hold ten 512-token blocks: too few for all of them, so engines evict what the guess
    # (which never sees an eviction) still counts on, and most prompts are held by neither
    # engine: there the events tie, and keeping a conversation on its engine still pays.
    rng = random.Random(3)
    arrival, inputs, outputs, blocks = [], [], [], []
    for turn in range(6):
        for conv in rng.sample(range(5), 5):
            arrival.append(turn * 5.0 + conv * 0.5)
            inputs.append((turn + 1) * 512)
            outputs.append(4)
            blocks.append(tuple(conv * 100 + k for k in range(turn + 1)))
    order = sorted(range(len(arrival)), key=arrival.__getitem__)
    chats = Trace(
        "chats", [arrival[i] for i in order], [inputs[i] for i in order], [outputs[i] for i in order],
        [blocks[i] for i in order],
    )  # fmt: skip
    small = dataclasses.replace(PROFILE, max_kv_tokens=10 * 512)
    reused = {
        router: simulate(chats, small, Static(2, 2), FleetConfig(gpus=4, router=router)).reused_tokens
        for router in ("least-loaded", "prefix-aware", "precise-prefix")
    }
    assert reused["precise-prefix"] >= reused["prefix-aware"] > reused["least-loaded"], reused


def test_a_flexible_fleet_moves_engines_between_roles_without_a_start_up() -> None:
    """At 20 s the split goes from 1:3 to 3:1 at the same size: two decode engines prefill
    at once, on the GPUs they hold, while their streams finish; a fixed-role fleet starts
    two new engines."""
    busy = trace(400, rate=6.0, osl=(200, 400))
    flexible = simulate(
        busy, PROFILE, Scripted((1, 3), [(3, 1)]), FleetConfig(gpus=8, startup_s=60.0, flexible=True)
    )
    fixed = simulate(busy, PROFILE, Scripted((1, 3), [(3, 1)]), FleetConfig(gpus=8, startup_s=60.0))
    assert all(flexible.finished) and all(fixed.finished)
    # Never more than the four engines' GPUs, and three prefill engines at the decision.
    assert max(row[5] for row in flexible.timeline) == 4
    assert next(t for t, p, *_ in flexible.timeline if p == 3) == 20.0
    assert max(row[5] for row in fixed.timeline) > 4  # new engines start beside the draining ones
    assert all(t >= 20.0 + 60.0 for t, p, *_ in fixed.timeline if p == 3)
    assert flexible.flips == 2 and fixed.flips == 0


def test_a_flipped_engine_shares_its_steps_while_its_old_role_drains() -> None:
    """One of two decode engines, each with a long stream, flips to prefill: its stream
    finishes there. The prompt it computes meanwhile shares its steps, as vLLM's scheduler
    runs both (the stream's token, then the prompt): the prompt takes its own time plus
    the stream's part of the step, and the stream waits one prompt's time for a token."""
    stream = Trace("flip", [1.0, 1.0, 30.0, 30.0], [100, 100, 8000, 8000], [10000, 10000, 2, 2], [()] * 4)
    script = Scripted((1, 2), [(2, 1)])  # decides at 20 s, mid-stream
    shared = simulate(stream, PROFILE, script, FleetConfig(gpus=3, flexible=True, link_gbps=LINK_GBPS))
    alone = simulate(stream, PROFILE, Static(2, 2), FleetConfig(gpus=4, link_gbps=LINK_GBPS))
    assert all(shared.finished) and shared.flips == 1
    assert max(row[5] for row in shared.timeline) == 3
    # The two prompts go one to each prefill engine: the flipped one carries the stream's
    # token in its step, a few ms, not a second prompt's time.
    prompt_s = PROFILE.prefill_one_ms(8000) / 1000.0
    slower = sorted(s - a for s, a in zip(shared.ttft_s[2:], alone.ttft_s[2:], strict=True))
    assert slower[0] == pytest.approx(0.0, abs=0.005) and 0.0 < slower[1] < prompt_s / 10
    # The stream on the flipped engine lost about one prompt's time, once.
    d0 = PROFILE.decode_coef[0] / 1000.0
    lost = max(s - a for s, a in zip(shared.itl_s[:2], alone.itl_s[:2], strict=True)) * 9999
    assert lost == pytest.approx(prompt_s - d0, rel=0.1)


def test_a_flipped_engine_removed_before_its_old_role_drains_gives_its_gpus_back_once() -> None:
    """A decode engine flips to prefill at 20 s and the pool shrinks at 40 s, taking the
    flipped engine while its stream still runs: its GPUs stay held until the stream is
    done, and are given back once."""
    streams = Trace("shrink", [1.0, 1.0], [100, 100], [10000, 10000], [(), ()])
    script = Scripted((1, 2), [(2, 1), (1, 1)])
    result = simulate(streams, PROFILE, script, FleetConfig(gpus=3, flexible=True))
    assert all(result.finished) and result.flips == 1
    held = [(t, gpus) for t, *_, gpus in result.timeline]
    assert max(g for _, g in held) == 3 and held[-1][1] == 2
    released = next(t for t, g in held if t > 40.0 and g == 2)
    assert released == pytest.approx(max(1.0 + itl * 9999 for itl in result.itl_s), rel=0.05)


def test_a_flexible_fleet_still_starts_pods_to_grow() -> None:
    quiet = Trace("quiet", [1.0, 400.0], [100, 100], [2, 2], [(), ()])
    grown = simulate(
        quiet, PROFILE, Scripted((1, 1), [(3, 1)]), FleetConfig(gpus=8, startup_s=60.0, flexible=True)
    )
    assert grown.gpu_seconds == pytest.approx(2 * grown.end_s + 2 * (grown.end_s - 20.0))


def test_the_flexible_law_moves_its_split_by_flips_when_prompts_grow() -> None:
    """Short prompts with long answers, then long prompts (none of them cached) with short
    ones, on four GPUs: the flexible law flips a decode engine to prefill, with no
    start-up, and has three prefill engines serving before the fixed-role law does."""
    from pdcluster.api.v1alpha1 import PDClusterSpec
    from pdcluster.sim.policies import FlexiblePDCluster, PDCluster

    short = trace(9000, rate=30.0, seed=5, isl=(200, 600), osl=(300, 600))
    long = trace(9000, rate=30.0, seed=6, isl=(6000, 10000), osl=(20, 50))
    uncached = Trace("long", long.arrival_s, long.input_tokens, long.output_tokens, [()] * len(long))
    shifted = then(short, uncached, short.arrival_s[-1])
    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "simulated"},
            "prefill": {"replicas": 2, "maxReplicas": 3},
            "decode": {"replicas": 2, "maxReplicas": 3},
            "autoscaling": {"enabled": True, "gpuBudget": 4, "intervalSeconds": 15, "windowSeconds": 30},
        }
    )
    flexible = simulate(
        shifted, PROFILE, FlexiblePDCluster(spec, PROFILE), FleetConfig(gpus=4, flexible=True)
    )
    fixed = simulate(shifted, PROFILE, PDCluster(spec, PROFILE), FleetConfig(gpus=4))
    assert all(flexible.finished) and all(fixed.finished)
    assert flexible.flips >= 1 and fixed.flips == 0
    assert max(row[5] for row in flexible.timeline) <= 4

    def three_prefill(result) -> float:
        return next(t for t, p, *_ in result.timeline if p == 3)

    assert three_prefill(flexible) < three_prefill(fixed)
    # No flapping: the split never moves back within a minute.
    splits = [(t, p) for t, p, _, _ in flexible.decisions]
    assert not any(
        c[1] == a[1] and c[0] - a[0] < 60 for a, _, c in zip(splits, splits[1:], splits[2:], strict=False)
    )


def test_a_flexible_pool_of_one_engine_serves_requests_whole() -> None:
    """At 20 s a 1:1 flexible pool goes to one engine: the decode engine leaves once its
    stream is done, and the prefill engine's GPU serves every later request whole, with no
    KV hand-off. At 40 s the pool grows again: a decode engine starts (60 s), and until it
    is ready the lone engine serves on."""
    requests = Trace("lone", [1.0, 25.0, 30.0, 70.0, 120.0], [100, *[4000] * 4], [400, 2, 2, 2, 2], [()] * 5)
    slow_link = 1.0  # Gb/s: a hand-off of 4000 tokens would take seconds
    script = Scripted((1, 1), [(1, 0), (1, 1)])  # decides at 20 s and 40 s
    alone = simulate(requests, PROFILE, script, FleetConfig(gpus=2, flexible=True, link_gbps=slow_link))
    pair = simulate(requests, PROFILE, Static(1, 1), FleetConfig(gpus=2, link_gbps=slow_link))
    assert all(alone.finished) and alone.flips == 0
    held = [(t, gpus) for t, *_, gpus in alone.timeline]
    assert min(g for t, g in held if 20.0 <= t < 40.0) == 1  # the decode engine gave its GPU back
    ready = [(t, p, d) for t, p, d, *_ in alone.timeline]
    assert all(d == 0 for t, _, d in ready if 20.0 < t < 100.0)  # the decode half is no pod
    assert any(d == 1 for t, _, d in ready if t >= 100.0)  # the new decode engine, 60 s after 40 s
    handoff_s = PROFILE.kv_transfer_ms(4000, slow_link) / 1000.0
    for i in (1, 2, 3):  # served whole: no hand-off in their time to first token
        assert alone.ttft_s[i] < pair.ttft_s[i] - handoff_s / 2
    assert alone.ttft_s[4] == pytest.approx(pair.ttft_s[4])  # a pair again, hand-off and all


def test_the_flexible_law_runs_a_quiet_pool_on_one_engine_and_grows_it_with_the_load() -> None:
    """Twenty minutes of a request every 5 s, then 30 requests/s: the flexible law, whose
    pool may shrink to one engine (decode.minReplicas 0), serves the quiet part on one
    engine once its scale-down stabilization is over, and has a decode engine again once
    the load comes; the fixed-role law holds 1:1 throughout."""
    from pdcluster.api.v1alpha1 import PDClusterSpec
    from pdcluster.sim.policies import FlexiblePDCluster, PDCluster

    quiet = trace(240, rate=0.2, seed=7, isl=(200, 800), osl=(50, 150))
    busy = trace(3000, rate=30.0, seed=8, isl=(500, 3000), osl=(50, 300))
    start = quiet.arrival_s[-1] + 5.0
    load = then(quiet, busy, start)
    spec = PDClusterSpec.model_validate(
        {
            "model": {"name": "simulated"},
            "prefill": {"replicas": 1, "maxReplicas": 4},
            "decode": {"replicas": 1, "maxReplicas": 4},
            "autoscaling": {"enabled": True, "gpuBudget": 6, "intervalSeconds": 15, "windowSeconds": 60},
        }
    )
    flexible = simulate(load, PROFILE, FlexiblePDCluster(spec, PROFILE), FleetConfig(gpus=6, flexible=True))
    fixed = simulate(load, PROFILE, PDCluster(spec, PROFILE), FleetConfig(gpus=6))
    assert all(flexible.finished) and all(fixed.finished)
    lone = [t for t, p, d, _ in flexible.decisions if (p, d) == (1, 0)]
    assert lone and lone[0] < start, flexible.decisions
    why = next(r for t, *_, r in flexible.decisions if t == lone[0])
    assert why.endswith("one engine serves requests whole (decode.minReplicas 0)"), why
    stabilization = spec.autoscaling.scale_down_stabilization_seconds
    assert lone[0] >= stabilization  # not before the wish to scale down has lasted
    regrown = [t for t, p, d, _ in flexible.decisions if t > start and d >= 1]
    assert regrown and regrown[0] < start + 60.0
    # One GPU from the decode engine's last stream to the load.
    held = [(t, gpus) for t, *_, gpus in flexible.timeline if lone[0] <= t < start]
    alone = next(t for t, g in held if g == 1)
    assert alone < lone[0] + 60.0 and all(g == 1 for t, g in held if t >= alone)
    assert min(row[5] for row in fixed.timeline) == 2
    assert flexible.gpu_seconds < fixed.gpu_seconds
