"""The KV hand-off prober's verdicts without engines: how a probe's counter readings are
judged, how a check turns probes into a verdict, and which engines then take traffic.
Two routers probing one decode at once are the case that matters: one router's probe
of a broken pair makes decode compute at the very moment another's good probe reads
the counters."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from pdcluster.router import probe as probe_module
from pdcluster.router.membership import Upstream
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.probe import FAIL_AFTER, KvProber, Verdict

TOKENS = 64


def engine(role: str, n: int) -> Upstream:
    return Upstream(f"{role}-{n}", role, url=f"http://127.0.0.1:{8000 + n}", name=f"{role}-{n}")


def prober(probes: list[bool | None] | None = None) -> KvProber:
    """A prober whose probes answer `probes` in turn, with no waiting between them."""
    services: Any = SimpleNamespace(pool=None, metrics=RouterMetrics(lambda: ([], {})))
    kv = KvProber(services, interval_s=5.0, prompt_tokens=TOKENS, rng=random.Random(0))
    answers = iter(probes or [])

    async def scripted(prefill: Upstream, decode: Upstream) -> tuple[bool | None, str]:
        ok = next(answers)
        return ok, "" if ok else "scripted"

    kv.probe = scripted  # type: ignore[method-assign]
    return kv


def readings(computed: float, moved: float) -> tuple[dict[str, float], dict[str, float]]:
    before = {"local_compute": 1000.0, "external_kv_transfer": 5000.0}
    after = {"local_compute": 1000.0 + computed, "external_kv_transfer": 5000.0 + moved}
    return before, after


def test_a_reading_where_both_counters_grew_by_the_prompt_proves_nothing() -> None:
    kv = prober()
    assert kv._judge(*readings(0, TOKENS)) == (True, "")
    assert kv._judge(*readings(TOKENS - 1, TOKENS + 200))[0] is True  # others loaded more
    ok, reason = kv._judge(*readings(TOKENS, 0))
    assert ok is False and "computed the prompt itself" in reason
    ok, reason = kv._judge(*readings(0, TOKENS // 2))
    assert ok is False and f"loaded {TOKENS // 2} of {TOKENS}" in reason
    # This router's good probe while another router's probe of a broken pair computed on
    # the same decode, or the reverse: the counters cannot tell which.
    ok, reason = kv._judge(*readings(TOKENS, TOKENS))
    assert ok is None and "as much as the probe" in reason


async def test_inconclusive_probes_neither_fail_a_passing_pair_nor_pass_a_failed_one(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(probe_module, "RETRY_AFTER_S", 0.0)
    p, d = engine("prefill", 0), engine("decode", 1)
    kv = prober([None, False, None, False, None, None])
    kv.verdicts[(p.id, d.id)] = Verdict(ok=True)
    assert (await kv.check(p, d)).ok is True  # 2 failures of 6 probes: not FAIL_AFTER
    kv = prober([None, True])
    kv.verdicts[(p.id, d.id)] = Verdict(ok=False, reason="broken")
    assert (await kv.check(p, d)).ok is True  # the retry passed
    kv = prober([None] * 6)
    kv.verdicts[(p.id, d.id)] = Verdict(ok=False, reason="broken")
    verdict = await kv.check(p, d)
    assert verdict.ok is False and verdict.reason == "broken"
    kv = prober([None] * 6)
    assert (await kv.check(p, d)).ok is None  # a new pair stays unverified, probed next round


async def test_a_passing_pair_fails_after_fail_after_failures_and_a_failed_one_after_one(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(probe_module, "RETRY_AFTER_S", 0.0)
    p, d = engine("prefill", 0), engine("decode", 1)
    kv = prober([False, None] * FAIL_AFTER)
    kv.verdicts[(p.id, d.id)] = Verdict(ok=True)
    assert (await kv.check(p, d)).ok is False
    kv = prober([False])
    kv.verdicts[(p.id, d.id)] = Verdict(ok=False)
    assert (await kv.check(p, d)).ok is False


def test_a_broken_prefill_takes_no_traffic_when_the_verified_one_is_away() -> None:
    p0, p1, d0 = engine("prefill", 0), engine("prefill", 1), engine("decode", 2)
    kv = prober()
    kv.verdicts = {(p0.id, d0.id): Verdict(ok=True), (p1.id, d0.id): Verdict(ok=False)}
    assert kv.usable([p0, p1], last_resort=False) == [p0]
    # p0 re-resolving its engine ids, cooling down, or its pair re-checked: p1 is still broken.
    assert kv.usable([p1], last_resort=False) == []
    kv.verdicts[(p0.id, d0.id)] = Verdict(ok=None)
    assert kv.usable([p0, p1], last_resort=False) == [p0]
    # Decode has no one to hand its requests to: a broken one serves as a last resort.
    kv.verdicts = {(p0.id, d0.id): Verdict(ok=False)}
    assert kv.usable([d0]) == [d0]
    # Nothing probed yet: a router serves at start.
    kv.verdicts = {}
    assert kv.usable([p0, p1], last_resort=False) == [p0, p1]
