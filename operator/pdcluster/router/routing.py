"""Where an attempt goes, as a pure function: first attempts and retries alike.

A prefill rank and a colocated engine are weighed alike by the policy (prompt tokens
not yet prefilled); a prefill then gets a decode partner: least loaded, of its engine
revision (only equal revisions exchange KV, rollout.py), not in a pair whose hand-off
failed its probe unless every pair of that prefill has. When no prefill or colocated
engine is left, a retry may send the prompt to decode alone, which computes it itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from pdcluster.constants import ROLE_COLOCATED
from pdcluster.router.membership import Upstream
from pdcluster.router.policy import ExactBlocks, LeastLoaded, Policy


@dataclass(frozen=True)
class Prompt:
    """What the policies weigh: its length, its prefix-block hashes, and its blocks as
    the engines hash them where known."""

    tokens: int
    hashes: Sequence[Hashable] = ()
    exact: ExactBlocks | None = None


@dataclass(frozen=True)
class Route:
    """An attempt's engines. `prefill` None: `decode` serves the prompt whole (a
    colocated engine, or decode alone computing or loading the prompt)."""

    prefill: Upstream | None
    decode: Upstream

    @property
    def engine(self) -> Upstream:
        """The engine the prompt is prefilled on: what a cache-aware policy learns."""
        return self.prefill or self.decode

    @property
    def colocated(self) -> bool:
        return self.decode.role == ROLE_COLOCATED


@dataclass(frozen=True)
class Engines:
    """The engines an attempt may use: routable, and not tried for this request."""

    prefill: list[Upstream]
    decode: list[Upstream]
    colocated: list[Upstream]

    def without(self, tried: set[str]) -> Engines:
        def keep(upstreams: list[Upstream]) -> list[Upstream]:
            return [u for u in upstreams if u.id not in tried]

        return Engines(keep(self.prefill), keep(self.decode), keep(self.colocated))


def route(
    engines: Engines,
    prompt: Prompt,
    policy: Policy,
    decode_policy: LeastLoaded,
    broken: Callable[[Upstream, Upstream], bool] = lambda prefill, decode: False,
    decode_alone: bool = False,
    prefill_on_decode_below: int = 0,
) -> Route | None:
    """The attempt's route, or None when no engine can take it. A prompt shorter than
    `prefill_on_decode_below` tokens goes to its decode engine alone, which prefills it
    (conditional disaggregation: a short prompt's hand-off costs more than it saves)."""
    revisions = {d.revision for d in engines.decode}
    candidates = [p for p in engines.prefill if p.revision in revisions] + engines.colocated
    first = policy.pick(candidates, prompt.tokens, prompt.hashes, prompt.exact)
    if first is None:
        decode = decode_policy.pick(engines.decode, prompt.tokens) if decode_alone else None
        return None if decode is None else Route(None, decode)
    if first.role == ROLE_COLOCATED:
        return Route(None, first)
    same = [d for d in engines.decode if d.revision == first.revision]
    partners = [d for d in same if not broken(first, d)] or same
    decode = decode_policy.pick(partners, prompt.tokens)
    assert decode is not None, "a candidate prefill always has a partner of its revision"
    if prompt.tokens < prefill_on_decode_below:
        return Route(None, decode)
    return Route(first, decode)
