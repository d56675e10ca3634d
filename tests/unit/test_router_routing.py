"""The router's one routing function (first attempts and retries) and the lease an
attempt holds on its engines' load counters."""

from __future__ import annotations

from pdcluster.router.attempt import Lease
from pdcluster.router.membership import Upstream
from pdcluster.router.policy import Admission, LeastLoaded, PrefixAware
from pdcluster.router.routing import Engines, Prompt, Route, route


def engine(role: str, n: int, revision: str = "a", tokens: int = 0) -> Upstream:
    return Upstream(f"{role}-{n}", role, inflight_tokens=tokens, url=f"http://127.0.0.1:{8000 + n}", revision=revision)


def test_a_prefill_gets_the_least_loaded_decode_of_its_revision() -> None:
    p1, p2 = engine("prefill", 1, tokens=500), engine("prefill", 2, revision="b")
    d1, d2, d3 = engine("decode", 3, tokens=900), engine("decode", 4, tokens=100), engine("decode", 5, revision="c")
    chosen = route(Engines([p1, p2], [d1, d2, d3], []), Prompt(64), LeastLoaded(), LeastLoaded())
    # p2's revision has no decode: it is no candidate although it is idle.
    assert chosen == Route(p1, d2)
    assert not chosen.colocated and chosen.engine is p1


def test_a_colocated_engine_is_weighed_with_the_prefill_ranks() -> None:
    prefill, decode, colocated = engine("prefill", 1, tokens=800), engine("decode", 2), engine("colocated", 3)
    chosen = route(Engines([prefill], [decode], [colocated]), Prompt(64), LeastLoaded(), LeastLoaded())
    assert chosen == Route(None, colocated)
    assert chosen.colocated and chosen.engine is colocated


def test_a_broken_pair_is_avoided_unless_every_pair_of_the_prefill_is_broken() -> None:
    prefill = engine("prefill", 1)
    good, bad = engine("decode", 2, tokens=1000), engine("decode", 3)
    engines = Engines([prefill], [good, bad], [])
    chosen = route(engines, Prompt(64), LeastLoaded(), LeastLoaded(), lambda p, d: d is bad)
    assert chosen == Route(prefill, good)
    every = route(engines, Prompt(64), LeastLoaded(), LeastLoaded(), lambda p, d: True)
    assert every == Route(prefill, bad)  # still served: the least loaded of them


def test_decode_alone_only_when_asked_and_nothing_else_is_left() -> None:
    tried_prefill, decode = engine("prefill", 1), engine("decode", 2)
    engines = Engines([tried_prefill], [decode], []).without({tried_prefill.id})
    assert engines.prefill == [] and engines.decode == [decode]
    assert route(engines, Prompt(64), LeastLoaded(), LeastLoaded()) is None
    assert route(engines, Prompt(64), LeastLoaded(), LeastLoaded(), decode_alone=True) == Route(None, decode)
    assert route(Engines([], [], []), Prompt(64), LeastLoaded(), LeastLoaded(), decode_alone=True) is None


def test_the_policy_sees_the_prompt_hashes() -> None:
    p1, p2, decode = engine("prefill", 1), engine("prefill", 2), engine("decode", 3)
    policy = PrefixAware(block_tokens=16)
    policy.record(p2.id, ["h1", "h2"])
    chosen = route(Engines([p1, p2], [decode], []), Prompt(64, ("h1", "h2")), policy, LeastLoaded())
    assert chosen == Route(p2, decode)
    cached = policy.cached(p2, 64, ("h1", "h2"), None)
    assert cached is not None and cached.tokens == 32 and not cached.from_events
    assert LeastLoaded().cached(p2, 64, ("h1", "h2"), None) is None


def test_a_lease_gives_each_counter_back_once() -> None:
    prefill, decode = engine("prefill", 1), engine("decode", 2)
    lease = Lease(Route(prefill, decode), prompt_tokens=100, output_tokens=20, admission=None)
    assert (prefill.inflight_requests, prefill.inflight_tokens) == (1, 100)
    assert (decode.inflight_requests, decode.inflight_tokens) == (1, 120)
    lease.prefill_done(ok=True)
    lease.prefill_done(ok=True)
    assert (prefill.inflight_requests, prefill.inflight_tokens) == (0, 0)
    lease.release()
    assert (prefill.inflight_requests, prefill.inflight_tokens) == (0, 0)
    assert (decode.inflight_requests, decode.inflight_tokens) == (0, 0)


def test_a_colocated_lease_counts_its_prompt_until_the_first_token() -> None:
    colocated = engine("colocated", 1)
    admission = Admission(ttft_target_ms=500, factor=2)
    lease = Lease(Route(None, colocated), prompt_tokens=100, output_tokens=20, admission=admission)
    assert (colocated.inflight_requests, colocated.inflight_tokens) == (1, 100)
    lease.first_token()
    lease.first_token()
    assert (colocated.inflight_requests, colocated.inflight_tokens) == (1, 0)
    lease.release()
    assert (colocated.inflight_requests, colocated.inflight_tokens) == (0, 0)


def test_a_short_prompt_is_prefilled_by_its_decode_engine() -> None:
    prefill, decode = engine("prefill", 1), engine("decode", 2)
    engines = Engines([prefill], [decode], [])
    short = route(engines, Prompt(100), LeastLoaded(), LeastLoaded(), prefill_on_decode_below=512)
    assert short == Route(None, decode) and not short.colocated
    long = route(engines, Prompt(512), LeastLoaded(), LeastLoaded(), prefill_on_decode_below=512)
    assert long == Route(prefill, decode)
    off = route(engines, Prompt(100), LeastLoaded(), LeastLoaded())
    assert off == Route(prefill, decode)
