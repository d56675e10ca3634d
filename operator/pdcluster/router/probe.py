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
the same counters, so a bad pair's probe never passes (its own prompt is always among
the computed tokens) and a reading where both counters grew by the whole prompt proves
nothing either way: another router probing a broken pair through the same decode at the
same moment looks exactly like it. Such a probe is inconclusive and is tried again.

New pairs are probed as soon as both engines are known, and an engine takes traffic only
once one of its pairs has passed. While none has (at start, so a router never refuses
to serve), every engine not known broken does. A prefill whose every pair failed takes
no traffic (with no other prefill left, decode computes the prompt alone); such a decode
takes traffic only when no other decode is left. Then, every interval, the failed pairs
and a few sampled others. A passing pair fails after three failed probes in a row, and
is left out of rotation until one probe passes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pdcluster import observability as obs
from pdcluster.router.attempt import Services
from pdcluster.router.handoff import Handoff, discard
from pdcluster.router.membership import Upstream
from pdcluster.router.upstream import UpstreamError

log = logging.getLogger(__name__)

PROBE_OUTCOME = {True: "passed", False: "failed", None: "inconclusive"}

BY_SOURCE = obs.VLLM_PROMPT_TOKENS_BY_SOURCE + "_total"
PROBE_TIMEOUT_S = 60.0
FAIL_AFTER = 3  # failed probes in a row that take a pair out of rotation
PROBES_PER_CHECK = 6  # at most, inconclusive ones included
RETRY_AFTER_S = 0.2  # on average: jittered, so routers probing one decode fall out of step


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

    def usable(self, upstreams: list[Upstream], last_resort: bool = True) -> list[Upstream]:
        """Engines with a passed pair; while none of these has one, those not known
        broken (every pair failed); the broken ones only as a `last_resort` (a prefill's
        requests can go to decode alone instead)."""
        passed: set[str] = set()
        failed: set[str] = set()
        for pair, verdict in self.verdicts.items():
            if verdict.ok is not None:
                (passed if verdict.ok else failed).update(pair)
        chosen = [u for u in upstreams if u.id in passed]
        return chosen or [u for u in upstreams if u.id not in failed] or (upstreams if last_resort else [])

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
        due = [key for key in pairs if self.verdicts.get(key, Verdict()).ok is None]
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
        """Probe until a pass, or until enough failures to judge the pair (one for a pair
        already failed, FAIL_AFTER in a row otherwise); inconclusive probes judge nothing,
        and a check of only those leaves the verdict as it was."""
        verdict = self.verdicts.setdefault((prefill.id, decode.id), Verdict())
        failures_needed = FAIL_AFTER if verdict.ok is not False else 1
        ok: bool | None = None
        reason, failures = "", 0
        for attempt in range(PROBES_PER_CHECK):
            if attempt:
                await asyncio.sleep(self.rng.uniform(0.5, 1.5) * RETRY_AFTER_S)
            ok, reason = await self.probe(prefill, decode)
            self.services.metrics.kv_probes[PROBE_OUTCOME[ok]].inc()
            failures += ok is False
            if ok or failures == failures_needed:
                break
        if ok is None or (ok is False and failures < failures_needed):
            return verdict
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

    async def probe(self, prefill: Upstream, decode: Upstream) -> tuple[bool | None, str]:
        """One hand-off through the pair; (passed, or None when inconclusive; why not)."""
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
                before = await self._by_source(decode)
                failure = await self._through(handoff, prefill, decode, body, transfer_id)
                if failure:
                    return False, failure
                after = await self._by_source(decode)
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

    def _judge(
        self, before: dict[str, float] | None, after: dict[str, float] | None
    ) -> tuple[bool | None, str]:
        """Whether decode's counters say it loaded the probe's prompt rather than computing
        it; None when they grew enough for either."""
        if before is None or after is None:
            return True, f"decode has no {BY_SOURCE}: the hand-off cannot be verified"
        moved = after.get("external_kv_transfer", 0.0) - before.get("external_kv_transfer", 0.0)
        computed = after.get("local_compute", 0.0) - before.get("local_compute", 0.0)
        figures = f"{computed:.0f} tokens computed, {moved:.0f} moved"
        if moved < self.prompt_tokens:
            if computed >= self.prompt_tokens:
                return False, f"decode computed the prompt itself ({figures})"
            return False, f"decode loaded {moved:.0f} of {self.prompt_tokens} prompt tokens over the hand-off"
        if computed >= self.prompt_tokens:
            return None, f"other requests moved the counters as much as the probe ({figures})"
        return True, ""

    async def _by_source(self, decode: Upstream) -> dict[str, float] | None:
        _, payload = await self.services.engines.get_read(decode, b"/metrics")
        text = payload.decode("utf-8", "replace")
        if BY_SOURCE.removesuffix("_total") not in text:
            return None
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == BY_SOURCE:
                    source = s.labels.get("source", "")
                    out[source] = out.get(source, 0.0) + s.value
        return out
