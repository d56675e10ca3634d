"""The fleet's state, its event queue and its shape: which engines exist, which are
ready, and the GPUs they hold. The prefill and decode stages (fleet_prefill.py,
fleet_decode.py) and the event loop (fleet.py) build on it."""

from __future__ import annotations

import heapq
import math
import operator
from collections import deque
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pdcluster.control.models import MAX_BATCHED_TOKENS
from pdcluster.observability import Histogram
from pdcluster.perf import Profile
from pdcluster.router.policy import LeastLoaded, PreciseCache, make_policy
from pdcluster.sim import scrapes as M
from pdcluster.sim.cutoff import Cutoff
from pdcluster.sim.engines import (
    DRAINING,
    GONE,
    PENDING,
    READY,
    STARTING,
    DecodeEngine,
    Engine,
    PrefillEngine,
)
from pdcluster.sim.tiered_store import StoreConfig, TieredStore
from pdcluster.sim.trace import Trace

if TYPE_CHECKING:
    from pdcluster.sim.fleet import Fleet

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
    # Flexible engines (spec.mode flexible): a split change at the same size moves ready
    # engines between the roles at once, as the router does: new requests of the new role
    # go to the engine while its old role's work finishes there (FleetState.flip_toward).
    flexible: bool = False


class Policy(Protocol):
    name: str
    interval_s: float

    def initial(self) -> tuple[int, int]: ...

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None: ...


