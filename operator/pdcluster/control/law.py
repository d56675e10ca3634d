"""The prefill:decode control law (a colocated pool's is pool.py; `decide` runs either).

`decide` runs every `autoscaling.intervalSeconds`. It is pure: everything it remembers
lives in AutoscalingState (status), the time is passed in, and the latency profile is
loaded once and cached. The same code runs in the operator and in the fleet simulator.

Per role it computes two engine counts from a calibrated capacity model (models.py):
`need_up`, the fewest engines that keep the SLO quantile under target x (1 + tol), and
`need_down`, the fewest that keep it under target x (1 - tol). Below `need_up` it scales
up (fast); above `need_down` it scales down (slowly, and only with headroom observed);
in between it holds. The band between the two is the hysteresis that keeps a steady
load from flapping; both counts are computed for the load plus the tolerance, room for
it to grow while new engines start. A reactive rule adds one engine when the SLO is
violated and the model did not see why. At the GPU budget a role that misses its
target takes engines from the other role only while that one meets its own, never
below its model floor, and only once that role's scale-down has been wanted for the
whole metrics window (a voluntary scale-down waits out the longer stabilization window);
when both miss, engines move only if that clearly lowers the worse of the two shortfalls.

Guards against the known failure modes of P/D autoscalers: metrics missing or no
traffic -> hold; a scale-up whose pods never become ready -> time out, fall back to
what is ready and stop asking for that role a while; state older than a few intervals
-> its timers are discarded; the autoscaler never reads back its own pending targets as
capacity (it calibrates on ready engines only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from pdcluster import observability as obs
from pdcluster import perf
from pdcluster.api.v1alpha1 import (
    AutoscalingMode,
    AutoscalingState,
    Decision,
    LoadSample,
    ObservedMetrics,
    PDClusterSpec,
    ServingMode,
    TTFTStages,
)
from pdcluster.control import learn, models
from pdcluster.control.cause import Cause, Figures, summary
from pdcluster.control.pool import decide_pool
from pdcluster.control.types import MetricsSnapshot, Observed, TTFTBreakdown, breakdown
from pdcluster.timestamps import parse, time_ms

ROLES = ("prefill", "decode")
# Without a reachable TTFT target (prompts whose own prefill exceeds it) prefill is
# sized so that queueing adds at most this share of the target.
QUEUEING_SHARE = 0.2
MAX_GROWTH = 2.0  # the most a trend may grow the load in one window (start-up transients)


@dataclass
class _Need:
    """What the model says one role needs, and why."""

    up: int  # fewest engines within target x (1 + tol)
    down: int  # fewest engines within target x (1 - tol)
    pressure: float = 0.0  # observed quantile / target (0 when unseen)
    violated: bool = False  # observed quantile above target x (1 + tol)
    headroom: bool = False  # observed quantile below target x (1 - tol)
    reactive: bool = False  # violated although the model was content: add one
    cause_up: Cause = Cause.within_targets  # why more engines, if more
    cause_down: Cause = Cause.within_targets  # why fewer, if fewer
    load_engines: float | None = None  # the work, in busy engines, where the model has it
    notes: list[str] = field(default_factory=list)


def decide(
    spec: PDClusterSpec,
    metrics: MetricsSnapshot | None,
    state: AutoscalingState | None,
    observed: Observed,
    now: datetime,
    *,
    profile: perf.Profile | None = None,
) -> tuple[AutoscalingState, Decision]:
    """One run of the control law: the next state (to status) and the decision taken."""
    if spec.mode == ServingMode.colocated:
        return decide_pool(spec, metrics, state, observed.colocated, now)
    return _Run(spec, metrics, state, observed, now, profile).run()


class _Run:
    def __init__(self, spec, metrics, state, observed, now, profile) -> None:
        self.spec: PDClusterSpec = spec
        self.auto = spec.autoscaling
        self.metrics: MetricsSnapshot | None = metrics
        self.prev = state or AutoscalingState()
        self.observed: Observed = observed
        self.now = now if now.tzinfo else now.replace(tzinfo=UTC)
        self.now_s = time_ms(self.now)
        # The prior: the caller's (a ConfigMap's), else the named shipped one, else none.
        self.prior = profile or (perf.load(self.auto.profile) if self.auto.profile else None)
        self.capacity = self.prev.capacity
        self.profile: perf.Profile | None = self.prior
        self.known = dict.fromkeys(ROLES, self.prior is not None)
        self.unseen: dict[str, str] = {}  # role -> why its capacity is not known yet
        self.recommend = self.auto.mode == AutoscalingMode.recommend
        self.tol = self.auto.tolerance_percent / 100.0
        self.notes: list[str] = []
        stale = self._stale()
        self.up_since = {} if stale else dict(self.prev.up_wanted_since or {})
        self.down_since = {} if stale else dict(self.prev.down_wanted_since or {})
        self.history = [] if stale else list(self.prev.history or [])
        self.pending = dict(self.prev.pending_since or {})
        self.blocked = {r: t for r, t in (self.prev.blocked_until or {}).items() if parse(t) > self.now}
        self.stored: dict[str, int] = {}
        self.events: dict[Cause, str] = {}  # what happened on the way, and to which role
        self.stages: TTFTBreakdown | None = None
        self.needs: dict[str, _Need] = {}  # what the model says each role needs, for the summary
        self.wants: dict[str, int] = {}
        self.current = self._current()

    # ------------------------------------------------------------------ helpers
    def _stale(self) -> bool:
        """Timers only mean "wanted continuously" if the law kept running."""
        if self.prev.last_run_time is None:
            return True
        gap = (self.now - parse(self.prev.last_run_time)).total_seconds()
        return gap > max(3 * self.auto.interval_seconds, self.auto.window_seconds)

    def _bounds(self, role: str) -> tuple[int, int]:
        r = self.spec.role(role)
        return r.min_replicas, max(r.max_replicas, r.min_replicas)

    def _gpus(self, role: str) -> int:
        return max(self.spec.role(role).gpus, 1)

    def _gpu_total(self, counts: dict[str, int]) -> int:
        return sum(counts[r] * self._gpus(r) for r in ROLES)

    def _current(self) -> dict[str, int]:
        out = {}
        for role in ROLES:
            if self.recommend:
                value = self.observed.role(role).desired
            else:
                stored = getattr(self.prev, role)
                value = stored if stored is not None else self.spec.role(role).replicas
            self.stored[role] = value
            low, high = self._bounds(role)
            if not low <= value <= high:
                self.notes.append(f"{role} {value} outside [{low}, {high}]: clamped")
            out[role] = min(max(value, low), high)
        budget = self.auto.gpu_budget
        if budget is not None and self._gpu_total(out) > budget:
            out = self._split_budget({r: out[r] for r in ROLES}, budget)
            self.notes.append(f"over the GPU budget {budget}: cut to {out['prefill']}:{out['decode']}")
        return out

    def _split_budget(self, wants: dict[str, int], budget: int) -> dict[str, int]:
        """Share a budget that cannot hold both wishes in proportion to them (mins kept)."""
        gp, gd = self._gpus("prefill"), self._gpus("decode")
        (p_min, p_max), (d_min, d_max) = self._bounds("prefill"), self._bounds("decode")
        total = wants["prefill"] * gp + wants["decode"] * gd
        share = math.floor(budget * wants["prefill"] * gp / total / gp) if total else p_min
        p = min(max(share, p_min), max(p_min, (budget - d_min * gd) // gp), p_max)
        d = min(max((budget - p * gp) // gd, d_min), d_max)
        return {"prefill": p, "decode": d}

    def _in_flight(self, role: str) -> bool:
        return not self.recommend and self.current[role] > self.observed.role(role).ready

    # ------------------------------------------------------------------ steps
    def run(self) -> tuple[AutoscalingState, Decision]:
        hold = f"hold {self.current['prefill']}:{self.current['decode']}"
        if not self.auto.enabled or self.spec.suspend:
            why = "autoscaling disabled" if not self.auto.enabled else "cluster suspended"
            cause = Cause.disabled if not self.auto.enabled else Cause.suspended
            return self._finish(dict(self.current), self._with_notes(f"{why}: {hold}"), cause)
        fallback = self._time_out_scale_ups()
        if fallback:
            return self._finish(fallback, "; ".join(self.notes), Cause.scale_up_timed_out)
        m = self.metrics
        if m is None or m.request_rate <= 0 or m.mean_input_tokens is None or m.mean_output_tokens is None:
            # Nothing to go on: no timer may keep running across the gap.
            self.up_since.clear()
            self.down_since.clear()
            why = (
                "metrics unavailable (Prometheus unreachable or no series)"
                if m is None
                else f"no traffic in the last {m.window_s} s"
            )
            cause = Cause.metrics_unavailable if m is None else Cause.no_traffic
            return self._finish(dict(self.current), self._with_notes(f"{why}: {hold}"), cause)
        self._record(m)
        self.stages = breakdown(m)
        self.capacity = learn.update(self.capacity, m)
        known = learn.knowledge(self.capacity, self.prior, m)
        self.profile, self.known = known.profile, {"prefill": known.prefill, "decode": known.decode}
        self.unseen = known.unseen
        needs = {
            role: (self._prefill_need(m) if role == "prefill" else self._decode_need(m))
            if self.known[role]
            else self._feedback_need(role, m)
            for role in ROLES
        }
        wants = {r: self._want(r, needs[r]) for r in ROLES}
        wants, donor = self._fit_budget(wants, needs)
        self.needs, self.wants = needs, wants
        target = self._stabilise(wants, donor)
        cause, role = self._cause(needs, wants, target)
        return self._finish(target, self._reason(m, needs, target), cause, role)

    def _with_notes(self, reason: str) -> str:
        return f"{reason} ({'; '.join(self.notes)})" if self.notes else reason

    def _time_out_scale_ups(self) -> dict[str, int] | None:
        """Fall back to the ready count when a scale-up has waited too long for its pods."""
        if self.recommend:
            self.pending.clear()
            return None
        timeout = self.auto.scale_up_timeout_seconds
        out = None
        for role in ROLES:
            obs = self.observed.role(role)
            if self.current[role] <= obs.ready:
                self.pending.pop(role, None)
                continue
            since = parse(self.pending.setdefault(role, self.now_s))
            waited = (self.now - since).total_seconds()
            if waited < timeout:
                continue
            low, _ = self._bounds(role)
            out = out or dict(self.current)
            out[role] = max(low, obs.ready)
            self.pending.pop(role, None)
            self.up_since.pop(role, None)
            self.blocked[role] = time_ms(self.now + timedelta(seconds=timeout))
            self.events.setdefault(Cause.scale_up_timed_out, role)
            stuck = f", {obs.unschedulable} unschedulable" if obs.unschedulable else ""
            self.notes.append(
                f"{role} scale-up to {self.current[role]} not ready after {waited:.0f} s "
                f"({obs.ready} ready{stuck}): falling back to {out[role]}, no {role} scale-up "
                f"for {timeout} s"
            )
        return out

    def _engines_seen(self, role: str, seen: float | None) -> float:
        return seen if seen is not None else float(self.observed.role(role).ready)

    def _limit(self, role: str) -> int:
        _, high = self._bounds(role)
        budget = self.auto.gpu_budget
        return high if budget is None else min(high, budget // self._gpus(role))

    def _record(self, m: MetricsSnapshot) -> None:
        """Keep this run's demand with those of the last window (the trend's input)."""
        horizon = self.now - timedelta(seconds=self.auto.window_seconds)
        self.history = [h for h in self.history if horizon <= parse(h.time) < self.now]
        prefill, decode = demand(m)
        self.history.append(LoadSample(time=self.now_s, prefill=round(prefill), decode=round(decode)))

    def _growth(self, role: str) -> float:
        """How much the role's demand grows over the next window if its trend goes on.

        Engines asked for now serve a load one window later (the measurement lags by half
        a window, a start-up takes about another half). The trend is the least-squares
        slope of the demand the runs of the last window saw; with fewer than three runs
        behind it, prefill falls back to the window before this one (what Prometheus
        shows without history) and decode has none. A falling load is not extrapolated:
        scaling down stays cautious.
        """
        window = self.auto.window_seconds
        points = [((parse(h.time) - self.now).total_seconds(), float(getattr(h, role))) for h in self.history]
        current = points[-1][1] if points else 0.0
        if len(points) >= 3 and current > 0:
            mean_t = sum(t for t, _ in points) / len(points)
            mean_v = sum(v for _, v in points) / len(points)
            spread = sum((t - mean_t) ** 2 for t, _ in points)
            slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / spread if spread else 0.0
            growth = 1.0 + slope * window / current
        elif role == "prefill" and self.metrics and self.metrics.request_rate_before:
            growth = self.metrics.request_rate / self.metrics.request_rate_before
        else:
            growth = 1.0
        return min(max(growth, 1.0), MAX_GROWTH)

    def _grown(self, model, role: str):
        """The model at the load a window ahead (the trend), plus the tolerance: room for
        noise, since latency rises steeply near capacity."""
        return replace(model, rate=model.rate * self._growth(role) * (1.0 + self.tol))

    def _wait_quantile(self, m: MetricsSnapshot) -> float | None:
        """The prefill wait at the SLO quantile (ms).

        vLLM's queue-time histogram starts with a 0-300 ms bucket; a quantile inside it
        is histogram_quantile's interpolation, not a measurement. There the exact mean
        says more: the quantile of an exponential tail with that mean.
        """
        hist, mean = m.prefill.queue_time_q_ms, m.prefill.queue_time_ms
        if hist is None:
            return mean
        if mean is not None and hist <= 1000.0 * obs.VLLM_REQUEST_LATENCY_BUCKETS[0]:
            q = self.auto.slo.quantile.fraction
            return min(hist, mean * math.log(1.0 / (1.0 - q)))
        return hist

    def _prefill_latency(self, m: MetricsSnapshot) -> float | None:
        """The TTFT quantile the target applies to, or None when unseen."""
        ttft = m.ttft_ms if m.ttft_ms is not None else m.prefill.ttft_ms
        if self.auto.ttft_includes_prefill or ttft is None:
            return ttft
        # Without the prompt's own prefill: the prefill wait plus what follows prefill
        # (KV transfer, the first decode step), the router's TTFT less the engine's.
        wait, engine = self._wait_quantile(m), m.prefill.ttft_ms
        if wait is None or engine is None:
            return ttft  # errs towards more engines
        return wait + max(ttft - engine, 0.0)

    def _prefill_need(self, m: MetricsSnapshot) -> _Need:
        target = float(self.auto.slo.ttft_ms)
        engines = self._engines_seen("prefill", m.prefill.ready)
        ttft = self._prefill_latency(m)
        wait = m.prefill.queue_time_ms
        if wait is None and m.prefill_queue is not None:
            wait = m.prefill_queue / m.request_rate * 1000.0  # Little's law
        served = (
            None if m.prefill.tokens_per_s is None else m.prefill.tokens_per_s / (m.mean_input_tokens or 1.0)
        )
        model = models.calibrate_prefill(
            self.profile,
            rate=m.request_rate,
            input_tokens=m.mean_input_tokens or 1.0,
            hit_ratio=min(max(m.prefix_hit_ratio or 0.0, 0.0), 0.95),
            quantile=self.auto.slo.quantile.fraction,
            engines=engines,
            observed_ttft_ms=ttft,
            observed_wait_ms=wait,
            observed_wait_q_ms=self._wait_quantile(m) if m.prefill.queue_time_ms is not None else wait,
            served_rate=served,
            lengths=m.prefill.prompt_tokens,
            own_prefill=self.auto.ttft_includes_prefill,
        )
        model = self._grown(model, "prefill")
        # Engines only shorten the queueing part; when the rest alone nearly fills the
        # target (long prompts), queueing still gets a share of it.
        bound_up = model.fixed_ms + max(
            target * (1 + self.tol) - model.fixed_ms, QUEUEING_SHARE * target * (1 + self.tol)
        )
        bound_down = model.fixed_ms + max(
            target * (1 - self.tol) - model.fixed_ms, QUEUEING_SHARE * target * (1 - self.tol)
        )
        need = _Need(0, 0)
        if model.fixed_ms > target * (1 - QUEUEING_SHARE) * (1 - self.tol):
            need.notes.append(
                f"TTFT without queueing is {model.fixed_ms:.0f} ms: prefill sized for queueing under "
                f"{bound_up - model.fixed_ms:.0f} ms"
            )
        limit = self._limit("prefill")
        busy = models.PREFILL_MAX_BUSY
        need.load_engines = model.load()
        up = models.fewest_engines(model.ttft_ms, bound_up, limit, lambda n: model.load() <= busy * n)
        if up is None:
            need.notes.append(f"prefill load of {model.load():.1f} engines needs more than {limit}")
        need.up = up or limit
        down = models.fewest_engines(
            model.ttft_ms, bound_down, limit, lambda n: model.load() <= busy * (1 - self.tol) * n
        )
        need.down = max(down or need.up, need.up)
        if ttft is not None:
            need.pressure = ttft * (1 + self.tol) / bound_up
            need.violated = ttft > bound_up
            # Without a measured wait the split into fixed and queueing is the model's
            # guess: then only headroom against the target itself counts.
            measured = m.prefill.queue_time_q_ms is not None
            need.headroom = ttft < bound_down and (measured or ttft < target * (1 - self.tol))
            queued = (wait or 0.0) > 0.1 * target
            need.reactive = need.violated and queued and need.up <= self.current["prefill"]
        need.cause_up = Cause.ttft_over_target if need.violated else Cause.prefill_short
        need.cause_down = Cause.prefill_headroom
        if need.violated and self._ttft_lost_after_prefill():
            need.reactive = False  # the time went after prefill: prefill engines would not help
        return need

    def _ttft_lost_after_prefill(self) -> bool:
        return self.stages is not None and self.stages.largest in ("KV hand-off", "decode wait")

    def _ttft_missed(self, m: MetricsSnapshot) -> bool:
        ttft = self._prefill_latency(m)
        return ttft is not None and ttft > self.auto.slo.ttft_ms * (1.0 + self.tol)

    def _decode_need(self, m: MetricsSnapshot) -> _Need:
        target = float(self.auto.slo.itl_ms)
        engines = self._engines_seen("decode", m.decode.ready)
        itl = m.itl_ms if m.itl_ms is not None else m.decode.itl_ms
        # While prefill drains a backlog, decode receives more than arrives.
        served = (
            0.0 if m.prefill.tokens_per_s is None else m.prefill.tokens_per_s / (m.mean_input_tokens or 1.0)
        )
        model = models.calibrate_decode(
            self.profile,
            rate=max(m.request_rate, served),
            input_tokens=m.mean_input_tokens or 1.0,
            output_tokens=m.mean_output_tokens or 1.0,
            engines=engines,
            observed_itl_ms=itl,
            observed_kv_usage=m.decode_kv_usage,
        )
        model = self._grown(model, "decode")
        need = _Need(0, 0)
        limit = self._limit("decode")
        kv_up, kv_down = models.KV_LIMIT, models.KV_LIMIT * (1.0 - self.tol)
        up = models.fewest_engines(
            model.itl_ms, target * (1.0 + self.tol), limit, lambda n: model.kv_usage(n) <= kv_up
        )
        down = models.fewest_engines(
            model.itl_ms, target * (1.0 - self.tol), limit, lambda n: model.kv_usage(n) <= kv_down
        )
        if up is None:
            need.notes.append(f"decode needs more than {limit} engines for ITL {target:.0f} ms")
        need.up = up or limit
        need.down = down or need.up
        kv = m.decode_kv_usage
        kv_full = kv is not None and kv > models.KV_LIMIT
        if itl is not None:
            need.pressure = max(itl / target, (kv or 0.0) / models.KV_LIMIT)
            need.violated = itl > target * (1.0 + self.tol) or kv_full
            need.headroom = itl < target * (1.0 - self.tol) and not (kv is not None and kv > kv_down)
            need.reactive = need.violated and need.up <= self.current["decode"]
        need.cause_up = _decode_cause(kv_full, need.violated)
        need.cause_down = Cause.decode_headroom
        # Without the transfer-time series (vLLM 0.32 exports none) a decode wait may be a
        # slow hand-off: only a measured split asks for decode.
        waited = (
            self.stages is not None and self.stages.largest == "decode wait" and m.kv_handoff_ms is not None
        )
        if waited and self._ttft_missed(m):
            # Requests wait for a decode step before their first token: decode is short.
            need.up = need.down = max(need.up, self.current["decode"] + 1)
            need.violated, need.headroom = True, False
            need.pressure = max(need.pressure, (self._prefill_latency(m) or 0.0) / self.auto.slo.ttft_ms)
            if not kv_full and not (itl is not None and itl > target * (1.0 + self.tol)):
                need.cause_up = Cause.decode_wait
        return need

    def _feedback_need(self, role: str, m: MetricsSnapshot) -> _Need:
        """A role whose capacity is not learned yet: one more engine while its SLO is
        missed, never fewer unless another role needs the GPUs."""
        cur = self.current[role]
        if role == "prefill":
            target, seen = float(self.auto.slo.ttft_ms), self._prefill_latency(m)
            full = False
        else:
            target = float(self.auto.slo.itl_ms)
            seen = m.itl_ms if m.itl_ms is not None else m.decode.itl_ms
            full = m.decode_kv_usage is not None and m.decode_kv_usage > models.KV_LIMIT
        need = _Need(cur, cur)
        need.notes.append(f"{self.unseen[role]}: feedback only")
        if seen is not None:
            need.pressure = seen / target
            need.violated = seen > target * (1.0 + self.tol) or full
            need.headroom = seen < target * (1.0 - self.tol)
        if need.violated:
            need.up = need.down = cur + 1
        elif need.headroom:
            # Never fewer of its own accord (need.down), but at a full GPU budget it may
            # lend one engine to a role that misses its target (need.up is that floor).
            need.up = max(cur - 1, 1)
        if role == "prefill":
            need.cause_up = Cause.ttft_over_target
        else:
            need.cause_up = _decode_cause(full, need.violated)
        return need

    def _want(self, role: str, need: _Need) -> int:
        cur = self.current[role]
        low, high = self._bounds(role)
        if need.reactive and not self._in_flight(role):
            want = cur + 1
            need.notes.append(f"{role} SLO missed although the model sees enough engines: +1")
        elif cur < need.up:
            want = need.up
        elif cur > need.down and need.headroom and not self._in_flight(role):
            want = need.down
        else:
            want = cur
        return min(max(want, low), high)

    def _fit_budget(
        self, wants: dict[str, int], needs: dict[str, _Need]
    ) -> tuple[dict[str, int], str | None]:
        """Keep prefill + decode GPUs within the budget; returns the wants and a donor role.

        Scale-downs wait out their stabilization, so the budget is checked as if they
        had not happened. Growth first takes free GPUs. Beyond them a role that the model
        finds short takes engines from the other role, down to that role's model floor,
        while the other meets its own target; when both miss theirs, engines move only if
        that makes the worse of the two shortfalls clearly smaller. Both the donor's
        headroom and the taker's shortfall must last a metrics window (see _stabilise).
        """
        budget = self.auto.gpu_budget
        planned = {r: max(wants[r], self.current[r]) for r in ROLES}
        if budget is None or self._gpu_total(planned) <= budget:
            return wants, None
        out = {r: min(wants[r], self.current[r]) for r in ROLES}
        spare = budget - self._gpu_total(self.current)
        for role in sorted(ROLES, key=lambda r: -needs[r].pressure):
            extra = max(min(wants[role] - self.current[role], spare // self._gpus(role)), 0)
            out[role] = self.current[role] + extra if extra else out[role]
            spare -= extra * self._gpus(role)
        short = [r for r in ROLES if wants[r] > max(out[r], self.current[r])]
        if not short:
            return out, None
        if all(needs[r].violated for r in ROLES):
            if self._gpu_total(self.current) < budget:
                return self._share_free(wants, budget), None
            return self._rebalance(needs, budget)
        taker = max(short, key=lambda r: needs[r].pressure)
        donor = ROLES[1 - ROLES.index(taker)]
        if needs[donor].violated:
            self.notes.append(f"GPU budget {budget} full and {donor} misses its own target")
            self.events[Cause.budget_full] = taker
            return {**out, taker: max(out[taker], self.current[taker])}, None
        low, _ = self._bounds(donor)
        floor = max(low, needs[donor].up)
        g, gd = self._gpus(taker), self._gpus(donor)
        have = max(out[taker], self.current[taker])
        missing = (wants[taker] - have) * g - spare
        give = max(min(self.current[donor] - floor, -(-missing // gd)), 0)
        if not give:
            self.notes.append(f"GPU budget {budget} full and {donor} needs its {self.current[donor]} engines")
            self.events[Cause.budget_full] = taker
            return {**out, taker: have}, None
        out[donor] = self.current[donor] - give
        spare += give * gd
        out[taker] = have + min(wants[taker] - have, spare // g)
        return out, donor

    def _share_free(self, wants: dict[str, int], budget: int) -> dict[str, int]:
        """Free GPUs go to both roles in proportion to what each wants; neither shrinks."""
        split = self._split_budget(wants, budget)
        p = max(split["prefill"], self.current["prefill"])
        d = max(split["decode"], self.current["decode"])
        gp, gd = self._gpus("prefill"), self._gpus("decode")
        if p * gp + d * gd > budget:
            d = max(self.current["decode"], (budget - p * gp) // gd)
            p = min(p, (budget - d * gd) // gp)
        self.notes.append(f"both roles miss their targets: free GPUs shared towards {p}:{d}")
        return {"prefill": p, "decode": d}

    def _rebalance(self, needs: dict[str, _Need], budget: int) -> tuple[dict[str, int], str | None]:
        """Both roles miss their targets: move up to max_step engines from one role to the
        other when that lowers the worse need/engines ratio by more than the tolerance."""

        def shortfall(split: dict[str, int]) -> float:
            return max(needs[r].up / split[r] for r in ROLES)

        best, best_score = self.current, shortfall(self.current)
        for taker in ROLES:
            donor = ROLES[1 - ROLES.index(taker)]
            (_, high), (low, _) = self._bounds(taker), self._bounds(donor)
            for k in range(1, self.auto.max_step + 1):
                freed = -(-k * self._gpus(taker) // self._gpus(donor))
                split = {taker: self.current[taker] + k, donor: self.current[donor] - freed}
                if split[taker] > high or split[donor] < low or self._gpu_total(split) > budget:
                    break
                if shortfall(split) < best_score:
                    best, best_score = split, shortfall(split)
        now = shortfall(self.current)
        if best is self.current or best_score > now * (1.0 - self.tol):
            self.notes.append(
                f"both roles miss their targets (model needs {needs['prefill'].up}:{needs['decode'].up}) "
                f"and moving engines would not help enough"
            )
            return dict(self.current), None
        self.notes.append(
            f"both roles miss their targets (model needs {needs['prefill'].up}:{needs['decode'].up}): "
            f"rebalancing towards {best['prefill']}:{best['decode']}"
        )
        self.events[Cause.rebalanced] = next(r for r in ROLES if best[r] > self.current[r])
        return dict(best), next(r for r in ROLES if best[r] < self.current[r])

    def _stabilise(self, wants: dict[str, int], donor: str | None) -> dict[str, int]:
        auto, now = self.auto, self.now
        target = dict(self.current)
        cooling = False
        if self.prev.last_change_time and not self.recommend:
            since = (now - parse(self.prev.last_change_time)).total_seconds()
            cooling = since < auto.cooldown_seconds
        for role in ROLES:
            cur, want = self.current[role], wants[role]
            if want > cur:
                self.down_since.pop(role, None)
                if role in self.blocked:
                    self.notes.append(f"{role} scale-up blocked until {self.blocked[role]} (earlier timeout)")
                    self.events.setdefault(Cause.scale_up_blocked, role)
                    continue
                since = parse(self.up_since.setdefault(role, self.now_s))
                wanted = (now - since).total_seconds()
                if wanted < auto.scale_up_stabilization_seconds:
                    self.notes.append(f"{role} scale-up wanted for {wanted:.0f} s")
                    continue
                grow = min(want - cur, auto.max_step)
                if donor is not None and role != donor and wanted < auto.window_seconds:
                    # Taking engines from the other role costs a drain and a start-up:
                    # only for a shortfall seen over a whole window, not one burst.
                    free = max(self.auto.gpu_budget - self._gpu_total(self.current), 0) // self._gpus(role)
                    if grow > free:
                        self.notes.append(
                            f"{role} short for {wanted:.0f}/{auto.window_seconds} s before taking from {donor}"
                        )
                        grow = free
                target[role] = cur + grow
            elif want < cur:
                self.up_since.pop(role, None)
                since = parse(self.down_since.setdefault(role, self.now_s))
                waited = (now - since).total_seconds()
                # Giving engines to the other role moves capacity rather than removing it:
                # headroom seen over a whole window is enough.
                needed = auto.window_seconds if role == donor else auto.scale_down_stabilization_seconds
                if waited < needed:
                    self.notes.append(f"{role} scale-down to {want} wanted for {waited:.0f}/{needed} s")
                    continue
                target[role] = cur - min(cur - want, auto.max_step)
                # The next step of the same scale-down waits for a window of metrics at the
                # new count, and for the stabilization since the wish began.
                settle = max(auto.scale_down_stabilization_seconds - auto.window_seconds, 0)
                self.down_since[role] = time_ms(max(since, now - timedelta(seconds=settle)))
            else:
                self.up_since.pop(role, None)
                self.down_since.pop(role, None)
        if donor is not None and all(target[r] <= self.current[r] for r in ROLES if r != donor):
            target[donor] = self.current[donor]  # nobody took the GPUs: the donor keeps them
        budget = auto.gpu_budget
        if budget is not None:
            for role in ROLES:  # a donor limited by max_step limits the taker too
                while self._gpu_total(target) > budget and target[role] > self.current[role]:
                    target[role] -= 1
        if cooling and target != self.current:
            self.notes.append(f"cooling down after the change at {self.prev.last_change_time}")
            self.events[Cause.cooling_down] = ""
            return dict(self.current)
        return target

    def _cause(
        self, needs: dict[str, _Need], wants: dict[str, int], target: dict[str, int]
    ) -> tuple[Cause, str | None]:
        """The one reason that explains the decision best, and the role it concerns."""
        cur = self.current
        up = [r for r in ROLES if target[r] > cur[r]]
        down = [r for r in ROLES if target[r] < cur[r]]
        if Cause.rebalanced in self.events and up:
            return Cause.rebalanced, self.events[Cause.rebalanced]
        if up:
            role = max(up, key=lambda r: needs[r].pressure)
            return needs[role].cause_up, role
        if down:
            return needs[down[0]].cause_down, down[0]
        for waiting in (Cause.cooling_down, Cause.scale_up_blocked):
            if waiting in self.events:
                return waiting, self.events[waiting] or None
        handoff = self.stages is not None and self.stages.largest == "KV hand-off"
        if handoff and self.metrics is not None and self._ttft_missed(self.metrics):
            return Cause.kv_handoff_slow, None
        wanted = [r for r in ROLES if wants[r] != cur[r]]
        if wanted:
            return Cause.stabilizing, wanted[0]
        if Cause.budget_full in self.events:
            return Cause.budget_full, self.events[Cause.budget_full]
        return Cause.within_targets, None

    # ------------------------------------------------------------------ output
    def _reason(self, m: MetricsSnapshot, needs: dict[str, _Need], target: dict[str, int]) -> str:
        slo = self.auto.slo
        parts = []
        ttft = self._prefill_latency(m)
        itl = m.itl_ms if m.itl_ms is not None else m.decode.itl_ms
        ttft_name = "TTFT" if self.auto.ttft_includes_prefill else "TTFT less own prefill"
        for name, value, goal in ((ttft_name, ttft, slo.ttft_ms), ("ITL", itl, slo.itl_ms)):
            if value is None:
                parts.append(f"{name} unseen")
            elif value > goal * (1.0 + self.tol):
                parts.append(f"{name} {slo.quantile.value} {value:.0f} ms > {goal} ms")
            else:
                parts.append(
                    f"{name} {slo.quantile.value} {value:.0f} ms ({100 * (1 - value / goal):+.0f}% headroom)"
                )
        parts[-1] = parts[-1] + f" at {m.request_rate:.2f} req/s"
        moves = []
        for role in ROLES:
            delta = target[role] - self.current[role]
            if delta:
                moves.append(f"{delta:+d} {role}")
        summary = ", ".join(parts)
        model = f"model needs {needs['prefill'].up}:{needs['decode'].up}"
        action = ", ".join(moves) if moves else f"hold {self.current['prefill']}:{self.current['decode']}"
        notes = [n for r in ROLES for n in needs[r].notes] + self.notes
        return f"{summary}; {model}: {action}" + (f" ({'; '.join(notes)})" if notes else "")

    def _figures(self) -> Figures:
        m, slo = self.metrics, self.auto.slo
        itl = None if m is None else (m.itl_ms if m.itl_ms is not None else m.decode.itl_ms)
        return Figures(
            quantile=slo.quantile.value,
            ttft_ms=None if m is None or m.request_rate <= 0 else self._prefill_latency(m),
            ttft_target_ms=slo.ttft_ms,
            itl_ms=itl,
            itl_target_ms=slo.itl_ms,
            kv_usage=None if m is None else m.decode_kv_usage,
            budget=self.auto.gpu_budget,
            kv_handoff_ms=None if self.stages is None else self.stages.kv_handoff_ms,
            decode_wait_ms=None if self.stages is None else self.stages.decode_wait_ms,
            kv_limit=models.KV_LIMIT,
            needed={r: n.up for r, n in self.needs.items()},
            ready={r: self.observed.role(r).ready for r in ROLES},
            prefill_load=self.needs["prefill"].load_engines if "prefill" in self.needs else None,
            stabilization_s={
                r: self.auto.scale_up_stabilization_seconds
                if w > self.current[r]
                else self.auto.scale_down_stabilization_seconds
                for r, w in self.wants.items()
            },
            scale_up_timeout_s=self.auto.scale_up_timeout_seconds,
            cooldown_s=self.auto.cooldown_seconds,
        )

    def _finish(
        self, target: dict[str, int], reason: str, cause: Cause, role: str | None = None
    ) -> tuple[AutoscalingState, Decision]:
        if cause == Cause.scale_up_timed_out:
            role = self.events.get(cause)
        changed = target != self.stored
        action = ("recommend" if self.recommend else "scale") if changed else "hold"
        applied = changed and not self.recommend
        if applied:
            for role in ROLES:  # a scale-up's wait for ready pods starts now (or earlier)
                if target[role] > self.observed.role(role).ready:
                    self.pending.setdefault(role, self.now_s)
        decision = Decision(
            time=self.now_s,
            prefill=target["prefill"],
            decode=target["decode"],
            action=action,
            cause=cause.value,
            summary=summary(cause, self._figures(), self.stored, target, role),
            reason=reason,
            metrics=_observed_metrics(self.metrics),
        )
        state = AutoscalingState(
            prefill=target["prefill"],
            decode=target["decode"],
            last_run_time=self.now_s,
            last_change_time=self.now_s if applied else self.prev.last_change_time,
            pending_since=self.pending or None,
            blocked_until=self.blocked or None,
            up_wanted_since=self.up_since or None,
            down_wanted_since=self.down_since or None,
            history=self.history or None,
            capacity=self.capacity,
            ttft_stages=_stages(self.stages),
            last_decision=decision,
            decisions=self.prev.decisions + (1 if applied else 0),
        )
        return state, decision


def _stages(b: TTFTBreakdown | None) -> TTFTStages | None:
    if b is None:
        return None
    return TTFTStages(
        router_ms=round(b.router_ms),
        prefill_queue_ms=round(b.prefill_queue_ms),
        prefill_compute_ms=round(b.prefill_compute_ms),
        kv_handoff_ms=round(b.kv_handoff_ms),
        decode_wait_ms=round(b.decode_wait_ms),
    )


def _decode_cause(kv_full: bool, violated: bool) -> Cause:
    if kv_full:
        return Cause.kv_cache_full
    return Cause.itl_over_target if violated else Cause.decode_short


def demand(m: MetricsSnapshot) -> tuple[float, float]:
    """What each role has to serve: prefill, prompt tokens per second; decode, the KV
    its sequences hold over their lives (requests/s x output tokens x mean context) / 1000."""
    isl, osl = m.mean_input_tokens or 0.0, m.mean_output_tokens or 0.0
    return m.request_rate * isl, m.request_rate * osl * (isl + osl / 2.0) / 1000.0


def _observed_metrics(m: MetricsSnapshot | None) -> ObservedMetrics | None:
    if m is None:
        return None

    def whole(x: float | None) -> int | None:
        return None if x is None or not math.isfinite(x) else round(x)

    return ObservedMetrics(
        ttft_ms=whole(m.ttft_ms if m.ttft_ms is not None else m.prefill.ttft_ms),
        itl_ms=whole(m.itl_ms if m.itl_ms is not None else m.decode.itl_ms),
        request_rate_milli=whole(m.request_rate * 1000.0),
        mean_input_tokens=whole(m.mean_input_tokens),
        mean_output_tokens=whole(m.mean_output_tokens),
        prefill_queue=whole(m.prefill_queue),
        decode_kv_usage_percent=whole(None if m.decode_kv_usage is None else m.decode_kv_usage * 100.0),
    )
