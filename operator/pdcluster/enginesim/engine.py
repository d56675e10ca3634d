"""One simulated vLLM engine core: continuous batching on a latency profile.

Each step the scheduler (like vLLM V1's) first gives every running sequence one decode
token, then fills the rest of the token budget (`max_num_batched_tokens`) with prefill
chunks of admitted sequences in arrival order. Step time comes from the profile:

    decode part   d0 + d1 * batch + d2 * kv_tokens          (Profile.decode_step_ms)
    prefill part  a + sum over chunks [s, s+n) of  b * n + c * ((s+n)^2 - s^2)

The prefill part is Profile.prefill_ms for unchunked prompts, and a prompt split into
chunks costs the same as one pass plus one step overhead per extra chunk (attention
over the earlier chunks is the quadratic term). A mixed step costs the sum of both.
All times are divided by `time_scale`.

KV: a sequence holds its prompt's tokens from admission and one more per generated
token; admission is first-come-first-served while the prompt fits, and when decoding
outgrows the capacity the newest sequence is preempted and later recomputed (vLLM's
recompute preemption). A prefill-role sequence that ends by length keeps its KV until
decode has pulled it (see kv/transfers.py).

Steps are timed against a planned clock: each step ends `dt` after the previous planned
end, so timer jitter does not add up, and a step that finds the loop behind by more than
`_MAX_LAG_S` resynchronises (the process is overloaded).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdcluster.enginesim.prefix import PrefixCache
from pdcluster.enginesim.vllm_metrics import EngineMetrics
from pdcluster.perf import Profile
from pdcluster.vllm import defaults

log = logging.getLogger(__name__)

_MAX_LAG_S = 0.005
_EARLY_S = 0.0002


class State(enum.Enum):
    WAITING = 1
    PREFILLING = 2
    FETCHING = 3  # waiting for remote KV (vLLM: WAITING_FOR_REMOTE_KVS)
    RUNNING = 4
    FINISHED = 5


class KvLoadError(Exception):
    """Decode could not get the prefill's KV."""


@dataclass(frozen=True)
class RemotePrefill:
    """Decode side: where this request's KV comes from."""

    engine_id: str
    bootstrap_addr: str
    transfer_id: str


