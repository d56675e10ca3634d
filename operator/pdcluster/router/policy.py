"""Routing policies and SLO admission, as pure code.

The router runs this code on live traffic and the fleet simulator (pdcluster.sim) runs
the very same code on simulated traffic, so it does no I/O and never reads a clock:
callers pass `now` (seconds, any monotonic origin) where time matters.

Shapes:

- `Backend`: one schedulable engine (a prefill DP rank or a decode instance) with the
  caller-maintained load counters `inflight_requests` and `inflight_tokens` (prompt
  tokens not yet prefilled on a prefill backend; KV tokens held on a decode backend).
  Callers may subclass it to carry addresses; policies only read the fields below.
- `policy.pick(backends, prompt_tokens, block_hashes) -> Backend | None`: choose among
  `backends` (None only when it is empty). `block_hashes` are chained prefix-block
  hashes (pdcluster.router.prompt.block_hashes, or a trace's `hash_ids`).
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


@dataclass(eq=False)
class Backend:
    id: str
    role: str  # "prefill" | "decode"
    inflight_requests: int = 0
    inflight_tokens: int = 0


def _least_loaded(backends: Sequence[Backend], turn: int) -> Backend | None:
    """Fewest tokens in flight, then fewest requests; ties rotate with `turn` so that
    an idle fleet is not served by its first member only."""
    best: list[Backend] = []
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


class LeastLoaded:
    """Least outstanding work: the backend with the fewest tokens in flight."""

    needs_block_hashes = False

    def __init__(self) -> None:
        self._turn = 0

    def pick(
        self, backends: Sequence[Backend], prompt_tokens: int = 0, block_hashes: Sequence[Hashable] = ()
    ) -> Backend | None:
        self._turn += 1
        return _least_loaded(backends, self._turn)

    def record(self, backend_id: str, block_hashes: Sequence[Hashable]) -> None:
        pass

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
        self, backends: Sequence[Backend], prompt_tokens: int = 0, block_hashes: Sequence[Hashable] = ()
    ) -> Backend | None:
        self._turn += 1
        least = _least_loaded(backends, self._turn)
        if least is None or not block_hashes:
            return least
        bound = least.inflight_tokens + self.max_imbalance_tokens
        best, best_cost = least, least.inflight_tokens + self._uncached(least, prompt_tokens, block_hashes)
        for backend in backends:
            if backend is least or backend.inflight_tokens > bound:
                continue
            cost = backend.inflight_tokens + self._uncached(backend, prompt_tokens, block_hashes)
            if cost < best_cost:
                best, best_cost = backend, cost
        return best

    def _uncached(self, backend: Backend, prompt_tokens: int, block_hashes: Sequence[Hashable]) -> int:
        return max(prompt_tokens - self.matched_blocks(backend.id, block_hashes) * self.block_tokens, 0)

    def record(self, backend_id: str, block_hashes: Sequence[Hashable]) -> None:
        cached = self._cached.setdefault(backend_id, OrderedDict())
        for block in block_hashes:
            cached[block] = None
            cached.move_to_end(block)
        while len(cached) > self.capacity_blocks:
            cached.popitem(last=False)

    def forget(self, backend_id: str) -> None:
        self._cached.pop(backend_id, None)


Policy = LeastLoaded | PrefixAware


def make_policy(name: str, block_tokens: int) -> Policy:
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-aware":
        return PrefixAware(block_tokens)
    raise ValueError(f"unknown policy {name!r} (least-loaded, prefix-aware)")


@dataclass(frozen=True)
class Decision:
    admitted: bool
    predicted_ttft_ms: float
    retry_after_s: int = 0


@dataclass
class _Rate:
    """Decayed sums of prefilled tokens and busy seconds; their ratio is the rate."""

    tokens: float
    seconds: float
    mark: float = 0.0  # when the current measurement interval began

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

    def decide(self, backend: Backend, prompt_tokens: int) -> Decision:
        rate = self.tokens_per_s(backend.id)
        predicted = (backend.inflight_tokens + prompt_tokens) / rate * 1000.0
        alone = prompt_tokens / rate * 1000.0
        limit = self.factor * (
            self.ttft_target_ms + alone if self.plus_prefill else max(self.ttft_target_ms, alone)
        )
        if predicted <= limit:
            return Decision(True, predicted)
        # By then the queue ahead has drained to about the target.
        retry_after = max(1, math.ceil((predicted - self.ttft_target_ms) / 1000.0))
        return Decision(False, predicted, retry_after)

    def started(self, backend_id: str, now: float, was_idle: bool) -> None:
        if was_idle:
            self._rate(backend_id).mark = now

    def completed(self, backend_id: str, tokens: int, now: float) -> None:
        rate = self._rate(backend_id)
        elapsed = now - rate.mark
        rate.mark = now
        if elapsed <= 0.0:
            rate.tokens += tokens
            return
        rate.tokens = rate.tokens * self.decay + tokens
        rate.seconds = rate.seconds * self.decay + elapsed

    def forget(self, backend_id: str) -> None:
        self._rates.pop(backend_id, None)
