"""The colocated pool's control law: one pool of engines against both targets.

Each colocated engine serves requests whole (chunked prefill), so one count answers
for TTFT, ITL and the KV cache at once. The law is feedback, as a Horizontal Pod
Autoscaler's is, on the same signals and guards as the prefill:decode law:

- pressure: the largest of TTFT / its target, ITL / its target and KV usage / the KV
  limit (the observed quantiles; TTFT less the prompt's own prefill is the engines'
  queue time at the quantile when `ttftIncludesPrefill` is off);
- above target x (1 + tol), or KV above its limit: ceil(engines x pressure), at least
  one more (more engines lower each one's share of the load in proportion); while a
  scale-up's engines are still starting, the window saw only the ready ones: ceil(ready
  x pressure), and nothing more if that is already asked for;
- below target x (1 - tol) on every signal: the fewest engines whose predicted
  pressure, engines x pressure / n, stays under 1 - tol (never the last one);
- otherwise hold: the band between the two is the hysteresis.

Scale-ups wait out `scaleUpStabilizationSeconds`, scale-downs
`scaleDownStabilizationSeconds`; no change within `cooldownSeconds` of the last one;
at most `maxStep` engines per change; within the GPU budget and the role's bounds; a
scale-up whose pods are not ready within `scaleUpTimeoutSeconds` falls back to the ready
count and blocks scale-ups as long. Everything remembered is in AutoscalingState.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import AutoscalingMode, AutoscalingState, Decision, PDClusterSpec
from pdcluster.control import models
from pdcluster.control.cause import Cause, Figures, summary
from pdcluster.control.types import MetricsSnapshot, RoleObserved
from pdcluster.timestamps import parse, time_ms

ROLE = C.ROLE_COLOCATED


def decide_pool(
    spec: PDClusterSpec,
    metrics: MetricsSnapshot | None,
    state: AutoscalingState | None,
    observed: RoleObserved,
    now: datetime,
) -> tuple[AutoscalingState, Decision]:
    """One run of the colocated pool's law: the next state (to status) and the decision."""
    return _PoolRun(spec, metrics, state, observed, now).run()


