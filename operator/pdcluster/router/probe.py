"""KV hand-off verification: the router proves that each prefill -> decode pair really
moves KV before trusting it, and keeps checking.

A probe is one request through the pair as the router sends any other (a prefill of a
random token-id prompt, then decode with the hand-off parameters and one output token),
judged by decode's own counters: `vllm:prompt_tokens_by_source_total` (vLLM 0.32
v1/metrics/loggers.py) must have grown by the whole prompt under
`source="external_kv_transfer"` and by less than it under `local_compute`. A decode that
recomputed the prompt instead (a failed pull under `kv_load_failure_policy: recompute`,
a connector silently off) grows `local_compute` by the whole prompt; that, a failed
request, or too small a growth fails the probe. Other requests on the same decode move
the same counters. They never make a bad pair's probe pass (its own prompt is always
among the computed tokens), but prompts decode computes itself (short ones, or another
router's probe of a broken pair) would fail a good pair's. Where decode counts its failed
pulls (`vllm:mooncake_num_failed_recvs`), a reading where both counters grew by the
whole prompt and no pull failed passes: the probe's prompt was moved, and what decode
computed was others'.

New pairs are probed as soon as both engines are known, and an engine takes traffic only
once one of its pairs has passed. While none of its role has (at start, so a router
never refuses to serve), every engine not known broken does, and all of them only when
every one is. Then, every interval, the failed pairs and a few sampled others. A passing
pair fails after three failed probes in a row (retried after a jittered pause, so that
routers probing one decode fall out of step), and is left out of rotation until one
probe passes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pdcluster import observability as obs
from pdcluster.router.attempt import Services
from pdcluster.router.handoff import Handoff, discard
from pdcluster.router.membership import Upstream
from pdcluster.router.upstream import UpstreamError

log = logging.getLogger(__name__)

BY_SOURCE = obs.VLLM_PROMPT_TOKENS_BY_SOURCE + "_total"
FAILED_RECVS = obs.VLLM_MOONCAKE_FAILED_RECVS + "_total"
PROBE_TIMEOUT_S = 60.0
FAIL_AFTER = 3  # failed probes in a row that take a pair out of rotation
RETRY_AFTER_S = 0.2  # on average: each pause is drawn from 0.5-1.5 times it


@dataclass
class Verdict:
    ok: bool | None = None  # None: not probed yet
    reason: str = ""
    checked_at: float = 0.0


class KvProber:
    """Probes and their verdicts, by (prefill id, decode id)."""

    def __init__(
        self,
        services: Services,
        interval_s: float,
        prompt_tokens: int,
        sample: int = 4,
        on_change: Callable[[], None] = lambda: None,
        rng: random.Random | None = None,
    ):
        self.services = services
        self.pool = services.pool
        self.interval_s = interval_s
        self.prompt_tokens = prompt_tokens
        self.sample = sample
        self.on_change = on_change
        self.rng = rng or random.Random()
        self.verdicts: dict[tuple[str, str], Verdict] = {}
        self._last_round = 0.0

    # ------------------------------------------------------------------ routing
    def broken(self, prefill: Upstream, decode: Upstream) -> bool:
        verdict = self.verdicts.get((prefill.id, decode.id))
        return verdict is not None and verdict.ok is False

    def usable(self, upstreams: list[Upstream]) -> list[Upstream]:
        """Engines with a passed pair; while none of these has one, those not known
        broken (every pair probed failed); all of them only when every one is."""
        passed: set[str] = set()
        failed: set[str] = set()
        for pair, verdict in self.verdicts.items():
            if verdict.ok is not None:
                (passed if verdict.ok else failed).update(pair)
        chosen = [u for u in upstreams if u.id in passed]
        return chosen or [u for u in upstreams if u.id not in failed] or upstreams

    def settled(self) -> bool:
        """Every pair the pool has now has a verdict."""
        pool = self.pool
        pairs = {(p.id, d.id) for p in pool.prefill for d in pool.decode if p.revision == d.revision}
        return all(self.verdicts.get(pair, Verdict()).ok is not None for pair in pairs)

    def summary(self) -> dict[str, object]:
        """What the operator's KVTransfer condition says: counts, and each failed pair."""
        names = {u.id: u.name for u in self.pool.all_upstreams()}
        failed = [
            {"prefill": names.get(p, p), "decode": names.get(d, d), "reason": v.reason}
            for (p, d), v in sorted(self.verdicts.items())
            if v.ok is False
        ]
        passed = sum(1 for v in self.verdicts.values() if v.ok)
        return {"pairs": len(self.verdicts), "passed": passed, "failed": failed}

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        pool = self.pool
        while True:
            pool.changed.clear()
            try:
                await self.round(time.monotonic())
            except Exception:  # a bug must not end verification for the router's life
                log.exception("KV hand-off probes failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pool.changed.wait(), 1.0)

    async def round(self, now: float) -> None:
        """Probe the pairs due: new ones always, failed and sampled ones each interval."""
        pool = self.pool
        pairs = {(p.id, d.id): (p, d) for p in pool.prefill for d in pool.decode if p.revision == d.revision}
        before = self.summary()
        for key in set(self.verdicts) - set(pairs):
            del self.verdicts[key]
        due = [key for key in pairs if key not in self.verdicts]
        if now - self._last_round >= self.interval_s:
            self._last_round = now
            failed = [key for key, v in self.verdicts.items() if v.ok is False and key not in due]
            others = [key for key, v in self.verdicts.items() if v.ok and key not in due]
            due += failed + self.rng.sample(others, min(self.sample, len(others)))
        for key in due:
            await self.check(*pairs[key])
        verdicts = [v.ok for v in self.verdicts.values()]
        for name, value in (("passed", True), ("failed", False), ("unverified", None)):
            self.services.metrics.kv_pairs.labels(name).set(verdicts.count(value))
        if self.summary() != before:
            self.on_change()

    async def check(self, prefill: Upstream, decode: Upstream) -> Verdict:
        verdict = self.verdicts.setdefault((prefill.id, decode.id), Verdict())
        ok, reason = await self.probe(prefill, decode)
        for _ in range(FAIL_AFTER - 1 if verdict.ok is not False else 0):
            if ok:
                break
            # Other requests on this decode can fail a good pair's probe (computing while
            # a pull fails), never pass a bad one's (its own prompt is recomputed).
            self.services.metrics.kv_probes["failed"].inc()
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * RETRY_AFTER_S)
            ok, reason = await self.probe(prefill, decode)
        self.services.metrics.kv_probes["passed" if ok else "failed"].inc()
        if ok != verdict.ok:
            log.log(
                logging.INFO if ok else logging.WARNING,
                "KV hand-off %s -> %s: %s",
                prefill.name,
                decode.name,
                "verified" if ok else reason,
            )
        verdict.ok, verdict.reason, verdict.checked_at = ok, reason, time.monotonic()
        return verdict

    async def probe(self, prefill: Upstream, decode: Upstream) -> tuple[bool, str]:
        """One hand-off through the pair; (passed, why not)."""
        if prefill.engine is None:
            return False, "the prefill engine has no engine id yet"
        tokens = [self.rng.randrange(10, 1000) for _ in range(self.prompt_tokens)]
        body: dict[str, object] = {"prompt": tokens, "max_tokens": 1, "temperature": 0}
        if self.services.config.model:
            body["model"] = self.services.config.model
        transfer_id = f"probe-{self.rng.getrandbits(96):024x}"
        request_id = f"kv-probe-{transfer_id[6:]}"
        handoff = Handoff(self.services.engines, self.services.protocol, b"/v1/completions", request_id)
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                before = await self._reading(decode)
                failure = await self._through(handoff, prefill, decode, body, transfer_id)
                if failure:
                    return False, failure
                after = await self._reading(decode)
        except (UpstreamError, TimeoutError) as e:
            return False, f"probe failed: {e or 'no answer'}"
        return self._judge(before, after)

    async def _through(
        self, handoff: Handoff, prefill: Upstream, decode: Upstream, body: dict[str, object], transfer_id: str
    ) -> str:
        """Send the probe through the pair as a client's request goes: why it failed, or ''."""
        decode_task = handoff.send_decode(decode, body, transfer_id, prefill.engine)
        try:
            status, payload = await handoff.send_prefill(prefill, body, transfer_id)
        except BaseException:
            discard(decode_task)
            raise
        if status != 200:
            discard(decode_task)
            return f"prefill answered HTTP {status}: {payload[:200]!r}"
        response = await decode_task
        try:
            status, payload = response.status, await response.read()
        finally:
            response.close()
        return f"decode answered HTTP {status}: {payload[:200]!r}" if status != 200 else ""

    def _judge(self, before: Reading | None, after: Reading | None) -> tuple[bool, str]:
        """Whether decode's counters say it loaded the probe's prompt rather than computing it."""
        if before is None or after is None:
            return True, f"decode has no {BY_SOURCE}: the hand-off cannot be verified"
        moved = after.tokens("external_kv_transfer") - before.tokens("external_kv_transfer")
        computed = after.tokens("local_compute") - before.tokens("local_compute")
        # What decode computed is the probe's prompt unless that prompt moved and no pull
        # failed meanwhile (without the counter, it might be).
        pull_failed = before.failed_recvs is None or after.failed_recvs != before.failed_recvs
        if computed >= self.prompt_tokens and (moved < self.prompt_tokens or pull_failed):
            return (
                False,
                f"decode computed the prompt itself ({computed:.0f} tokens computed, {moved:.0f} moved)",
            )
        if moved < self.prompt_tokens:
            return False, f"decode loaded {moved:.0f} of {self.prompt_tokens} prompt tokens over the hand-off"
        return True, ""

    async def _reading(self, decode: Upstream) -> Reading | None:
        _, payload = await self.services.engines.get_read(decode, b"/metrics")
        text = payload.decode("utf-8", "replace")
        if BY_SOURCE.removesuffix("_total") not in text:
            return None
        reading = Reading()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == BY_SOURCE:
                    source = s.labels.get("source", "")
                    reading.by_source[source] = reading.by_source.get(source, 0.0) + s.value
                elif s.name == FAILED_RECVS:
                    reading.failed_recvs = (reading.failed_recvs or 0.0) + s.value
        return reading


@dataclass
class Reading:
    """Decode's counters around a probe: prompt tokens by source, failed KV pulls (None
    where the engine does not count them)."""

    by_source: dict[str, float] = field(default_factory=dict)
    failed_recvs: float | None = None

    def tokens(self, source: str) -> float:
        return self.by_source.get(source, 0.0)
