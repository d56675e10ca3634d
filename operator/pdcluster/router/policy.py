"""Routing policies and SLO admission, as pure code.

The router runs this code on live traffic and the fleet simulator (pdcluster.sim) runs
the very same code on simulated traffic, so it does no I/O and never reads a clock:
callers pass `now` (seconds, any monotonic origin) where time matters.

Shapes:

- `Backend`: one schedulable engine (a prefill DP rank or a decode instance) with the
  caller-maintained load counters `inflight_requests` and `inflight_tokens` (prompt
  tokens not yet prefilled on a prefill backend; KV tokens held on a decode backend).
  Callers may subclass it to carry addresses; policies only read the fields below.
- `policy.pick(backends, prompt_tokens, block_hashes, exact) -> Backend | None`: choose
  among `backends` (None only when it is empty). `block_hashes` are chained prefix-block
  hashes (pdcluster.router.prompt.block_hashes, or a trace's `hash_ids`); `exact`, when
  known, are the prompt's blocks as the engines hash them (`ExactBlocks`), which the
  precise policy matches against what the engines' KV events say they hold (`KvIndex`).
- `policy.record(backend_id, block_hashes)`: after dispatch, so a cache-aware policy
  learns what each backend now holds; `policy.forget(backend_id)` when it leaves or
  restarts (its cache is gone).
- `Admission`: predicts a request's TTFT on the chosen prefill backend and rejects it
  early when the prediction exceeds the target by a factor, the "prediction-based early
  rejection" of Mooncake (Qin et al., FAST'25, section 7).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar


@dataclass(eq=False)
class Backend:
    id: str
    role: str  # "prefill" | "decode" | "colocated"
    inflight_requests: int = 0
    inflight_tokens: int = 0


B = TypeVar("B", bound=Backend)


@dataclass(frozen=True)
class Cached:
    """Prompt tokens a backend holds in its prefix cache, and whether the engine's own
    KV events say so (else the policy's guess from what it dispatched)."""

    tokens: int
    from_events: bool


def _least_loaded(backends: Sequence[B], turn: int) -> B | None:
    """Fewest tokens in flight, then fewest requests; ties rotate with `turn` so that
    an idle fleet is not served by its first member only."""
    best: list[B] = []
    best_key = (math.inf, math.inf)
    for backend in backends:
        key = (backend.inflight_tokens, backend.inflight_requests)
        if key < best_key:
            best_key, best = key, [backend]
        elif key == best_key:
            best.append(backend)
    if not best:
        return None
    return best[turn % len(best)]


@dataclass(frozen=True)
class ExactBlocks:
    """A prompt's full blocks as its engines hash them (vLLM's prefix-cache hashes, which
    its KV events name), `block_tokens` tokens each, first block first."""

    block_tokens: int
    hashes: Sequence[Hashable]


class LeastLoaded:
    """Least outstanding work: the backend with the fewest tokens in flight."""

    needs_block_hashes = False
    needs_exact_blocks = False
    kv_index: KvIndex | None = None

    def __init__(self) -> None:
        self._turn = 0

    def pick(
        self,
        backends: Sequence[B],
        prompt_tokens: int = 0,
        block_hashes: Sequence[Hashable] = (),
        exact: ExactBlocks | None = None,
    ) -> B | None:
        self._turn += 1
        return _least_loaded(backends, self._turn)

    def record(self, backend_id: str, block_hashes: Sequence[Hashable]) -> None:
        pass

    def cached(
        self, backend: Backend, prompt_tokens: int, block_hashes: Sequence[Hashable], exact: ExactBlocks | None
    ) -> Cached | None:
        return None  # it keeps no view of the caches

    def forget(self, backend_id: str) -> None:
        pass


class PrefixAware:
    """Prefer the backend that recently prefilled the longest prefix of this prompt.

    Cost of a backend = its tokens in flight + the prompt tokens it would still have to
    compute (prompt minus the cached prefix); the cheapest wins. A backend whose tokens
    in flight exceed the least-loaded backend's by more than `max_imbalance_tokens` is
    not considered, so a hot prefix cannot pile all its traffic onto one instance.

    Each backend's memory is an LRU of at most `capacity_blocks` block hashes, an
    approximation of what its prefix cache still holds.
    """

    needs_block_hashes = True
    needs_exact_blocks = False
    kv_index: KvIndex | None = None

    def __init__(self, block_tokens: int, max_imbalance_tokens: int = 16384, capacity_blocks: int = 65536):
        self.block_tokens = block_tokens
        self.max_imbalance_tokens = max_imbalance_tokens
        self.capacity_blocks = capacity_blocks
        self._cached: dict[str, OrderedDict[Hashable, None]] = {}
        self._turn = 0

    def matched_blocks(self, backend_id: str, block_hashes: Sequence[Hashable]) -> int:
        cached = self._cached.get(backend_id)
        if not cached:
            return 0
        matched = 0
        for block in block_hashes:
            if block not in cached:
                break
            matched += 1
        return matched

    def pick(
        self,
        backends: Sequence[B],
        prompt_tokens: int = 0,
        block_hashes: Sequence[Hashable] = (),
        exact: ExactBlocks | None = None,
    ) -> B | None:
        self._turn += 1
        least = _least_loaded(backends, self._turn)
        if least is None or not (block_hashes or exact):
            return least
        bound = least.inflight_tokens + self.max_imbalance_tokens
        best, best_cost = least, self.cost(least, prompt_tokens, block_hashes, exact)
        for backend in backends:
            if backend is least or backend.inflight_tokens > bound:
                continue
            cost = self.cost(backend, prompt_tokens, block_hashes, exact)
            if cost < best_cost:
                best, best_cost = backend, cost
        return best

    def cost(
        self,
        backend: Backend,
        prompt_tokens: int,
        block_hashes: Sequence[Hashable],
        exact: ExactBlocks | None,
    ) -> tuple[int, ...]:
        """What sending the prompt to `backend` costs; the smallest wins."""
        return (backend.inflight_tokens + self.uncached(backend.id, prompt_tokens, block_hashes, exact),)

    def uncached(
        self,
        backend_id: str,
        prompt_tokens: int,
        block_hashes: Sequence[Hashable],
        exact: ExactBlocks | None = None,
    ) -> int:
        """Prompt tokens this backend would compute: all but its cached prefix."""
        return max(prompt_tokens - self.matched_blocks(backend_id, block_hashes) * self.block_tokens, 0)

    def cached(
        self, backend: Backend, prompt_tokens: int, block_hashes: Sequence[Hashable], exact: ExactBlocks | None
    ) -> Cached | None:
        uncached = self.uncached(backend.id, prompt_tokens, block_hashes, exact)
        return Cached(prompt_tokens - uncached, self._from_events(backend.id, exact))

    def _from_events(self, backend_id: str, exact: ExactBlocks | None) -> bool:
        return False

    def record(self, backend_id: str, block_hashes: Sequence[Hashable]) -> None:
        cached = self._cached.setdefault(backend_id, OrderedDict())
        for block in block_hashes:
            cached[block] = None
            cached.move_to_end(block)
        while len(cached) > self.capacity_blocks:
            cached.popitem(last=False)

    def forget(self, backend_id: str) -> None:
        self._cached.pop(backend_id, None)


# Where a block lives, as KV events name it (vllm/distributed/kv_events.py: MEDIUM_*): a
# block offloaded to CPU is still held after the GPU copy is removed.
_MEDIUM_BITS = {None: 1, "GPU": 1, "CPU": 2}
_OTHER_MEDIUM = 4


class KvIndex:
    """What each engine's prefix cache holds, as its KV events say (BlockStored,
    BlockRemoved, AllBlocksCleared), by block hash.

    An engine's entry is trusted (`live`) from the first event batch after `reset` until
    the next `reset`: its feed resets it when it (re)connects, when a sequence number is
    skipped (events lost: a removal may be among them) and when the engine restarts."""

    def __init__(self) -> None:
        self._held: dict[str, dict[Hashable, int]] = {}  # engine -> block -> media bits
        self._live: set[str] = set()

    def live(self, engine: str) -> bool:
        return engine in self._live

    def blocks(self, engine: str) -> int:
        return len(self._held.get(engine, ()))

    def reset(self, engine: str) -> None:
        """Forget the engine's blocks and distrust it until its next batch."""
        self._held.pop(engine, None)
        self._live.discard(engine)

    def batch(self, engine: str, events: Sequence[tuple[str, Sequence[Hashable], str | None]]) -> None:
        """Apply one batch of events: (kind, block hashes, medium) each."""
        held = self._held.setdefault(engine, {})
        self._live.add(engine)
        for kind, hashes, medium in events:
            bit = _MEDIUM_BITS.get(medium, _OTHER_MEDIUM)
            if kind == "BlockStored":
                for h in hashes:
                    held[h] = held.get(h, 0) | bit
            elif kind == "BlockRemoved":
                for h in hashes:
                    left = held.get(h, 0) & ~bit
                    if left:
                        held[h] = left
                    else:
                        held.pop(h, None)
            elif kind == "AllBlocksCleared":
                held.clear()

    def matched_blocks(self, engine: str, hashes: Sequence[Hashable]) -> int:
        held = self._held.get(engine)
        if not held:
            return 0
        matched = 0
        for h in hashes:
            if h not in held:
                break
            matched += 1
        return matched


class PreciseCache(PrefixAware):
    """PrefixAware on what the engines' prefix caches hold, from their KV events (the
    precise prefix-cache scoring of llm-d and vllm-router), where the prompt's engine
    block hashes are known and the engine's events are live; elsewhere PrefixAware's own
    guess, which it keeps learning from every dispatch."""

    needs_exact_blocks = True

    def __init__(self, block_tokens: int, index: KvIndex | None = None, **kwargs: int):
        super().__init__(block_tokens, **kwargs)
        self.index = index if index is not None else KvIndex()
        self.kv_index = self.index

    def _from_events(self, backend_id: str, exact: ExactBlocks | None) -> bool:
        return exact is not None and self.index.live(backend_id)

    def uncached(
        self,
        backend_id: str,
        prompt_tokens: int,
        block_hashes: Sequence[Hashable],
        exact: ExactBlocks | None = None,
    ) -> int:
        if not self._from_events(backend_id, exact):
            return super().uncached(backend_id, prompt_tokens, block_hashes)
        return max(
            prompt_tokens - self.index.matched_blocks(backend_id, exact.hashes) * exact.block_tokens, 0
        )

    def cost(
        self,
        backend: Backend,
        prompt_tokens: int,
        block_hashes: Sequence[Hashable],
        exact: ExactBlocks | None,
    ) -> tuple[int, ...]:
        # Between engines the events rate alike (most often: none holds the prompt any
        # more), the one the guess says had it: a conversation keeps to one engine, whose
        # cache then holds one share of the conversations instead of all of them.
        guessed = super().uncached(backend.id, prompt_tokens, block_hashes)
        return (*super().cost(backend, prompt_tokens, block_hashes, exact), guessed)

    def forget(self, backend_id: str) -> None:
        super().forget(backend_id)
        self.index.reset(backend_id)


class Policy(Protocol):
    """A routing policy (the shapes in this module's docstring). `kv_index` is the
    engines' KV-event index for a policy that reads one, which the router feeds."""

    needs_block_hashes: bool
    needs_exact_blocks: bool
    kv_index: KvIndex | None

    def pick(
        self,
        backends: Sequence[B],
        prompt_tokens: int = 0,
        block_hashes: Sequence[Hashable] = (),
        exact: ExactBlocks | None = None,
    ) -> B | None: ...

    def record(self, backend_id: str, block_hashes: Sequence[Hashable]) -> None: ...

    def forget(self, backend_id: str) -> None: ...

    def cached(
        self, backend: Backend, prompt_tokens: int, block_hashes: Sequence[Hashable], exact: ExactBlocks | None
    ) -> Cached | None: ...


POLICIES = ("least-loaded", "prefix-aware", "precise-prefix")


def make_policy(name: str, block_tokens: int) -> Policy:
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-aware":
        return PrefixAware(block_tokens)
    if name == "precise-prefix":
        return PreciseCache(block_tokens)
    raise ValueError(f"unknown policy {name!r} ({', '.join(POLICIES)})")


@dataclass(frozen=True)
class AdmissionVerdict:
    admitted: bool
    predicted_ttft_ms: float
    retry_after_s: int = 0


@dataclass
class _Rate:
    """Decayed sums of prefilled tokens and busy seconds; their ratio is the rate."""

    tokens: float
    seconds: float
    mark: float | None = None  # when the current measurement interval began; None: none has

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Admission:
    """Prediction-based early rejection on the prefill side.

    Predicted TTFT on backend B = (B's prompt tokens in flight + this prompt) / rate(B),
    with rate(B) B's observed prefill throughput. A request is rejected when the
    prediction exceeds `factor` times the larger of the target and the request's own
    unqueued prefill time (a prompt too long to meet the target even alone is still
    served when the backend is idle); with `plus_prefill` (autoscaling.ttftIncludesPrefill
    false), `factor` times the target plus that prefill time.

    Throughput is measured over busy time, which stays right when a backend prefills
    many requests in one batch: `started` marks when an idle backend becomes busy,
    each `completed` adds the tokens it finished and the time since the previous mark.
    Both sums decay by `decay` per completion; they start from `default_tokens_per_s`
    over `prior_seconds`, a prior that the first few completions wash out.
    """

    ttft_target_ms: float
    factor: float
    default_tokens_per_s: float = 20000.0
    plus_prefill: bool = False  # the target bounds TTFT on top of the prompt's own prefill
    decay: float = 0.9
    prior_seconds: float = 0.05
    _rates: dict[str, _Rate] = field(default_factory=dict)

    def _rate(self, backend_id: str) -> _Rate:
        rate = self._rates.get(backend_id)
        if rate is None:
            rate = _Rate(self.default_tokens_per_s * self.prior_seconds, self.prior_seconds)
            self._rates[backend_id] = rate
        return rate

    def tokens_per_s(self, backend_id: str) -> float:
        return self._rate(backend_id).tokens_per_s

    def decide(self, backend: Backend, prompt_tokens: int) -> AdmissionVerdict:
        rate = self.tokens_per_s(backend.id)
        predicted = (backend.inflight_tokens + prompt_tokens) / rate * 1000.0
        alone = prompt_tokens / rate * 1000.0
        limit = self.factor * (
            self.ttft_target_ms + alone if self.plus_prefill else max(self.ttft_target_ms, alone)
        )
        if predicted <= limit:
            return AdmissionVerdict(True, predicted)
        # By then the queue ahead has drained to about the target.
        retry_after = max(1, math.ceil((predicted - self.ttft_target_ms) / 1000.0))
        return AdmissionVerdict(False, predicted, retry_after)

    def started(self, backend_id: str, now: float, was_idle: bool) -> None:
        if was_idle:
            self._rate(backend_id).mark = now

    def completed(self, backend_id: str, tokens: int, now: float) -> None:
        rate = self._rates.get(backend_id)
        if rate is None or rate.mark is None:
            # Forgotten while this prefill ran (its pod went away), or never started: no
            # interval to measure. Counted from time 0, the busy time would be the host's
            # uptime and the rate of a successor under the same id would collapse to ~0.
            return
        elapsed = now - rate.mark
        rate.mark = now
        if elapsed <= 0.0:
            rate.tokens += tokens
            return
        rate.tokens = rate.tokens * self.decay + tokens
        rate.seconds = rate.seconds * self.decay + elapsed

    def forget(self, backend_id: str) -> None:
        self._rates.pop(backend_id, None)