class _PoolRun:
    def __init__(self, spec, metrics, state, observed, now) -> None:
        self.spec: PDClusterSpec = spec
        self.auto = spec.autoscaling
        self.m: MetricsSnapshot | None = metrics
        self.prev = state or AutoscalingState()
        self.observed: RoleObserved = observed
        self.now = now if now.tzinfo else now.replace(tzinfo=UTC)
        self.now_s = time_ms(self.now)
        self.recommend = self.auto.mode == AutoscalingMode.recommend
        self.tol = self.auto.tolerance_percent / 100.0
        self.notes: list[str] = []
        self.cooling = False
        self.starting = False  # a scale-up's engines are still starting: the change is under way
        self.want: int | None = None  # what the signals ask for (the summary quotes it)
        gap = None if self.prev.last_run_time is None else (self.now - parse(self.prev.last_run_time))
        stale = gap is None or gap.total_seconds() > max(
            3 * self.auto.interval_seconds, self.auto.window_seconds
        )
        self.up_since = None if stale else (self.prev.up_wanted_since or {}).get(ROLE)
        self.down_since = None if stale else (self.prev.down_wanted_since or {}).get(ROLE)
        self.pending = (self.prev.pending_since or {}).get(ROLE)
        blocked = (self.prev.blocked_until or {}).get(ROLE)
        self.blocked = blocked if blocked and parse(blocked) > self.now else None
        low, high = self._bounds()
        stored = self.prev.colocated
        if self.recommend:
            stored = observed.desired
        elif stored is None:
            stored = spec.colocated.replicas
        self.stored = stored
        self.current = min(max(stored, low), high)
        if self.current != stored:
            self.notes.append(f"{ROLE} {stored} outside [{low}, {high}]: clamped")

    def _bounds(self) -> tuple[int, int]:
        r = self.spec.colocated
        high = max(r.max_replicas, r.min_replicas)
        if self.auto.gpu_budget is not None:
            high = min(high, max(self.auto.gpu_budget // max(r.gpus, 1), r.min_replicas))
        return r.min_replicas, high

    # ------------------------------------------------------------------ steps
    def run(self) -> tuple[AutoscalingState, Decision]:
        hold = f"hold {self.current}"
        if not self.auto.enabled or self.spec.suspend:
            cause = Cause.disabled if not self.auto.enabled else Cause.suspended
            return self._finish(self.current, f"{cause.value}: {hold}", cause)
        fallback = self._time_out_scale_up()
        if fallback is not None:
            return self._finish(fallback, "; ".join(self.notes), Cause.scale_up_timed_out)
        m = self.m
        if m is None or m.request_rate <= 0:
            self.up_since = self.down_since = None  # no timer runs across a gap
            why = "metrics unavailable (Prometheus unreachable or no series)" if m is None else "no traffic"
            cause = Cause.metrics_unavailable if m is None else Cause.no_traffic
            return self._finish(self.current, f"{why}: {hold}", cause)
        signals = self._signals(m)
        seen = {k: v for k, v in signals.items() if v is not None}
        pressure = max(seen.values(), default=0.0)
        # The KV limit has its margin built in (vLLM preempts only when full), as decode's has.
        violated = pressure > 1.0 + self.tol or (seen.get("kv") or 0.0) > 1.0
        headroom = bool(seen) and pressure < 1.0 - self.tol
        want = self._want(pressure, violated, headroom)
        self.want = want
        target = self._stabilise(want)
        cause = self._cause(signals, target, want)
        return self._finish(target, self._reason(signals, want, target), cause)

    def _signals(self, m: MetricsSnapshot) -> dict[str, float | None]:
        """Each signal as a share of its target (None when unseen)."""
        pool, slo = m.colocated, self.auto.slo
        ttft = m.ttft_ms if m.ttft_ms is not None else pool.ttft_ms
        if not self.auto.ttft_includes_prefill and pool.queue_time_q_ms is not None:
            ttft = pool.queue_time_q_ms  # what precedes the prompt's own (chunked) prefill
        itl = m.itl_ms if m.itl_ms is not None else pool.itl_ms
        return {
            "ttft": None if ttft is None else ttft / slo.ttft_ms,
            "itl": None if itl is None else itl / slo.itl_ms,
            "kv": None if pool.kv_usage is None else pool.kv_usage / models.KV_LIMIT,
        }

    def _backlog(self) -> float | None:
        """Prompt tokens arriving over those the engines computed in the window: above 1,
        the pool is saturated and serves at its capacity, so that ratio of today's engines
        serves the load. None without the series."""
        m = self.m
        served = None if m is None else m.colocated.tokens_per_s
        if m is None or not served or not m.mean_input_tokens:
            return None
        return m.request_rate * m.mean_input_tokens / served

    def _want(self, pressure: float, violated: bool, headroom: bool) -> int:
        cur = self.current
        low, high = self._bounds()
        # A queue inflates TTFT well past what more engines need to fix: when the pool is
        # saturated its throughput says how many, else the pressure does.
        backlog = self._backlog()
        factor = backlog if backlog is not None and backlog > 1.0 + self.tol else pressure
        if backlog is not None and factor is backlog:
            self.notes.append(f"saturated: {backlog:.2f}x the prompt tokens it computes arrive")
        # What the window measured: the engines that served in it (its mean), not those
        # still starting.
        seen = self.m.colocated.ready if self.m and self.m.colocated.ready else self.observed.ready
        if violated and self._in_flight():
            # More only if the engines measured would not be enough either.
            want = max(cur, math.ceil(max(seen, 1) * factor))
            if want == cur:
                self.notes.append(f"scale-up to {cur} under way ({self.observed.ready} ready)")
                self.starting = True
        elif violated:
            want = max(cur + 1, math.ceil(max(seen, 1) * factor))
        elif headroom and cur > 1 and not self._in_flight():
            want = max(math.ceil(cur * pressure / (1.0 - self.tol)), 1)
        else:
            want = cur
        if want > high and violated:
            self.notes.append(f"the pool needs more than {high} engines")
        return min(max(want, low), high)

    def _in_flight(self) -> bool:
        return not self.recommend and self.current > self.observed.ready

    def _time_out_scale_up(self) -> int | None:
        if self.recommend or self.current <= self.observed.ready:
            self.pending = None
            return None
        self.pending = self.pending or self.now_s
        waited = (self.now - parse(self.pending)).total_seconds()
        timeout = self.auto.scale_up_timeout_seconds
        if waited < timeout:
            return None
        low, _ = self._bounds()
        fallback = max(low, self.observed.ready)
        stuck = f", {self.observed.unschedulable} unschedulable" if self.observed.unschedulable else ""
        self.notes.append(
            f"{ROLE} scale-up to {self.current} not ready after {waited:.0f} s ({self.observed.ready} "
            f"ready{stuck}): falling back to {fallback}, no scale-up for {timeout} s"
        )
        self.pending = self.up_since = None
        self.blocked = time_ms(self.now + timedelta(seconds=timeout))
        return fallback

    def _stabilise(self, want: int) -> int:
        auto, cur = self.auto, self.current
        if want > cur:
            self.down_since = None
            if self.blocked:
                self.notes.append(f"scale-up blocked until {self.blocked} (earlier timeout)")
                return cur
            self.up_since = self.up_since or self.now_s
            wanted = (self.now - parse(self.up_since)).total_seconds()
            if wanted < auto.scale_up_stabilization_seconds:
                self.notes.append(f"scale-up wanted for {wanted:.0f} s")
                return cur
            target = cur + min(want - cur, auto.max_step)
        elif want < cur:
            self.up_since = None
            self.down_since = self.down_since or self.now_s
            since = parse(self.down_since)
            waited = (self.now - since).total_seconds()
            if waited < auto.scale_down_stabilization_seconds:
                self.notes.append(
                    f"scale-down to {want} wanted for {waited:.0f}/{auto.scale_down_stabilization_seconds} s"
                )
                return cur
            target = cur - min(cur - want, auto.max_step)
            # The next step waits for a window of metrics at the new count.
            settle = max(auto.scale_down_stabilization_seconds - auto.window_seconds, 0)
            self.down_since = time_ms(max(since, self.now - timedelta(seconds=settle)))
        else:
            self.up_since = self.down_since = None
            return cur
        if self.prev.last_change_time and not self.recommend:
            since_change = (self.now - parse(self.prev.last_change_time)).total_seconds()
            if since_change < auto.cooldown_seconds:
                self.notes.append(f"cooling down after the change at {self.prev.last_change_time}")
                self.cooling = True
                return cur
        return target

    def _cause(self, signals: dict[str, float | None], target: int, want: int) -> Cause:
        if target > self.current:
            worst = max((k for k, v in signals.items() if v is not None), key=lambda k: signals[k] or 0.0)
            return {"ttft": Cause.ttft_over_target, "itl": Cause.itl_over_target, "kv": Cause.kv_cache_full}[
                worst
            ]
        if target < self.current:
            return Cause.pool_headroom
        if self.cooling:
            return Cause.cooling_down
        if self.blocked and want > self.current:
            return Cause.scale_up_blocked
        if want != self.current or self.starting:
            return Cause.stabilizing
        return Cause.within_targets

    # ------------------------------------------------------------------ output
    def _reason(self, signals: dict[str, float | None], want: int, target: int) -> str:
        slo, q = self.auto.slo, self.auto.slo.quantile.value
        ttft_name = "TTFT" if self.auto.ttft_includes_prefill else "TTFT less own prefill"
        goals = {
            "ttft": (ttft_name, slo.ttft_ms, " ms"),
            "itl": ("ITL", slo.itl_ms, " ms"),
            "kv": ("KV usage", 100 * models.KV_LIMIT, "%"),
        }
        parts = []
        for key, share in signals.items():
            name, goal, unit = goals[key]
            if share is None:
                parts.append(f"{name} unseen")
            else:
                parts.append(
                    f"{name} {q if unit == ' ms' else 'mean'} {share * goal:.0f}{unit} of {goal:.0f}{unit}"
                )
        rate = self.m.request_rate if self.m else 0.0
        action = f"{target - self.current:+d} {ROLE}" if target != self.current else f"hold {self.current}"
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"{', '.join(parts)} at {rate:.2f} req/s; wants {want}: {action}{notes}"

    def _finish(self, target: int, reason: str, cause: Cause) -> tuple[AutoscalingState, Decision]:
        changed = target != self.stored
        action = ("recommend" if self.recommend else "scale") if changed else "hold"
        applied = changed and not self.recommend
        if applied and target > self.observed.ready:
            self.pending = self.pending or self.now_s
        m, slo = self.m, self.auto.slo
        figures = Figures(
            quantile=slo.quantile.value,
            ttft_ms=None if m is None else (m.ttft_ms if m.ttft_ms is not None else m.colocated.ttft_ms),
            ttft_target_ms=slo.ttft_ms,
            itl_ms=None if m is None else (m.itl_ms if m.itl_ms is not None else m.colocated.itl_ms),
            itl_target_ms=slo.itl_ms,
            kv_usage=None if m is None else m.colocated.kv_usage,
            budget=self.auto.gpu_budget,
            kv_limit=models.KV_LIMIT,
            needed={} if self.want is None else {ROLE: self.want},
            ready={ROLE: self.observed.ready},
            stabilization_s={
                ROLE: self.auto.scale_up_stabilization_seconds
                if (self.want or 0) > self.current
                else self.auto.scale_down_stabilization_seconds
            },
            scale_up_timeout_s=self.auto.scale_up_timeout_seconds,
            cooldown_s=self.auto.cooldown_seconds,
        )
        decision = Decision(
            time=self.now_s,
            colocated=target,
            action=action,
            cause=cause.value,
            summary=summary(cause, figures, {ROLE: self.stored}, {ROLE: target}, ROLE),
            reason=reason,
        )

        def one(value: str | None) -> dict[str, str] | None:
            return {ROLE: value} if value else None

        state = AutoscalingState(
            colocated=target,
            last_run_time=self.now_s,
            last_change_time=self.now_s if applied else self.prev.last_change_time,
            pending_since=one(self.pending),
            blocked_until=one(self.blocked),
            up_wanted_since=one(self.up_since),
            down_wanted_since=one(self.down_since),
            last_decision=decision,
            decisions=self.prev.decisions + (1 if applied else 0),
        )
        return state, decision