class Seq:
    """One request inside the engine."""

    __slots__ = (
        "admitted_at",
        "arrival",
        "cached",
        "computed",
        "eos_at",
        "fetch_task",
        "finish_reason",
        "first_token_at",
        "generated",
        "hold_transfer_id",
        "kv",
        "last_token_at",
        "max_tokens",
        "min_tokens",
        "prompt_tokens",
        "remote",
        "state",
        "stored",
        "streaming",
        "waiter",
    )

    def __init__(
        self,
        prompt_tokens: int,
        max_tokens: int,
        *,
        min_tokens: int = 0,
        eos_at: int | None = None,
        remote: RemotePrefill | None = None,
        hold_transfer_id: str | None = None,
        stored: int = 0,
        cached: int = 0,
    ):
        self.prompt_tokens = prompt_tokens
        self.stored = stored  # prompt tokens loaded from the KV store: not computed
        self.cached = cached  # prompt tokens in the engine's own prefix cache: not computed
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.eos_at = eos_at  # natural length; None never stops on EOS
        self.remote = remote
        self.hold_transfer_id = hold_transfer_id  # prefill side: keep KV for this transfer
        self.state = State.WAITING
        self.computed = 0  # prompt tokens prefilled so far (local prefill)
        self.generated = 0
        self.kv = 0  # KV tokens held
        self.arrival = 0.0
        self.admitted_at = 0.0
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.finish_reason: str | None = None
        self.streaming = False  # wake the reader on every token, not only at the end
        self.waiter: asyncio.Future[None] | None = None
        self.fetch_task: asyncio.Task[None] | None = None

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    async def wait(self) -> None:
        """Until a new token arrives or the sequence ends."""
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter

    def _notify(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


# Called for a prefill-role sequence that ended: (transfer_id, seq, kept KV?).
TransferHook = Callable[[str, Seq, bool], None]
# Pulls a decode sequence's KV from its prefill engine; raises KvLoadError.
KvPull = Callable[[Seq], Awaitable[None]]


class EngineCore:
    def __init__(
        self,
        profile: Profile,
        metrics: EngineMetrics,
        *,
        time_scale: float = 1.0,
        max_num_seqs: int = defaults.MAX_NUM_SEQS,
        max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS,
        max_model_len: int = 131072,
        recompute_on_load_failure: bool = False,
        pull_kv: KvPull | None = None,
        on_prefilled: TransferHook | None = None,
    ):
        self.profile = profile
        self.metrics = metrics
        self.time_scale = time_scale
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.capacity = profile.max_kv_tokens
        self.recompute_on_load_failure = recompute_on_load_failure
        self.pull_kv = pull_kv
        self.on_prefilled = on_prefilled
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.fetching: set[Seq] = set()
        self.decoding: list[Seq] = []
        self.prefix: PrefixCache | None = None  # with --enable-prefix-caching
        self.kv_used = 0  # includes KV held for transfers
        self._decode_kv = 0  # KV tokens of self.decoding
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ interface
    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.fetching) + len(self.decoding)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, seq: Seq) -> None:
        seq.arrival = time.monotonic()
        self.waiting.append(seq)
        m = self.metrics
        m.request_max_tokens.observe(seq.max_tokens)
        self._wake.set()

    def abort(self, seq: Seq) -> None:
        """The client went away: drop the sequence wherever it is."""
        if seq.finished:
            return
        if seq.state is State.WAITING:
            self.waiting.remove(seq)
        elif seq.state is State.PREFILLING:
            self.prefilling.remove(seq)
        elif seq.state is State.FETCHING:
            self.fetching.discard(seq)
            if seq.fetch_task is not None:
                seq.fetch_task.cancel()
        elif seq.state is State.RUNNING:
            self.decoding.remove(seq)
            self._decode_kv -= seq.kv
        self._finish(seq, "abort", time.monotonic())
        self._wake.set()

    def release_held(self, tokens: int) -> None:
        """Prefill side: KV kept for a transfer is no longer needed."""
        self.kv_used -= tokens
        self._wake.set()

    # ------------------------------------------------------------------ scheduling
    def _admit(self, now: float) -> None:
        active = len(self.prefilling) + len(self.fetching) + len(self.decoding)
        while self.waiting and active < self.max_num_seqs:
            seq = self.waiting[0]
            need = seq.prompt_tokens + seq.generated
            if self.kv_used + need > self.capacity:
                break
            self.waiting.popleft()
            self.kv_used += need
            seq.kv = need
            if not seq.admitted_at:
                # vLLM looks each new request up in its prefix cache (prefix.py).
                self.metrics.prefix_queries.inc(seq.prompt_tokens)
                self.metrics.prefix_hits.inc(seq.cached)
                # vLLM asks its own cache first, the connector for what follows.
                external = max(seq.stored - seq.cached, 0)
                if seq.cached:
                    self.metrics.prompt_by_source["local_cache_hit"].inc(seq.cached)
                    self.metrics.prompt_tokens.inc(seq.cached)
                if external:
                    self.metrics.prompt_by_source["external_kv_transfer"].inc(external)
                    self.metrics.prompt_tokens.inc(external)
            seq.admitted_at = seq.admitted_at or now
            active += 1
            if seq.remote is not None and self.pull_kv is not None:
                seq.state = State.FETCHING
                self.fetching.add(seq)
                seq.fetch_task = asyncio.get_running_loop().create_task(self._fetch(seq))
            else:
                seq.state = State.PREFILLING
                seq.computed = max(seq.stored, seq.cached)
                self.prefilling.append(seq)

    async def _fetch(self, seq: Seq) -> None:
        assert self.pull_kv is not None
        try:
            await self.pull_kv(seq)
        except KvLoadError as e:
            if seq.state is not State.FETCHING:
                return
            self.metrics.failed_recvs.inc()
            self.fetching.discard(seq)
            if self.recompute_on_load_failure:
                log.warning("KV load failed (%s); recomputing locally", e)
                seq.state = State.PREFILLING
                seq.computed = 0
                self.prefilling.append(seq)
            else:
                log.warning("KV load failed: %s", e)
                self._finish(seq, "error", time.monotonic())
            self._wake.set()
            return
        if seq.state is not State.FETCHING:
            return
        self.fetching.discard(seq)
        self.metrics.prompt_by_source["external_kv_transfer"].inc(seq.prompt_tokens)
        self.metrics.prompt_tokens.inc(seq.prompt_tokens)
        self._start_decoding(seq)
        self._wake.set()

    def _start_decoding(self, seq: Seq) -> None:
        seq.state = State.RUNNING
        self.decoding.append(seq)
        self._decode_kv += seq.kv

    def _preempt_for_growth(self) -> None:
        while self.decoding and self.kv_used + len(self.decoding) > self.capacity:
            victim = self.decoding.pop()
            self._decode_kv -= victim.kv
            self.kv_used -= victim.kv
            victim.kv = 0
            victim.state = State.WAITING
            victim.remote = None  # its KV is gone; recompute prompt and output locally
            victim.stored = victim.cached = 0
            self.waiting.appendleft(victim)
            self.metrics.preemptions.inc()

    def _plan_prefill(self, budget: int) -> list[tuple[Seq, int, int]]:
        chunks = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            target = seq.prompt_tokens + seq.generated
            n = min(target - seq.computed, budget)
            chunks.append((seq, seq.computed, n))
            budget -= n
        return chunks

    def _step_ms(self, chunks: list[tuple[Seq, int, int]]) -> float:
        ms = 0.0
        if self.decoding:
            ms += self.profile.decode_step_ms(len(self.decoding), self._decode_kv)
        if chunks:
            a, b, c = self.profile.prefill_coef
            ms += a + sum(b * n + c * ((s + n) * (s + n) - s * s) for _, s, n in chunks)
        return ms

    async def _run(self) -> None:
        planned = time.monotonic()
        while True:
            now = time.monotonic()
            self._admit(now)
            self._preempt_for_growth()
            chunks = self._plan_prefill(self.max_num_batched_tokens - len(self.decoding))
            if not chunks and not self.decoding:
                self._update_gauges()
                self._wake.clear()
                await self._wake.wait()
                planned = time.monotonic()
                continue
            dt = self._step_ms(chunks) / 1000.0 / self.time_scale
            start = planned if now - planned < _MAX_LAG_S else now
            planned = start + dt
            delay = planned - time.monotonic()
            # Yield even for a zero-time step, so HTTP handlers can drain tokens.
            await asyncio.sleep(delay if delay > 0 else 0)
            # uvloop's timers round to whole milliseconds and may fire early.
            while (delay := planned - time.monotonic()) > _EARLY_S:
                await asyncio.sleep(delay)
            self._complete_step(chunks, time.monotonic())
            self._update_gauges()

    def _complete_step(self, chunks: list[tuple[Seq, int, int]], now: float) -> None:
        m = self.metrics
        decoded = self.decoding[:] if self.decoding else []
        prefilled_tokens = 0
        for seq, _, n in chunks:
            if seq.state is not State.PREFILLING:  # aborted during the step
                continue
            seq.computed += n
            prefilled_tokens += n
            if seq.computed >= seq.prompt_tokens + seq.generated:
                self.prefilling.remove(seq)
                self._start_decoding(seq)
                self._emit(seq, now)
        for seq in decoded:
            if seq.state is State.RUNNING:
                self._emit(seq, now)
        if prefilled_tokens:
            m.prompt_tokens.inc(prefilled_tokens)
            m.prompt_by_source["local_compute"].inc(prefilled_tokens)
        if decoded:
            m.generation_tokens.inc(len(decoded))
        m.iteration_tokens.observe(prefilled_tokens + len(decoded))

    def _emit(self, seq: Seq, now: float) -> None:
        """One new token for a running sequence."""
        seq.generated += 1
        seq.kv += 1
        self.kv_used += 1
        self._decode_kv += 1
        if seq.generated == 1:
            seq.first_token_at = now
            self.metrics.ttft.observe(now - seq.arrival)
        else:
            self.metrics.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        # vLLM's check_stop order: EOS first, then the length cap. min_tokens masks EOS
        # while fewer than min_tokens tokens exist, so it can come at min_tokens + 1.
        if seq.eos_at is not None and seq.generated >= max(seq.eos_at, seq.min_tokens + 1):
            reason = "stop"
        elif seq.generated >= seq.max_tokens or seq.prompt_tokens + seq.generated >= self.max_model_len:
            reason = "length"
        else:
            if seq.streaming:
                seq._notify()
            return
        self.decoding.remove(seq)
        self._decode_kv -= seq.kv
        self._finish(seq, reason, now)

    def _finish(self, seq: Seq, reason: str, now: float) -> None:
        seq.state = State.FINISHED
        seq.finish_reason = reason
        keep = False
        if seq.hold_transfer_id is not None and self.on_prefilled is not None:
            # The connector keeps the blocks only for a length-capped finish.
            keep = reason == "length"
            self.on_prefilled(seq.hold_transfer_id, seq, keep)
        if not keep:
            self.kv_used -= seq.kv
        m = self.metrics
        m.success[reason].inc()
        if reason in ("stop", "length"):
            m.e2e.observe(now - seq.arrival)
            m.queue.observe(seq.admitted_at - seq.arrival)
            m.prefill.observe(seq.first_token_at - seq.admitted_at)
            m.decode.observe(seq.last_token_at - seq.first_token_at)
            m.inference.observe(seq.last_token_at - seq.admitted_at)
            m.request_prompt_tokens.observe(seq.prompt_tokens)
            m.request_generation_tokens.observe(seq.generated)
            if seq.generated > 1:
                m.tpot.observe((seq.last_token_at - seq.first_token_at) / (seq.generated - 1))
        seq._notify()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self.prefilling) + len(self.decoding))
        m.waiting.set(len(self.waiting) + len(self.fetching))
        m.kv_usage.set(self.kv_used / self.capacity if self.capacity else 0.0)
