"""A fleet of colocated engines: each serves prefill and decode in the same steps, as
vLLM does with chunked prefill (the V1 scheduler, vllm/v1/core/sched/scheduler.py).

One step of one engine:

- every sequence whose prompt is computed gets its next token;
- the rest of the token budget (`max_num_batched_tokens`; vLLM's default for the
  OpenAI server on GPUs of 70 GiB or more is 8192, vllm/engine/arg_utils.py
  get_batch_defaults) goes to prompt chunks, oldest request first: the prompt being
  computed goes on where it stopped, then waiting requests are admitted while budget is
  left, their KV (prompt + output) fits and fewer than `max_num_seqs` run;
- it is one forward pass over all of it, costing

      fixed + d1 * B + d2 * K + sum over chunks of (b * n + c * ((s + n)^2 - s^2))

  for B decoding sequences holding K KV tokens and chunks of n prompt tokens after s
  computed ones (a chunk attends to the s before it, so a prompt's chunks add up to
  its whole quadratic term). `fixed` is the profile's d0 for decodes alone and, for a
  step carrying prompt chunks, `prefill_fixed_ms` or, with both, the larger of the
  two; so chunking costs one fixed part per chunk, as it does on a GPU.
  `prefill_fixed_ms` is the profile's a unless set lower, d0 say: a profile measures a
  through the server, so it holds per-request work (HTTP, tokenization) that occupies
  no step; the rest of a then delays the request on its way in (sim/fleet.py takes the
  same setting, so both models can price the same work alike). On a real engine with
  its compute on a core of its own, d0 predicted what long prompts do to running
  streams, a overstated it (benchmarks/colocated_interference.py, docs/crossover.md);
- the step that computes a prompt's last chunk yields its first token, each later
  step one more.

So a running stream's ITL rises by the prompt work that shares its steps, and a prompt's
TTFT by the decodes it shares steps with and by its chunking. Deliberately left out,
as in sim/fleet.py: step-time noise, preemption (admission reserves prompt + output),
the prefix cache is an LRU of the trace's prefix blocks per engine sized by the KV
capacity, as the disaggregated model's prefill engines keep.

Autoscaled, the fleet exports the router's and the engines' series of pdcluster.series
(a token gap per decoding sequence and step, each stream's time per output token, TTFT
and queue time per request, vLLM's prompt and success counters, the engines' queues and
KV usage), scraped every `scrape_s`; the control law reads them only through
sim/scrapes.py's window evaluator, as sim/fleet.py's policies do and as the operator
reads Prometheus.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from datetime import timedelta

from pdcluster.api.v1alpha1 import AutoscalingState, PDClusterSpec
from pdcluster.control import Observed, RoleObserved, decide
from pdcluster.control.models import MAX_BATCHED_TOKENS
from pdcluster.observability import Histogram
from pdcluster.perf import Profile
from pdcluster.router.policy import Backend, ExactBlocks, KvIndex, PreciseCache, make_policy
from pdcluster.series import BY_FIELD
from pdcluster.sim import scrapes as M
from pdcluster.sim.fleet import Result
from pdcluster.sim.policies import EPOCH
from pdcluster.sim.trace import Trace
from pdcluster.vllm.defaults import MAX_NUM_SEQS

ARRIVE, STEP_DONE, READY, CONTROL, SCRAPE = 0, 1, 2, 3, 4

# The colocated engines' series (pdcluster.series), as vLLM exports them; the router's
# are sim/scrapes.py's.
PROMPT_TOKENS = BY_FIELD["colocated_prompt_tokens_rate"].key
SUCCESS = BY_FIELD["colocated_finished_rate"].key
TTFT = BY_FIELD["colocated_ttft_ms"].key
QUEUE_TIME = BY_FIELD["colocated_queue_time_q_ms"].key
ITL = BY_FIELD["colocated_itl_ms"].key
KV_USAGE = BY_FIELD["colocated_kv_usage"].key
WAITING = BY_FIELD["colocated_waiting"].key
REPORTING = BY_FIELD["colocated_ready"].key


@dataclass(frozen=True)
class ColocatedConfig:
    engines: int
    gpus_per_engine: int = 1
    max_batched_tokens: int = MAX_BATCHED_TOKENS
    max_num_seqs: int = MAX_NUM_SEQS
    # The fixed part of a step carrying prompt tokens; None: the profile's a (see above).
    # Below a, the rest of a is each request's latency before it reaches the engine, as
    # in sim/fleet.py's FleetConfig.
    prefill_fixed_ms: float | None = None
    router: str = "prefix-aware"
    max_time_s: float = 48 * 3600.0
    # Sized by the control law (control/pool.py) when set; `engines` is then where it starts.
    autoscaling: PDClusterSpec | None = None
    startup_s: float = 60.0  # from a scale-up to the new engine serving
    scrape_s: float = 15.0  # as sim/fleet.py's FleetConfig


class ColocatedEngine(Backend):
    """`inflight_tokens` (what the router weighs) is prompt tokens not yet computed,
    as the router's colocated pool counts them."""

    def __init__(self, index: int, cache_blocks: int) -> None:
        super().__init__(f"colocated-{index}", "colocated")
        self.index = index
        self.cache: OrderedDict[int, None] = OrderedDict()  # prefix blocks, LRU
        self.cache_blocks = cache_blocks
        self.waiting: deque[int] = deque()
        self.prefilling: deque[list[int]] = deque()  # [request, prompt tokens computed]
        self.decoding: list[tuple[int, int]] = []  # heap of (step of the last token, request)
        self.kv = 0  # KV tokens of the decoding sequences
        self.reserved = 0  # prompt + output of every admitted request
        self.steps = 0  # steps finished
        self.busy = False
        self.started = 0.0  # when the step under way began
        self.draining = False  # scaled down: finishes what it has, takes nothing new
        self.gone = False
        # What the step under way will have done when it ends.
        self.first_tokens: list[int] = []
        self.chunks: list[tuple[int, int]] = []


