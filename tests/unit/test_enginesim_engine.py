"""The simulated engine core: batching, KV accounting, stop rules, prefill hold."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pdcluster.enginesim import engine as engine_module
from pdcluster.enginesim.engine import EngineCore, KvLoadError, RemotePrefill, Seq, State
from pdcluster.enginesim.vllm_metrics import EngineMetrics, MetricFamilies
from pdcluster.perf import Profile

# 10 ms + 0.01 ms/token prefill, 5 ms decode steps; run 10x faster than real time.
PROFILE = Profile("test", (10.0, 0.01, 0.0), (5.0, 0.0, 0.0), max_kv_tokens=10_000, kv_bytes_per_token=100)
SCALE = 10.0
WaitUntil = Callable[..., Awaitable[Any]]


def make_core(profile: Profile = PROFILE, **kwargs: object) -> tuple[EngineCore, MetricFamilies]:
    families = MetricFamilies(max_model_len=8192)
    core = EngineCore(profile, EngineMetrics(families, "m", 0), time_scale=SCALE, **kwargs)  # type: ignore[arg-type]
    core.start()
    return core, families


def sample(families: MetricFamilies, name: str, **labels: str) -> float:
    value = families.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})
    return value or 0.0


async def finish(seq: Seq, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not seq.finished:
            await seq.wait()


class ModelClock:
    """The engine's clock and sleeps, in model time: a sleep moves the clock on at once,
    so a test sees how long the engine means to wait, whatever the machine's load
    (benchmarks/enginesim_calibration.py measures how close real time gets)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)
        await asyncio.sleep(0)


@pytest.fixture
def model_clock(monkeypatch: pytest.MonkeyPatch) -> ModelClock:
    clock = ModelClock()
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    public = {name: getattr(asyncio, name) for name in dir(asyncio) if not name.startswith("_")}
    monkeypatch.setattr(engine_module, "asyncio", types.SimpleNamespace(**{**public, "sleep": clock.sleep}))
    return clock


async def test_a_request_prefills_then_decodes_to_its_length(model_clock: ModelClock) -> None:
    core, families = make_core()
    seq = Seq(1000, 4)
    core.submit(seq)
    await finish(seq)
    # 1 prefill step (10 ms + 1000 x 0.01 ms) + 3 decode steps (5 ms each), at 10x.
    assert model_clock.now == pytest.approx((20 + 3 * 5) / 1000 / SCALE)
    assert sample(families, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.020 / SCALE)
    assert sample(families, "vllm:iteration_tokens_total_count") == 4
    assert (seq.generated, seq.finish_reason) == (4, "length")
    assert core.kv_used == 0
    assert sample(families, "vllm:request_success_total", finished_reason="length") == 1
    assert sample(families, "vllm:prompt_tokens_total") == 1000
    assert (
        sample(families, "vllm:generation_tokens_total") == 3
    )  # decode steps; the first token comes from prefill
    await core.stop()


@pytest.mark.parametrize(
    ("max_tokens", "min_tokens", "eos_at", "generated", "reason"),
    [
        (10, 0, 3, 3, "stop"),
        (10, 5, 3, 6, "stop"),  # min_tokens masks EOS for the first 5 tokens
        (2, 0, 3, 2, "length"),
        (1, 0, 1, 1, "stop"),  # EOS is checked before the length cap
        (1, 1, 1, 1, "length"),  # the router's prefill request: min_tokens=1 keeps it length-capped
        (6, 0, None, 6, "length"),
    ],
)
async def test_stop_rules(
    max_tokens: int, min_tokens: int, eos_at: int | None, generated: int, reason: str
) -> None:
    core, _ = make_core()
    seq = Seq(10, max_tokens, min_tokens=min_tokens, eos_at=eos_at)
    core.submit(seq)
    await finish(seq)
    assert (seq.generated, seq.finish_reason) == (generated, reason)
    await core.stop()


async def test_continuous_batching_shares_decode_steps() -> None:
    core, families = make_core()
    seqs = [Seq(100, 20) for _ in range(8)]
    for seq in seqs:
        core.submit(seq)
    await asyncio.gather(*(finish(s) for s in seqs))
    # One prefill step for all eight, then 19 shared decode steps.
    steps = families.registry.get_sample_value(
        "vllm:iteration_tokens_total_count", {"model_name": "m", "engine": "0"}
    )
    assert steps == 20
    await core.stop()


