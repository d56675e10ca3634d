"""The KV hand-off prober's verdicts without engines: how a probe's counter readings are
judged, and which engines take traffic. Two routers probing one decode at once are the
case that matters: one router's probe of a broken pair makes decode compute at the very
moment another's good probe reads the counters."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from pdcluster.router.membership import Upstream
from pdcluster.router.probe import KvProber, Reading, Verdict

TOKENS = 64


def engine(role: str, n: int) -> Upstream:
    return Upstream(f"{role}-{n}", role, url=f"http://127.0.0.1:{8000 + n}", name=f"{role}-{n}")


def prober() -> KvProber:
    services: Any = SimpleNamespace(pool=None)
    return KvProber(services, interval_s=5.0, prompt_tokens=TOKENS, rng=random.Random(0))


def readings(computed: float, moved: float, failed_pulls: float | None = 0.0) -> tuple[Reading, Reading]:
    """Decode's counters before and after a probe that saw them grow so much."""
    before = Reading(
        {"local_compute": 1000.0, "external_kv_transfer": 5000.0}, 3.0 if failed_pulls is not None else None
    )
    after = Reading(
        {"local_compute": 1000.0 + computed, "external_kv_transfer": 5000.0 + moved},
        None if failed_pulls is None else 3.0 + failed_pulls,
    )
    return before, after


def test_what_decode_computed_fails_a_probe_only_when_it_can_be_the_probes_own_prompt() -> None:
    kv = prober()
    assert kv._judge(*readings(0, TOKENS)) == (True, "")
    ok, reason = kv._judge(*readings(TOKENS, 0))
    assert not ok and "computed the prompt itself" in reason
    ok, reason = kv._judge(*readings(0, TOKENS // 2))
    assert not ok and f"loaded {TOKENS // 2} of {TOKENS}" in reason
    # The prompt moved and decode computed as much besides (short prompts routed to it):
    # no pull failed, so what it computed was others'.
    assert kv._judge(*readings(3 * TOKENS, TOKENS, failed_pulls=0)) == (True, "")
    # A pull failed meanwhile: the probe's own, or another router's probe of a broken
    # pair through this decode. It fails, and the next probe tells.
    ok, reason = kv._judge(*readings(TOKENS, TOKENS, failed_pulls=1))
    assert not ok and "computed the prompt itself" in reason
    # An engine that does not count failed pulls: what it computed may be the probe's.
    assert not kv._judge(*readings(3 * TOKENS, TOKENS, failed_pulls=None))[0]


def test_a_broken_prefill_takes_no_traffic_while_another_is_not_known_broken() -> None:
    p0, p1, d0 = engine("prefill", 0), engine("prefill", 1), engine("decode", 2)
    kv = prober()
    kv.verdicts = {(p0.id, d0.id): Verdict(ok=True), (p1.id, d0.id): Verdict(ok=False)}
    assert kv.usable([p0, p1]) == [p0]
    # p0's pair not yet probed again after its engine restarted: p1 is still broken.
    kv.verdicts[(p0.id, d0.id)] = Verdict(ok=None)
    assert kv.usable([p0, p1]) == [p0]
    # Every prefill known broken: all of them rather than no answer at all.
    kv.verdicts[(p0.id, d0.id)] = Verdict(ok=False)
    assert kv.usable([p0, p1]) == [p0, p1]
    # Nothing probed yet: a router serves at start.
    kv.verdicts = {}
    assert kv.usable([p0, p1]) == [p0, p1]