@dataclass(frozen=True)
class Step:
    """One planned step: its cost and what it computes."""

    ms: float
    chunks: list[tuple[int, int]]  # (request, prompt tokens)
    first_tokens: list[int]  # requests whose last chunk it computes


class ColocatedFleet:
    def __init__(self, trace: Trace, profile: Profile, config: ColocatedConfig) -> None:
        if config.engines < 1:
            raise ValueError("a colocated fleet needs at least one engine")
        self.trace, self.profile, self.cfg = trace, profile, config
        a = profile.prefill_coef[0]
        self.prefill_fixed_ms = a if config.prefill_fixed_ms is None else min(config.prefill_fixed_ms, a)
        self.ingress_s = (a - self.prefill_fixed_ms) / 1000.0
        self.cache_blocks = max(profile.max_kv_tokens // trace.block_tokens, 1)
        self.engines = [ColocatedEngine(i, self.cache_blocks) for i in range(config.engines)]
        self.serving = list(self.engines)  # ready and not draining: what the router picks from
        self.starting = 0
        self.held = [(0.0, config.engines)]  # (since, engines holding GPUs)
        self.timeline: list[tuple[float, int, int, int, int, int]] = []
        self.decisions: list[tuple[float, int, int, str]] = []
        self.state: AutoscalingState | None = None
        # Cumulative series, as the router's and the engines' /metrics show them; the law
        # reads them only through scrapes, as the operator reads Prometheus.
        bounds = M.histogram_bounds()
        self.scrapes = M.Scrapes(
            {k: bounds[k] for k in (M.ROUTER_TTFT, M.ROUTER_ITL, M.ROUTER_TPOT, TTFT, QUEUE_TIME, ITL)}
        )
        self.hist = {name: Histogram(bounds) for name, bounds in self.scrapes.bounds.items()}
        self.counters = dict.fromkeys(
            (M.ROUTER_PROMPT_TOKENS, M.ROUTER_FINISHED, M.ROUTER_GENERATION_TOKENS, PROMPT_TOKENS, SUCCESS),
            0.0,
        )
        self.router = make_policy(config.router, trace.block_tokens)
        self.kv_index = self.router.index if isinstance(self.router, PreciseCache) else None
        self.reused_tokens = 0
        n = len(trace)
        self.ttft = [math.nan] * n
        self.queued = [math.nan] * n  # when the request reached its engine's queue
        self.first_token = [math.nan] * n
        self.finish = [math.nan] * n
        self.unfinished = n  # requests with no finish yet, arrived or still to come
        self.events: list[tuple[float, int, int, int]] = []
        self.unrouted: deque[int] = deque()
        self.seq = 0
        self.now = 0.0

    def push(self, t: float, kind: int, arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, arg))

    def run(self) -> Result:
        for i, t in enumerate(self.trace.arrival_s):
            self.push(t + self.ingress_s, ARRIVE, i)
        auto = self.cfg.autoscaling
        if auto is not None:  # only the law reads metrics
            self.push(0.0, SCRAPE, 0)
            self.push(float(auto.autoscaling.interval_seconds), CONTROL, 0)
        while self.events:
            t, _, kind, arg = heapq.heappop(self.events)
            if t > self.cfg.max_time_s:
                break
            self.now = t
            if kind == ARRIVE:
                self.counters[M.ROUTER_PROMPT_TOKENS] += self.trace.input_tokens[arg]
                self.arrive(arg)
            elif kind == STEP_DONE:
                self.step_done(self.engines[arg])
            elif kind == READY:
                self.starting -= 1
                self.serving.append(self.engines[arg])
                self.dispatch_waiting()
            # The law runs on while any request is unfinished (arrived or still to come).
            elif kind == CONTROL and self.unfinished:
                self.control()
                self.push(t + auto.autoscaling.interval_seconds, CONTROL, 0)  # type: ignore[union-attr]
            elif kind == SCRAPE and self.unfinished:
                self.scrape()
                self.push(t + self.cfg.scrape_s, SCRAPE, 0)
        tr = self.trace
        itl = [
            (self.finish[i] - self.first_token[i]) / (out - 1) if out > 1 else 0.0
            for i, out in enumerate(tr.output_tokens)
        ]
        per = self.cfg.gpus_per_engine
        held = [*self.held, (self.now, 0)]
        gpu_seconds = sum((b[0] - a[0]) * a[1] * per for a, b in itertools.pairwise(held))
        dynamic = self.cfg.autoscaling is not None
        return Result(
            f"colocated:{'pool-law' if dynamic else self.cfg.engines}",
            list(self.ttft),
            itl,
            [not math.isnan(f) for f in self.finish],
            gpu_seconds,
            self.now,
            self.timeline or [(0.0, self.cfg.engines, 0, self.cfg.engines, 0, self.cfg.engines * per)],
            decisions=self.decisions,
            reused_tokens=self.reused_tokens,
        )

    # ------------------------------------------------------------------ autoscaling
    def control(self) -> None:
        """One run of the control law on the last window, as the operator runs it."""
        spec = self.cfg.autoscaling
        assert spec is not None
        auto = spec.autoscaling
        active = [e for e in self.engines if not e.draining]
        observed = RoleObserved(len(active), len(active), len(self.serving))
        none = RoleObserved(0, 0, 0)
        now = EPOCH + timedelta(seconds=self.now)
        snapshot = M.snapshot(self.scrapes, self.now, auto.window_seconds, auto.slo.quantile.fraction)
        self.state, decision = decide(spec, snapshot, self.state, Observed(none, none, observed), now)
        target = decision.colocated or len(active)
        if decision.action == "scale":
            self.decisions.append((self.now, target, 0, decision.cause))
        for _ in range(target - len(active)):  # scale up: a new engine serves after its start-up
            engine = ColocatedEngine(len(self.engines), self.cache_blocks)
            self.engines.append(engine)
            self.starting += 1
            self.push(self.now + self.cfg.startup_s, READY, engine.index)
        for engine in sorted(active, key=lambda e: -e.index)[: max(len(active) - target, 0)]:
            engine.draining = True  # scale down: no new requests; it leaves once idle
            if engine in self.serving:
                self.serving.remove(engine)
        self.release_idle()
        self.held.append((self.now, sum(1 for e in self.engines if not e.gone)))
        gpus = self.held[-1][1] * self.cfg.gpus_per_engine
        self.timeline.append((self.now, len(self.serving), 0, target, 0, gpus))

    def release_idle(self) -> None:
        for engine in self.engines:
            if engine.draining and not engine.gone and not engine.busy and not engine.waiting:
                engine.gone = True

    def scrape(self) -> None:
        """What Prometheus scrapes: the cumulative series, the engines' queues (vLLM's
        num_requests_waiting, summed over the engines still running), their KV usage (each
        engine's reservation, averaged) and the engines serving."""
        gauges = {
            WAITING: float(sum(len(e.waiting) for e in self.engines if not e.gone)),
            REPORTING: float(len(self.serving)),
        }
        if self.serving:
            kv = sum(e.reserved for e in self.serving) / self.profile.max_kv_tokens
            gauges[KV_USAGE] = kv / len(self.serving)
        histograms = {name: h.snapshot() for name, h in self.hist.items()}
        self.scrapes.record(M.Sample(self.now, histograms, dict(self.counters), gauges))

    def dispatch_waiting(self) -> None:
        """Requests that arrived with no engine serving go out once one is."""
        while self.unrouted and self.serving:
            self.arrive(self.unrouted.popleft())

    def arrive(self, i: int) -> None:
        blocks = self.trace.blocks[i]
        if not self.serving:
            self.unrouted.append(i)
            return
        exact = ExactBlocks(self.trace.block_tokens, blocks) if self.kv_index is not None else None
        engine: ColocatedEngine = self.router.pick(self.serving, self.trace.input_tokens[i], blocks, exact)  # type: ignore[assignment]
        self.router.record(engine.id, blocks)
        engine.waiting.append(i)
        self.queued[i] = self.now
        engine.inflight_tokens += self.trace.input_tokens[i]
        engine.inflight_requests += 1
        if not engine.busy:
            self.start_step(engine)

    # ------------------------------------------------------------------ one step
    def plan(self, engine: ColocatedEngine) -> Step | None:
        """What the engine's next step computes (None: nothing to do). Admits waiting
        requests as vLLM's scheduler does; the rest happens when the step ends."""
        tr, cfg = self.trace, self.cfg
        _, b, c = self.profile.prefill_coef
        d0, d1, d2 = self.profile.decode_coef
        decodes = len(engine.decoding)
        budget = cfg.max_batched_tokens - decodes
        chunks, first, prompt_ms = [], [], 0.0
        for item in engine.prefilling:  # prompts under way first, in order
            if budget <= 0:
                break
            request, done = item
            n = min(tr.input_tokens[request] - done, budget)
            chunks.append((request, n))
            prompt_ms += b * n + c * ((done + n) ** 2 - done**2)
            budget -= n
            if done + n == tr.input_tokens[request]:
                first.append(request)
        while engine.waiting and budget > 0:
            request = engine.waiting[0]
            need = tr.input_tokens[request] + tr.output_tokens[request]
            running = decodes + len(engine.prefilling)
            if running >= cfg.max_num_seqs or (
                running and engine.reserved + need > self.profile.max_kv_tokens
            ):
                break  # waits for a sequence to finish (an empty engine takes anything)
            engine.waiting.popleft()
            self.hist[QUEUE_TIME].observe(self.now - self.queued[request])
            engine.reserved += need
            length = tr.input_tokens[request]
            cached = min(_cached_blocks(engine.cache, tr.blocks[request]) * tr.block_tokens, length - 1)
            engine.inflight_tokens -= cached
            self.reused_tokens += cached
            engine.prefilling.append([request, cached])
            n = min(length - cached, budget)
            chunks.append((request, n))
            prompt_ms += b * n + c * ((cached + n) ** 2 - cached**2)
            budget -= n
            if cached + n == length:
                first.append(request)
        if not decodes and not chunks:
            return None
        fixed = (
            max(self.prefill_fixed_ms, d0) if chunks and decodes else self.prefill_fixed_ms if chunks else d0
        )
        decode_ms = d1 * decodes + d2 * engine.kv if decodes else 0.0
        return Step(fixed + decode_ms + prompt_ms, chunks, first)

    def start_step(self, engine: ColocatedEngine) -> None:
        step = self.plan(engine)
        if step is None:
            engine.busy = False
            if engine.draining:
                self.release_idle()
            return
        engine.busy = True
        engine.started = self.now
        engine.chunks, engine.first_tokens = step.chunks, step.first_tokens
        self.push(self.now + step.ms / 1000.0, STEP_DONE, engine.index)

    def step_done(self, engine: ColocatedEngine) -> None:
        tr = self.trace
        engine.steps += 1
        step = engine.steps
        if engine.decoding:  # one token more for every decoding sequence, the step's time apart
            for name in (M.ROUTER_ITL, ITL):
                self.hist[name].observe(self.now - engine.started, len(engine.decoding))
        engine.kv += len(engine.decoding)
        while engine.decoding and engine.decoding[0][0] <= step:
            _, request = heapq.heappop(engine.decoding)
            self.finished(request)
            held = tr.input_tokens[request] + tr.output_tokens[request]
            engine.kv -= held
            engine.reserved -= held
            engine.inflight_requests -= 1
        for _, n in engine.chunks:
            engine.inflight_tokens -= n
        progress = dict(engine.chunks)
        for item in engine.prefilling:
            item[1] += progress.get(item[0], 0)
        for request in engine.first_tokens:
            engine.prefilling.popleft()  # the oldest prompts finish first
            _remember(engine, tr.blocks[request], self.kv_index)
            self.first_token[request] = self.now
            self.ttft[request] = self.now - tr.arrival_s[request]
            self.hist[M.ROUTER_TTFT].observe(self.ttft[request])
            self.hist[TTFT].observe(self.now - self.queued[request])
            self.counters[PROMPT_TOKENS] += tr.input_tokens[
                request
            ]  # vLLM counts the prompt at its first token
            out = tr.output_tokens[request]
            if out <= 1:
                self.finished(request)
                engine.reserved -= tr.input_tokens[request] + out
                engine.inflight_requests -= 1
            else:
                engine.kv += tr.input_tokens[request] + 1
                heapq.heappush(engine.decoding, (step + out - 1, request))
        self.start_step(engine)

    def finished(self, request: int) -> None:
        self.finish[request] = self.now
        self.unfinished -= 1
        self.counters[M.ROUTER_FINISHED] += 1
        self.counters[M.ROUTER_GENERATION_TOKENS] += self.trace.output_tokens[request]
        self.counters[SUCCESS] += 1
        out = self.trace.output_tokens[request]
        if out > 1:
            self.hist[M.ROUTER_TPOT].observe((self.now - self.first_token[request]) / (out - 1))


def _cached_blocks(cache: OrderedDict[int, None], blocks: tuple[int, ...]) -> int:
    n = 0
    for h in blocks:
        if h not in cache:
            break
        n += 1
    return n


def _remember(engine: ColocatedEngine, blocks: tuple[int, ...], index: KvIndex | None) -> None:
    """The engine caches a prompt's blocks; with an index, its KV events say so at once."""
    added = []
    for h in blocks:
        if h in engine.cache:
            engine.cache.move_to_end(h)
        else:
            engine.cache[h] = None
            added.append(h)
    evicted = [engine.cache.popitem(last=False)[0] for _ in range(len(engine.cache) - engine.cache_blocks)]
    if index is not None:
        index.batch(engine.id, [("BlockStored", added, None), ("BlockRemoved", evicted, None)])


def simulate_colocated(trace: Trace, profile: Profile, config: ColocatedConfig) -> Result:
    return ColocatedFleet(trace, profile, config).run()