class BufferedHistogram(Histogram):
    """A histogram whose observations wait in a list until the next snapshot (a scrape):
    one numpy pass per scrape instead of a bisection per request, with the same counts
    and the same sum (added in the order observed)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        super().__init__(bounds)
        self.pending: list[float] = []
        self.observe = self.pending.append  # type: ignore[method-assign,assignment]
        self.sorted_bounds = np.asarray(bounds, dtype=float)

    def flush(self) -> None:
        if self.pending:
            found = np.bincount(
                np.searchsorted(self.sorted_bounds, self.pending, side="left"), minlength=len(self.counts)
            )
            self.counts = [c + int(n) for c, n in zip(self.counts, found, strict=True)]
            self.sum = reduce(operator.add, self.pending, self.sum)
            self.count += len(self.pending)
            self.pending.clear()

    def observe_steps(self, first: float, growth: float, steps: int, weight: int, skipped: int) -> None:
        self.flush()  # the sum in the order observed
        super().observe_steps(first, growth, steps, weight, skipped)

    def snapshot(self) -> tuple[tuple[int, ...], float, int]:
        self.flush()
        return super().snapshot()


class FleetState:
    """What every part of the fleet reads and writes, and the engines' lifecycle."""

    def __init__(
        self,
        trace: Trace,
        profile: Profile,
        policy: Policy,
        config: FleetConfig,
        cutoff: Cutoff | None = None,
    ) -> None:
        self.trace = trace
        self.cutoff = cutoff  # stop once the run cannot attain what a search needs
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
        self.flips = 0
        self.held = 0
        self.gpu_seconds = 0.0
        self.held_since = 0.0
        self.targets = (0, 0)
        self.backlog: dict[str, deque[int]] = {"prefill": deque(), "decode": deque()}
        n = len(trace)
        self.ttft = [math.nan] * n
        self.first_token = [math.nan] * n
        self.prefilled_at = [math.nan] * n  # when the router got the prefill's answer
        self.own_prefill_s = [0.0] * n  # the prefill engine's compute for the prompt, as its answer says
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
        self.hist = {name: BufferedHistogram(bounds) for name, bounds in self.scrapes.bounds.items()}
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

    # ---------------------------------------------------------------- fleet shape
    def account(self) -> None:
        self.gpu_seconds += self.held * (self.now - self.held_since)
        self.held_since = self.now

    def set_held(self, delta: int) -> None:
        self.account()
        self.held += delta

    def active(self, role: str) -> list[Engine]:
        return [e for e in self.engines[role] if e.state in (PENDING, STARTING, READY) and not e.lone]

    def scale(self, prefill: int, decode: int, initial: bool = False) -> None:
        self.targets = (prefill, decode)
        if self.cfg.flexible:
            self.flip_toward(prefill, decode)
        for role, want in (("prefill", prefill), ("decode", decode)):
            active = self.active(role)
            for _ in range(want - len(active)):
                self.add_engine(role, ready=initial)
            excess = len(active) - want
            if excess > 0:
                # A StatefulSet removes its highest ordinals first.
                for engine in sorted(active, key=lambda e: e.ordinal, reverse=True)[:excess]:
                    self.remove_engine(engine)
        for role in self.engines:
            self.engines[role] = [e for e in self.engines[role] if e.state != GONE]
        self.schedule_pending()
        self.go_lone()
        self.mark()

    def go_lone(self) -> None:
        """A flexible pool of one engine serves requests whole: its prefill engine gets a
        decode twin on the same GPUs (the lone engine's streams), which the first decode
        engine to become ready relieves (`relieve_lone`). An engine still draining its old
        role's work has a twin already: it gets one once that is done (`retire_if_empty`),
        as a prefill engine still starting does once ready (`engine_ready`)."""
        if not self.cfg.flexible or self.targets[1] != 0 or any(e.lone for e in self.engines["decode"]):
            return
        host = next((e for e in self.ready["prefill"] if e.twin is None), None)
        if host is None:
            return
        lone = self.new_engine("decode")
        lone.state, lone.lone = READY, True
        lone.twin, host.twin = host, lone
        self.ready["decode"].append(lone)

    def decode_engines(self) -> int:
        """Ready decode engines, a lone engine's decode half not counted: it is no pod."""
        return sum(1 for e in self.ready["decode"] if not e.lone)

    def relieve_lone(self) -> None:
        """A decode engine is ready: the lone engine's decode half takes no new streams and
        leaves once its own are done; its host computes prompts alone again."""
        for lone in [e for e in self.ready["decode"] if e.lone]:
            lone.lone = False
            lone.state = DRAINING
            self.ready["decode"].remove(lone)
            self.retire_if_empty(lone)

    def flip_toward(self, prefill: int, decode: int) -> None:
        """Move ready engines from a role with more than wanted to one with fewer. As the
        router does with a kv_both engine: the engine takes the new role's requests at once
        and finishes its old role's work meanwhile, on the same GPUs. The simulator keeps
        the two roles as two engines linked as twins, whose work shares each step
        (`twin_prompt_ms`, `twin_streams_ms`)."""
        want = {"prefill": prefill, "decode": decode}
        have = {role: len(self.active(role)) for role in want}
        for role, other in (("prefill", "decode"), ("decode", "prefill")):
            moves = max(min(want[role] - have[role], have[other] - want[other]), 0)
            # The least loaded first; an engine whose last flip is still draining waits.
            movable = [e for e in self.ready[other] if e.twin is None]
            for engine in sorted(movable, key=lambda e: e.inflight_tokens)[:moves]:
                engine.state = DRAINING
                self.ready[other].remove(engine)
                now = self.new_engine(role)
                now.state = READY
                now.twin, engine.twin = engine, now
                self.ready[role].append(now)
                self.events_from(now)
                self.flips += 1
                self.reshared(engine)
                self.retire_if_empty(engine)

    # Twins are one vLLM engine doing both roles' work, in the same steps, as its scheduler
    # runs them (vllm/v1/core/sched/scheduler.py): every running stream's next token first,
    # prompts in the rest of the token budget, one forward pass (sim/colocated.py prices a
    # colocated engine's steps alike). So a prompt batch's step also carries the streams'
    # tokens, and while prompts are computed the streams advance one token per batch.

    def twin_prompt_ms(self, engine: Engine) -> float:
        """The prompt batch a decode engine's twin is computing, in ms (0: none): each of
        the engine's steps takes that long meanwhile."""
        twin = engine.twin
        return twin.batch_ms if twin is not None and twin.busy else 0.0  # type: ignore[attr-defined]

    def twin_streams_ms(self, engine: Engine) -> float:
        """What a prefill engine's twin's streams add to each prompt batch's step, in ms."""
        twin = engine.twin
        if twin is None or not twin.batch:  # type: ignore[attr-defined]
            return 0.0
        _, d1, d2 = self.profile.decode_coef
        kv = twin.kv + twin.batch * twin.steps_done(self.now)  # type: ignore[attr-defined]
        return d1 * twin.batch + d2 * kv  # type: ignore[attr-defined]

    def reshared(self, engine: Engine) -> None:
        """An engine's twin started or ended work: the decode stage re-times its steps."""

    def new_engine(self, role: str) -> Engine:
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
        return engine

    def add_engine(self, role: str, ready: bool) -> None:
        engine = self.new_engine(role)
        if ready:
            engine.state = READY
            self.set_held(engine.gpus)
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
        if engine.state != DRAINING or not engine.idle():  # type: ignore[attr-defined]
            return
        engine.state = GONE
        self.router.forget(engine.id)
        twin = engine.twin
        if twin is not None and twin.state != GONE:
            twin.twin = None  # it holds the GPUs on, alone
            self.reshared(twin)
            self.go_lone()
        else:
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

    def mark(self) -> None:
        self.timeline.append(
            (self.now, len(self.ready["prefill"]), self.decode_engines(), *self.targets, self.held)
        )