async def test_kv_capacity_queues_requests(wait_until: WaitUntil) -> None:
    profile = Profile("small", (1.0, 0.0, 0.0), (1.0, 0.0, 0.0), max_kv_tokens=1000, kv_bytes_per_token=1)
    core, families = make_core(profile)
    first, second = Seq(700, 250), Seq(400, 5)
    core.submit(first)
    core.submit(second)
    await wait_until(lambda: first.state is State.RUNNING, interval=0.001, message="the first running")
    assert second.state is State.WAITING
    assert sample(families, "vllm:num_requests_waiting") == 1
    await finish(second)
    assert first.finished and first.finish_reason == "length"
    assert core.kv_used == 0
    await core.stop()


async def test_decode_growth_preempts_the_newest_sequence() -> None:
    profile = Profile("small", (1.0, 0.0, 0.0), (1.0, 0.0, 0.0), max_kv_tokens=130, kv_bytes_per_token=1)
    core, families = make_core(profile)
    seqs = [Seq(50, 30), Seq(50, 30)]  # 200 tokens of KV at the end: one must yield
    for seq in seqs:
        core.submit(seq)
    await asyncio.gather(*(finish(s) for s in seqs))
    assert [s.generated for s in seqs] == [30, 30]
    assert sample(families, "vllm:num_preemptions_total") >= 1
    assert core.kv_used == 0
    await core.stop()


async def test_long_prompts_are_chunked_by_the_token_budget() -> None:
    core, families = make_core(max_num_batched_tokens=1000)
    seq = Seq(3500, 1)
    core.submit(seq)
    await finish(seq)
    assert (
        families.registry.get_sample_value(
            "vllm:iteration_tokens_total_count", {"model_name": "m", "engine": "0"}
        )
        == 4
    )
    await core.stop()


async def test_prefill_hold_keeps_kv_until_released() -> None:
    held: list[tuple[str, int, bool]] = []
    core, _ = make_core(on_prefilled=lambda tid, seq, kept: held.append((tid, seq.kv, kept)))
    kept, stopped = Seq(500, 1, hold_transfer_id="x1"), Seq(500, 5, eos_at=1, hold_transfer_id="x2")
    core.submit(kept)
    core.submit(stopped)
    await asyncio.gather(finish(kept), finish(stopped))
    assert sorted(held) == [("x1", 501, True), ("x2", 501, False)]
    assert core.kv_used == 501  # only the length-capped prefill keeps its blocks
    core.release_held(501)
    assert core.kv_used == 0
    await core.stop()


async def test_abort_frees_everything(wait_until: WaitUntil) -> None:
    core, families = make_core()
    seqs = [Seq(100, 10_000), Seq(100, 10_000)]
    for seq in seqs:
        core.submit(seq)
    await wait_until(lambda: all(s.state is State.RUNNING for s in seqs), interval=0.001, message="both running")
    for seq in seqs:
        core.abort(seq)
    assert all(s.finish_reason == "abort" for s in seqs)
    assert core.kv_used == 0 and core.load == 0
    assert sample(families, "vllm:request_success_total", finished_reason="abort") == 2
    await core.stop()


@pytest.mark.parametrize(("recompute", "reason"), [(False, "error"), (True, "length")])
async def test_failed_kv_load(recompute: bool, reason: str) -> None:
    async def pull(seq: Seq) -> None:
        raise KvLoadError("no such transfer")

    core, families = make_core(pull_kv=pull, recompute_on_load_failure=recompute)
    seq = Seq(100, 3, remote=RemotePrefill("e", "http://p:8998", "x"))
    core.submit(seq)
    await finish(seq)
    assert seq.finish_reason == reason
    assert sample(families, "vllm:mooncake_num_failed_recvs_total") == 1
    assert core.kv_used == 0
    await core.stop()


async def test_remote_prefill_waits_for_the_pull_then_decodes(wait_until: WaitUntil) -> None:
    release = asyncio.Event()

    async def pull(seq: Seq) -> None:
        await release.wait()

    core, families = make_core(pull_kv=pull)
    seq = Seq(2000, 3, remote=RemotePrefill("e", "http://p:8998", "x"))
    core.submit(seq)
    await wait_until(lambda: seq.state is State.FETCHING, interval=0.001, message="fetching")
    assert seq.generated == 0 and core.kv_used == 2000
    release.set()
    await finish(seq)
    assert seq.generated == 3
    assert sample(families, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 2000
    assert sample(families, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    await core.stop()
