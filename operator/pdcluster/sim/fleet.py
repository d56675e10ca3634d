"""A discrete-event simulation of a prefill/decode fleet.

What happens to a request, and the model behind each step:

- The router picks a prefill engine with the router's policy (prefix-aware by default)
  the moment the request arrives; the engine queues it (FIFO).
- A prefill engine runs one batch at a time: whole prompts from the head of its queue up
  to vLLM's token budget. A batch takes a + sum(b * new + c * (L^2 - cached^2)) ms
  (perf.Profile; `new` are the tokens not in the engine's prefix cache, whose blocks
  come from the trace's prefix hashes and live in a bounded LRU).
- The whole prompt's KV then moves to a decode engine over a link of `link_gbps`.
- The router picks the least-loaded decode engine when the transfer is due. A decode
  engine admits a sequence at its next step when its KV (prompt + output) fits, and
  steps every running sequence by one token in d0 + d1 * B + d2 * K ms. Steps between
  two changes of the batch are summed in closed form (K grows by B per step), so the
  cost of a request is a handful of events, not one per token.
- The first token reaches the user after the first decode step; TTFT and the mean ITL
  of each request are scored exactly, while policies see only scraped histograms.
- Engines take `startup_s` to become ready and hold their GPUs from scheduling on; a
  removed engine drains (takes no new work, leaves when empty). A new engine waits
  (Pending) while the cluster has no free GPU.

- With a Mooncake store (`FleetConfig.store`, sim/store.py) prefill writes every block
  it computes to a shared DRAM (and SSD) LRU; at arrival the router looks the prompt up:
  when at most `max_computed_tokens` are not stored, the request skips prefill, loads
  its prefix from the store and decode computes the rest (that compute delays only its
  own first token); otherwise prefill loads the stored prefix (asynchronously, as vLLM
  does: the request waits for it, the engine does not) and computes the rest.

Simplifications, all deliberate: no step-time noise, no preemption (admission reserves
prompt + output, which the trace knows), a long prompt is prefilled in one piece
(no chunking overhead), KV transfers do not contend for the link, and the router never
rejects (no admission control).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from pdcluster.control.models import MAX_BATCHED_TOKENS
from pdcluster.observability import Histogram
from pdcluster.perf import Profile
from pdcluster.router.policy import Backend, ExactBlocks, LeastLoaded, PreciseCache, make_policy
from pdcluster.sim import metrics as M
from pdcluster.sim.store import Found, StoreConfig, TieredStore
from pdcluster.sim.trace import Trace
from pdcluster.vllm.hashing import leading_cached_run

PENDING, STARTING, READY, DRAINING, GONE = range(5)
ARRIVE, PREFILL_DONE, TRANSFER_DONE, DECODE_WAKE, ENGINE_READY, SCRAPE, CONTROL, STORE_LOADED = range(8)


@dataclass(frozen=True)
class FleetConfig:
    gpus: int  # GPUs in the cluster
    startup_s: float = 60.0
    link_gbps: float = 200.0  # effective P->D bandwidth per transfer
    scrape_s: float = 15.0
    router: str = "prefix-aware"
    max_batched_tokens: int = MAX_BATCHED_TOKENS
    gpus_per_engine: int = 1
    max_time_s: float = 48 * 3600.0  # give up on requests that never finish
    store: StoreConfig | None = None  # a Mooncake store shared by all engines
    # The engine time of a prefill batch's fixed part; None: the profile's a. Below a,
    # the rest of a is each request's own latency before it reaches an engine (HTTP,
    # tokenization: work that holds no GPU), so an isolated request's TTFT is unchanged.
    prefill_fixed_ms: float | None = None


class Policy(Protocol):
    name: str
    interval_s: float

    def initial(self) -> tuple[int, int]: ...

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None: ...


class Engine(Backend):
    """An engine is a router backend (pdcluster.router.policy) with a lifecycle.

    `inflight_tokens` is what the router's policies read: prompt tokens not yet
    prefilled on a prefill engine, KV tokens reserved (running and waiting) on a decode one.
    """

    def __init__(self, ident: int, role: str, ordinal: int, gpus: int) -> None:
        super().__init__(f"{role}-{ident}", role)
        self.ordinal = ordinal
        self.gpus = gpus
        self.state = PENDING


class PrefillEngine(Engine):
    def __init__(self, ident: int, ordinal: int, gpus: int, cache_blocks: int) -> None:
        super().__init__(ident, "prefill", ordinal, gpus)
        self.queue: deque[int] = deque()
        self.busy = False
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.cache_blocks = cache_blocks

    def idle(self) -> bool:
        return not self.busy and not self.queue


class DecodeEngine(Engine):
    """Continuous batching with closed-form stepping between batch changes."""

    def __init__(self, ident: int, ordinal: int, gpus: int) -> None:
        super().__init__(ident, "decode", ordinal, gpus)
        self.running: list[tuple[int, int]] = []  # heap of (finish step, request)
        self.waiting: deque[int] = deque()
        self.batch = 0
        self.kv = 0  # KV tokens at the start of the epoch
        self.t0 = 0.0  # epoch start (s)
        self.step0 = 0  # step index at the epoch start
        self.step_ms = 0.0  # duration of the epoch's first step
        self.growth = 0.0  # each later step is this much longer (ms)
        self.fresh = 0  # sequences that joined at the epoch start
        self.reserved = 0  # prompt + output tokens of running sequences
        self.wake = 0  # token of the one valid wake-up event

    def idle(self) -> bool:
        return self.batch == 0 and not self.waiting

    def boundary_s(self, step: int) -> float:
        n = step - self.step0
        return self.t0 + (n * self.step_ms + self.growth * n * (n - 1) / 2) / 1000.0

    def steps_done(self, t: float) -> int:
        """Whole steps finished by time t in this epoch."""
        elapsed = (t - self.t0) * 1000.0
        if elapsed <= 0 or self.batch == 0:
            return 0
        a, d = self.step_ms, self.growth
        if d <= 0:
            return int(elapsed // a)
        b = a - d / 2
        n = int((-b + math.sqrt(b * b + 2 * d * elapsed)) / d)
        while n > 0 and self.boundary_s(self.step0 + n) > t:
            n -= 1
        while self.boundary_s(self.step0 + n + 1) <= t:
            n += 1
        return n


@dataclass
class Result:
    policy: str
    ttft_s: list[float]
    itl_s: list[float]  # mean ITL per request (0 for one-token outputs)
    finished: list[bool]
    gpu_seconds: float
    end_s: float
    timeline: list[
        tuple[float, int, int, int, int, int]
    ]  # t, P ready, D ready, P target, D target, GPUs held
    decisions: list[tuple[float, int, int, str]] = field(default_factory=list)
    prefill_gpu_seconds: float = 0.0  # GPU-seconds prefill engines spent on batches
    bypassed: int = 0  # requests that skipped prefill (their prefix was stored)
    store_tokens: int = 0  # prompt tokens loaded from the store (by prefill or decode)
    reused_tokens: int = 0  # prompt tokens not computed: an engine's prefix cache or the store


class Fleet:
    def __init__(self, trace: Trace, profile: Profile, policy: Policy, config: FleetConfig) -> None:
        self.trace = trace
        self.profile = profile
        self.policy = policy
        self.cfg = config
        self.router = make_policy(config.router, trace.block_tokens)
        # precise-prefix: the engines' caches as their KV events tell, without delay
        self.kv_index = self.router.index if isinstance(self.router, PreciseCache) else None
        self.decode_router = LeastLoaded()
        self.now = 0.0
        self.events: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.next_id = 0
        self.engines: dict[str, list[Engine]] = {"prefill": [], "decode": []}
        self.ready: dict[str, list[Engine]] = {"prefill": [], "decode": []}
        self.pending: deque[Engine] = deque()
        self.held = 0
        self.gpu_seconds = 0.0
        self.held_since = 0.0
        self.targets = (0, 0)
        self.backlog: dict[str, deque[int]] = {"prefill": deque(), "decode": deque()}
        n = len(trace)
        self.ttft = [math.nan] * n
        self.first_token = [math.nan] * n
        self.prefilled_at = [math.nan] * n  # when the router got the prefill's answer
        self.finish = [math.nan] * n
        self.done = 0
        self.cache_blocks = max(profile.max_kv_tokens // trace.block_tokens, 1)
        a = profile.prefill_coef[0]
        self.prefill_fixed_ms = a if config.prefill_fixed_ms is None else min(config.prefill_fixed_ms, a)
        self.ingress_s = (a - self.prefill_fixed_ms) / 1000.0
        self.store = TieredStore(config.store) if config.store else None
        self.stored: dict[int, int] = {}  # request -> tokens prefill loaded from the store
        self.prefill_gpu_seconds = 0.0
        self.bypassed = 0
        self.store_tokens = 0
        self.reused_tokens = 0
        self.bytes_per_s = config.link_gbps * 1e9 / 8
        self.timeline: list[tuple[float, int, int, int, int, int]] = []
        self.decisions: list[tuple[float, int, int, str]] = []
        # Cumulative series, as the engines' and the router's /metrics would show them.
        self.scrapes = M.Scrapes(M.histogram_bounds())
        self.hist = {name: Histogram(bounds) for name, bounds in self.scrapes.bounds.items()}
        self.counters = dict.fromkeys(
            (
                M.ROUTER_FINISHED,
                M.ROUTER_PROMPT_TOKENS,
                M.ROUTER_GENERATION_TOKENS,
                M.PREFIX_QUERIES,
                M.PREFIX_HITS,
                M.REQUESTS_ARRIVED,
                M.PREFILL_PROMPT_TOKENS,
                M.PREFILL_SUCCESS,
                M.DECODE_GENERATION_TOKENS,
            ),
            0.0,
        )

    # ---------------------------------------------------------------- event plumbing
    def push(self, t: float, kind: int, obj: object = None, arg: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj, arg))

    def run(self) -> Result:
        p, d = self.policy.initial()
        self.scale(p, d, initial=True)
        for i, t in enumerate(self.trace.arrival_s):
            self.push(t + self.ingress_s, ARRIVE, None, i)
        self.push(0.0, SCRAPE)
        if math.isfinite(self.policy.interval_s):
            self.push(self.policy.interval_s, CONTROL)
        total = len(self.trace)
        events = self.events
        pop = heapq.heappop
        while events and self.done < total:
            t, _, kind, obj, arg = pop(events)
            if t > self.cfg.max_time_s:
                break
            self.now = t
            if kind == ARRIVE:
                self.arrive(arg)
            elif kind == DECODE_WAKE:
                if obj.wake == arg:  # type: ignore[union-attr]
                    self.decode_boundary(obj)  # type: ignore[arg-type]
            elif kind == PREFILL_DONE:
                self.prefill_done(obj)  # type: ignore[arg-type]
            elif kind == TRANSFER_DONE:
                self.to_decode(arg)
            elif kind == SCRAPE:
                self.scrape()
                self.push(t + self.cfg.scrape_s, SCRAPE)
            elif kind == CONTROL:
                self.control()
                self.push(t + self.policy.interval_s, CONTROL)
            elif kind == ENGINE_READY:
                self.engine_ready(obj)  # type: ignore[arg-type]
            elif kind == STORE_LOADED:
                self.arrive(arg, counted=True)
        self.account()
        itl = []
        for i in range(total):
            out = self.trace.output_tokens[i]
            span = self.finish[i] - self.first_token[i]
            itl.append(span / (out - 1) if out > 1 else 0.0)
        return Result(
            self.policy.name,
            list(self.ttft),
            itl,
            [not math.isnan(f) for f in self.finish],
            self.gpu_seconds,
            self.now,
            self.timeline,
            self.decisions,
            self.prefill_gpu_seconds,
            self.bypassed,
            self.store_tokens,
            self.reused_tokens,
        )

    # ---------------------------------------------------------------- fleet shape
    def account(self) -> None:
        self.gpu_seconds += self.held * (self.now - self.held_since)
        self.held_since = self.now

    def set_held(self, delta: int) -> None:
        self.account()
        self.held += delta

    def active(self, role: str) -> list[Engine]:
        return [e for e in self.engines[role] if e.state in (PENDING, STARTING, READY)]

    def scale(self, prefill: int, decode: int, initial: bool = False) -> None:
        self.targets = (prefill, decode)
        for role, want in (("prefill", prefill), ("decode", decode)):
            active = self.active(role)
            for _ in range(want - len(active)):
                self.add_engine(role, ready=initial)
            if want < len(active):
                # A StatefulSet removes its highest ordinals first.
                for engine in sorted(active, key=lambda e: e.ordinal, reverse=True)[: len(active) - want]:
                    self.remove_engine(engine)
        for role in self.engines:
            self.engines[role] = [e for e in self.engines[role] if e.state != GONE]
        self.schedule_pending()
        self.mark()

    def add_engine(self, role: str, ready: bool) -> None:
        self.next_id += 1
        ordinals = {e.ordinal for e in self.engines[role] if e.state != GONE}
        ordinal = next(i for i in range(len(ordinals) + 1) if i not in ordinals)
        gpus = self.cfg.gpus_per_engine
        engine: Engine
        if role == "prefill":
            engine = PrefillEngine(self.next_id, ordinal, gpus, self.cache_blocks)
        else:
            engine = DecodeEngine(self.next_id, ordinal, gpus)
        self.engines[role].append(engine)
        if ready:
            engine.state = READY
            self.set_held(gpus)
            self.ready[role].append(engine)
            self.events_from(engine)
        else:
            self.pending.append(engine)

    def remove_engine(self, engine: Engine) -> None:
        if engine.state == PENDING:
            self.pending.remove(engine)
            engine.state = GONE
        elif engine.state == STARTING:
            engine.state = GONE
            self.set_held(-engine.gpus)
        else:
            engine.state = DRAINING
            self.ready[engine.role].remove(engine)
            self.retire_if_empty(engine)

    def retire_if_empty(self, engine: Engine) -> None:
        if engine.state == DRAINING and engine.idle():  # type: ignore[attr-defined]
            engine.state = GONE
            self.router.forget(engine.id)
            self.set_held(-engine.gpus)
            self.engines[engine.role] = [e for e in self.engines[engine.role] if e.state != GONE]
            self.schedule_pending()
            self.mark()

    def schedule_pending(self) -> None:
        while self.pending and self.held + self.pending[0].gpus <= self.cfg.gpus:
            engine = self.pending.popleft()
            engine.state = STARTING
            self.set_held(engine.gpus)
            self.push(self.now + self.cfg.startup_s, ENGINE_READY, engine)

    def events_from(self, engine: Engine) -> None:
        """A ready prefill engine's (empty) cache is known from its first event batch on."""
        if self.kv_index is not None and engine.role == "prefill":
            self.kv_index.batch(engine.id, [])

    def engine_ready(self, engine: Engine) -> None:
        if engine.state != STARTING:
            return
        engine.state = READY
        self.ready[engine.role].append(engine)
        self.events_from(engine)
        self.mark()
        backlog = self.backlog[engine.role]
        while backlog:
            i = backlog.popleft()
            if engine.role == "prefill":
                self.arrive(i, counted=True)
            else:
                self.to_decode(i)

    def mark(self) -> None:
        self.timeline.append(
            (self.now, len(self.ready["prefill"]), len(self.ready["decode"]), *self.targets, self.held)
        )

    # ---------------------------------------------------------------- control
    def control(self) -> None:
        wanted = self.policy.decide(self.now, self)
        if wanted is not None and wanted != self.targets:
            self.decisions.append((self.now, *wanted, getattr(self.policy, "last_reason", "")))
            self.scale(*wanted)

    def scrape(self) -> None:
        prefill, decode = self.ready["prefill"], self.ready["decode"]
        gauges = {
            M.PREFILL_WAITING: float(sum(len(e.queue) for e in prefill)),  # type: ignore[attr-defined]
            M.DECODE_RUNNING: float(sum(e.batch for e in decode)),  # type: ignore[attr-defined]
            M.PREFILL_READY: float(len(prefill)),
            M.DECODE_READY: float(len(decode)),
        }
        if decode:
            cap = self.profile.max_kv_tokens
            used = 0.0
            for e in decode:
                used += e.kv + e.batch * e.steps_done(self.now)  # type: ignore[attr-defined]
            gauges[M.DECODE_KV_USAGE] = used / cap / len(decode)
        self.scrapes.record(
            M.Sample(
                self.now,
                {name: h.snapshot() for name, h in self.hist.items()},
                dict(self.counters),
                gauges,
            )
        )

    # ---------------------------------------------------------------- prefill
    def arrive(self, i: int, counted: bool = False) -> None:
        if not counted:
            self.counters[M.REQUESTS_ARRIVED] += 1
            self.counters[M.ROUTER_PROMPT_TOKENS] += self.trace.input_tokens[i]
            if self.store is not None and self.look_up(i):
                return
        engines = self.ready["prefill"]
        if not engines:
            self.backlog["prefill"].append(i)
            return
        blocks = self.trace.blocks[i]
        exact = ExactBlocks(self.trace.block_tokens, blocks) if self.kv_index is not None else None
        engine: PrefillEngine = self.router.pick(engines, self.trace.input_tokens[i], blocks, exact)  # type: ignore[assignment]
        self.router.record(engine.id, blocks)
        engine.queue.append(i)
        engine.inflight_tokens += self.trace.input_tokens[i]
        engine.inflight_requests += 1
        if not engine.busy:
            self.start_prefill(engine)

    def look_up(self, i: int) -> bool:
        """The router's store lookup; True when the request is on its way without prefill
        queueing it now (straight to decode, or loading its prefix first)."""
        assert self.store is not None
        tr, c = self.trace, self.store.config
        length = tr.input_tokens[i]
        found = self.store.find(tr.blocks[i])
        stored = leading_cached_run(found.blocks, tr.block_tokens, length)
        if stored <= 0:
            return False
        found = Found(stored // tr.block_tokens, min(found.from_ssd, stored // tr.block_tokens))
        load_s = self.store.load_s(found, tr.block_tokens * self.profile.kv_bytes_per_token)
        if c.max_computed_tokens is None or length - stored > c.max_computed_tokens:
            # Prefill loads it and computes the rest: the request queues once it is loaded.
            self.stored[i] = stored
            self.push(self.now + load_s, STORE_LOADED, None, i)
            return True
        # Decode loads the prefix and computes the rest itself: no prefill.
        _, b, cq = self.profile.prefill_coef
        compute_s = (b * (length - stored) + cq * (length * length - stored * stored)) / 1000.0
        self.bypassed += 1
        self.store_tokens += stored
        self.reused_tokens += stored
        self.prefilled_at[i] = self.now
        self.push(self.now + load_s + compute_s, TRANSFER_DONE, None, i)
        return True

    def start_prefill(self, engine: PrefillEngine) -> None:
        _, b, c = self.profile.prefill_coef
        tr = self.trace
        budget = self.cfg.max_batched_tokens
        batch: list[tuple[int, int]] = []
        ms = self.prefill_fixed_ms
        used = 0
        queue_hist = self.hist[M.PREFILL_QUEUE_TIME]
        while engine.queue:
            i = engine.queue[0]
            length = tr.input_tokens[i]
            cached = min(self.cached_blocks(engine, tr.blocks[i]) * tr.block_tokens, length - 1)
            stored = self.stored.get(i, 0)
            loaded = max(stored - cached, 0)  # what the store adds to the engine's own cache
            cached = max(cached, stored)
            new = length - cached
            if batch and used + new > budget:
                break
            engine.queue.popleft()
            self.stored.pop(i, None)
            used += new
            ms += b * new + c * (length * length - cached * cached)
            self.store_tokens += loaded
            batch.append((i, cached))
            queue_hist.observe(self.now - tr.arrival_s[i])
            self.counters[M.PREFIX_QUERIES] += length
            self.counters[M.PREFIX_HITS] += cached
            self.reused_tokens += cached
        engine.busy = True
        self.hist[M.PREFILL_STEPS].observe(used)  # one engine step (a batch within the token budget)
        self.push(self.now + ms / 1000.0, PREFILL_DONE, (engine, batch, ms / 1000.0))

    def cached_blocks(self, engine: PrefillEngine, blocks: tuple[int, ...]) -> int:
        cache = engine.cache
        n = 0
        for h in blocks:
            if h not in cache:
                break
            n += 1
        return n

    def prefill_done(self, payload: tuple[PrefillEngine, list[tuple[int, int]], float]) -> None:
        engine, batch, took_s = payload
        tr = self.trace
        cache = engine.cache
        self.prefill_gpu_seconds += took_s * engine.gpus
        ttft_hist = self.hist[M.PREFILL_TTFT]
        prefill_hist = self.hist[M.PREFILL_TIME]
        prompt_hist = self.hist[M.PREFILL_REQUEST_PROMPT_TOKENS]
        for i, _ in batch:
            if self.store is not None:
                self.store.write(tr.blocks[i])
            added = []
            for h in tr.blocks[i]:
                if h in cache:
                    cache.move_to_end(h)
                else:
                    cache[h] = None
                    added.append(h)
            evicted = [cache.popitem(last=False)[0] for _ in range(len(cache) - engine.cache_blocks)]
            if self.kv_index is not None:
                self.kv_index.batch(
                    engine.id, [("BlockStored", added, None), ("BlockRemoved", evicted, None)]
                )
            ttft_hist.observe(self.now - tr.arrival_s[i])
            prefill_hist.observe(took_s)  # each request of a batch is in PREFILL the whole batch
            self.counters[M.PREFILL_PROMPT_TOKENS] += tr.input_tokens[i]
            self.counters[M.PREFILL_SUCCESS] += 1
            prompt_hist.observe(tr.input_tokens[i])
            engine.inflight_tokens -= tr.input_tokens[i]
            engine.inflight_requests -= 1
            transfer = tr.input_tokens[i] * self.profile.kv_bytes_per_token / self.bytes_per_s
            self.prefilled_at[i] = self.now
            self.hist[M.PREFILL_KV_HANDOFF].observe(transfer)
            self.push(self.now + transfer, TRANSFER_DONE, None, i)
        engine.busy = False
        if engine.queue:
            self.start_prefill(engine)
        else:
            self.retire_if_empty(engine)

    # ---------------------------------------------------------------- decode
    def to_decode(self, i: int) -> None:
        engines = self.ready["decode"]
        if not engines:
            self.backlog["decode"].append(i)
            return
        engine: DecodeEngine = self.decode_router.pick(engines)  # type: ignore[assignment]
        engine.waiting.append(i)
        engine.inflight_tokens += self.trace.input_tokens[i] + self.trace.output_tokens[i]
        engine.inflight_requests += 1
        if engine.batch == 0:
            self.decode_boundary(engine, start=True)
        else:
            self.schedule_wake(engine)

    def admissible(self, engine: DecodeEngine) -> bool:
        if not engine.waiting:
            return False
        i = engine.waiting[0]
        need = self.trace.input_tokens[i] + self.trace.output_tokens[i]
        # A sequence larger than the whole cache still runs alone (as vLLM would, slowly).
        return engine.reserved + need <= self.profile.max_kv_tokens or engine.batch == 0

    def schedule_wake(self, engine: DecodeEngine) -> None:
        step = engine.running[0][0] if engine.running else None
        if self.admissible(engine):
            join = engine.step0 + engine.steps_done(self.now) + 1
            step = join if step is None else min(step, join)
        if step is None:
            return
        engine.wake += 1
        self.push(engine.boundary_s(step), DECODE_WAKE, engine, engine.wake)

    def decode_boundary(self, engine: DecodeEngine, start: bool = False) -> None:
        """Close the epoch at the current step boundary: finish, admit, start the next."""
        tr = self.trace
        d0, d1, d2 = self.profile.decode_coef
        if start:
            step = engine.step0
            kv = engine.kv
        else:
            step = engine.step0 + engine.steps_done(self.now + 1e-9)
            n = step - engine.step0
            if n > 0:
                for name in (M.DECODE_ITL, M.ROUTER_ITL):
                    self.hist[name].observe_steps(
                        engine.step_ms / 1000.0, engine.growth / 1000.0, n, engine.batch, engine.fresh
                    )
            kv = engine.kv + engine.batch * n
            self.counters[M.DECODE_GENERATION_TOKENS] += engine.batch * n
        running = engine.running
        while running and running[0][0] <= step:
            _, i = heapq.heappop(running)
            size = tr.input_tokens[i] + tr.output_tokens[i]
            kv -= size
            engine.reserved -= size
            engine.inflight_tokens -= size
            engine.inflight_requests -= 1
            self.complete(i)
        joined = []
        while self.admissible(engine):
            i = engine.waiting.popleft()
            size = tr.input_tokens[i] + tr.output_tokens[i]
            heapq.heappush(running, (step + tr.output_tokens[i], i))
            engine.reserved += size
            kv += tr.input_tokens[i]
            joined.append(i)
        engine.batch = len(running)
        engine.t0 = self.now
        engine.step0 = step
        engine.kv = kv
        engine.step_ms = d0 + d1 * engine.batch + d2 * kv
        engine.growth = d2 * engine.batch
        engine.fresh = len(joined)
        first = self.now + engine.step_ms / 1000.0
        ttft_hist = self.hist[M.ROUTER_TTFT]
        prefill_hist, after_hist = self.hist[M.ROUTER_PREFILL], self.hist[M.ROUTER_AFTER_PREFILL]
        for i in joined:
            self.first_token[i] = first
            self.ttft[i] = first - tr.arrival_s[i]
            ttft_hist.observe(self.ttft[i])
            prefill_hist.observe(self.prefilled_at[i] - tr.arrival_s[i])
            after_hist.observe(first - self.prefilled_at[i])
        if engine.batch:
            self.schedule_wake(engine)
        else:
            engine.wake += 1
            self.retire_if_empty(engine)

    def complete(self, i: int) -> None:
        tr = self.trace
        self.finish[i] = self.now
        self.done += 1
        self.counters[M.ROUTER_FINISHED] += 1
        self.counters[M.ROUTER_GENERATION_TOKENS] += tr.output_tokens[i]
        self.hist[M.REQUEST_DURATION].observe(self.now - tr.arrival_s[i])
        self.hist[M.INPUT_TOKENS].observe(tr.input_tokens[i])
        self.hist[M.OUTPUT_TOKENS].observe(tr.output_tokens[i])


def simulate(trace: Trace, profile: Profile, policy: Policy, config: FleetConfig) -> Result:
    return Fleet(trace, profile, policy, config).run()
