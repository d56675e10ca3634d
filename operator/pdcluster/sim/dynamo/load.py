"""Dynamo's SLA planner with its load-based mode on top of the throughput-based one."""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from pdcluster.perf import Profile
from pdcluster.sim.dynamo.throughput import Dynamo
from pdcluster.sim.fleet import Fleet

# Load-based scaling defaults (components/src/dynamo/planner/defaults.py, SLAPlannerDefaults).
LOAD_ADJUSTMENT_INTERVAL_S = 5.0
LOAD_METRIC_SAMPLES = 10  # router /metrics samples per load interval, the last 10 kept
LOAD_LEARNING_WINDOW = 50  # observations in each regression's sliding window
LOAD_MIN_OBSERVATIONS = 5  # cold-start guard
LOAD_SCALING_DOWN_SENSITIVITY = 80  # percent
# kube.py wait_for_graph_deployment_ready: a blocking scale polls DGD readiness every 10 s,
# 180 times (30 min), then raises.
READY_POLL_S = 10.0
READY_ATTEMPTS = 180
KV_BLOCK_TOKENS = 16  # vLLM's default KV block: the unit of the router's active decode blocks
INDEPENDENT = "independent"
UP_EITHER_DOWN_BOTH = "up-either-down-both"
EPS = 1e-9  # control times are sums of floats


class LoadRegression:
    """load_based_regression.LoadBasedRegressionModel: least squares y = m x + b over the
    last `window` observations, solved backwards for the largest load that meets an SLA."""

    def __init__(
        self, window: int = LOAD_LEARNING_WINDOW, min_observations: int = LOAD_MIN_OBSERVATIONS
    ) -> None:
        self.points: deque[tuple[float, float]] = deque(maxlen=window)
        self.min_observations = min_observations

    def add(self, x: float, y: float) -> None:
        self.points.append((x, y))

    def sufficient(self) -> bool:
        return len(self.points) >= self.min_observations

    def fit(self) -> tuple[float, float]:
        """(slope, intercept); a slope of 0 when every x is the same, as scikit-learn gives."""
        x = np.array([p[0] for p in self.points])
        y = np.array([p[1] for p in self.points])
        dx = x - x.mean()
        spread = float(dx @ dx)
        slope = float(dx @ (y - y.mean())) / spread if spread > 0 else 0.0
        return slope, float(y.mean() - slope * x.mean())

    def max_load(self, target: float) -> float | None:
        """predict_x_from_sla: None before min_observations; never negative."""
        if not self.sufficient():
            return None
        slope, intercept = self.fit()
        if slope <= 0:
            # More load must mean more latency; otherwise trust only what was observed: the
            # lightest load that met the target, or the lightest load of all.
            met = [x for x, y in self.points if y < target]
            return max(0.0, min(met or [x for x, _ in self.points]))
        return max(0.0, (target - intercept) / slope)


Gauges = dict[str, dict[str, dict[str, float]]]  # role -> worker -> gauge -> value


class DynamoLoad:
    """Dynamo's SLA planner, disaggregated, with throughput-based AND load-based scaling.

    Read from maljazaery/dynamo @349ab3fa (a mirror of ai-dynamo/dynamo main, 2026-02-20),
    components/src/dynamo/planner/: utils/disagg_planner.py, utils/prefill_planner.py,
    utils/decode_planner.py, utils/planner_config.py and defaults.py @b2075619;
    utils/planner_core.py @0ce3461a; utils/load_based_regression.py and utils/prometheus.py
    @359765d3 (PR #6145, which added load-based scaling); kubernetes_connector.py @0a266653,
    kube.py @b12e6710; docs/pages/components/planner/README.md ("both modes together" for
    bursty traffic) and docs/pages/design-docs/planner-design.md.

    - Both modes on turns the correction factors off (planner_config.py _validate_config),
      so the throughput part is `Dynamo(correction=False)`. Every `interval_s` (180 s) its
      result, before any budget, only becomes the lower bound (throughput_lower_bound_p/_d,
      1 and 1 until the first one); it scales nothing itself.
    - A sampling loop reads the frontend's per-worker gauges every 5 s / 10 = 0.5 s and
      keeps the last 10 samples (DirectRouterMetricsClient). The load loop sleeps 5 s, then:
      feeds the latest sample to the regressions, TTFT(ms) against active prefill tokens +
      the worker's last ISL (only where last TTFT and last ISL are > 0) and ITL(ms) against
      active decode blocks (only where last ITL and the blocks are > 0), at most 50 points,
      5 before any decision.
    - Prefill: x_sla = the load whose predicted TTFT is the target; target tokens = x_sla -
      the ISL averaged over the 10 samples and all workers; none if that is <= 0. Decode:
      x_sla for the ITL target; none if <= 0. A role goes to n + 1 when ALL its workers are
      above its target, to n - 1 when n > 1 and ALL are below target * (n - 1) / n * 0.8,
      with n its ready workers (DGD status).
    - Roles combine independently (shipped disagg_planner.py; the default). The rule "up if
      either wants up, down only if both want down" is what aggregated mode does, and what
      disagg mode did in PR #6145's branch commit 002a7c31 (ai-dynamo/dynamo), kept as
      combine="up-either-down-both". Only when the load loop changes something does it take
      max(decision, lower bound) per role, then _apply_global_gpu_budget, and scale
      blocking: no load decision until the DGD is ready (polled every 10 s, given up after
      180 polls), then the loop sleeps 5 s again.

    Deliberate differences:
    - Router gauges come from the engine objects: active prefill tokens = a prefill engine's
      `inflight_tokens` (prompt tokens not yet prefilled; Dynamo's router subtracts cached
      prefix tokens), active decode blocks = a decode engine's KV tokens in use / 16, last
      ITL = the duration of its last decode step. The fleet does not record which prefill
      engine served a request, so every prefill worker shows the fleet's latest TTFT and
      its ISL (Dynamo: that worker's latest), from the first request on.
    - The worker-count reconciliation never fires: samples read the ready engines at the
      same instant as the decision.
    - After 180 failed readiness polls Dynamo's loop raises and the planner restarts with
      fresh state; here the loop just resumes.
    - The throughput part's own differences are Dynamo's (above).
    """

    name = "dynamo-load"

    def __init__(
        self,
        profile: Profile,
        *,
        ttft_ms: float,
        itl_ms: float,
        gpu_budget: int,
        start: tuple[int, int],
        interval_s: float = 180.0,
        load_interval_s: float = LOAD_ADJUSTMENT_INTERVAL_S,
        predictor: str = "arima",
        min_endpoint: int = 1,
        combine: str = INDEPENDENT,
    ) -> None:
        if combine not in (INDEPENDENT, UP_EITHER_DOWN_BOTH):
            raise ValueError(f"combine must be {INDEPENDENT!r} or {UP_EITHER_DOWN_BOTH!r}, not {combine!r}")
        self.throughput = Dynamo(
            profile,
            ttft_ms=ttft_ms,
            itl_ms=itl_ms,
            gpu_budget=gpu_budget,
            start=start,
            interval_s=interval_s,
            predictor=predictor,
            correction=False,
            min_endpoint=min_endpoint,
        )
        self.ttft_ms = ttft_ms
        self.itl_ms = itl_ms
        self.start = start
        self.combine = combine
        self.load_interval_s = load_interval_s
        self.interval_s = load_interval_s / LOAD_METRIC_SAMPLES  # the sampling loop's period
        self.ttft_regression = LoadRegression()
        self.itl_regression = LoadRegression()
        self.samples: deque[Gauges] = deque(maxlen=LOAD_METRIC_SAMPLES)
        self.lower_bound = (1, 1)
        self.next_throughput_s = interval_s
        self.next_load_s = load_interval_s
        self.blocked_since: float | None = None  # a blocking scale waits for the DGD
        self.next_ready_check_s = 0.0
        # For the frontend's last-TTFT gauge: requests arrived and still without a first token.
        self.arrived = 0
        self.awaiting_first_token: list[int] = []
        self.last_first_token: tuple[float, float, int] | None = None  # when, TTFT (s), ISL
        self.last_itl_ms: dict[str, float] = {}  # per decode engine: gauges keep their last value
        self.last_reason = ""

    def initial(self) -> tuple[int, int]:
        return self.start

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None:
        self.samples.append(self.sample(now_s, fleet))
        if now_s + EPS >= self.next_throughput_s:
            self.next_throughput_s += self.throughput.interval_s
            wanted = self.throughput.plan(now_s, fleet)
            if wanted is not None:
                self.lower_bound = wanted
        if self.blocked_since is not None:
            if now_s + EPS < self.next_ready_check_s:
                return None
            waited = now_s - self.blocked_since
            if not self.deployment_ready(fleet) and waited + EPS < READY_POLL_S * READY_ATTEMPTS:
                self.next_ready_check_s += READY_POLL_S
                return None
            self.blocked_since = None
            self.next_load_s = now_s + self.load_interval_s
            return None
        if now_s + EPS < self.next_load_s:
            return None
        self.next_load_s = now_s + self.load_interval_s
        return self.load_step(now_s, fleet)

    def load_step(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None:
        num_p, num_d = len(fleet.ready["prefill"]), len(fleet.ready["decode"])
        recent = self.samples[-1]
        self.observe(recent)
        p_desired = self.prefill_desired(recent["prefill"], num_p)
        d_desired = self.decode_desired(recent["decode"], num_d)
        wanted = self.combined(p_desired, d_desired, num_p, num_d)
        if wanted is None:
            self.last_reason = f"load: no scaling needed (prefill {p_desired}, decode {d_desired})"
            return None
        floored = (max(wanted[0], self.lower_bound[0]), max(wanted[1], self.lower_bound[1]))
        final = self.throughput.apply_global_gpu_budget(*floored)
        self.blocked_since = now_s
        self.next_ready_check_s = now_s + READY_POLL_S
        self.last_reason = (
            f"load: {num_p}:{num_d} -> {wanted[0]}:{wanted[1]}, "
            f"throughput floor {self.lower_bound[0]}:{self.lower_bound[1]}: {final[0]}:{final[1]}"
        )
        return final

    def combined(
        self, p_desired: int | None, d_desired: int | None, num_p: int, num_d: int
    ) -> tuple[int, int] | None:
        """Both roles' targets from their load decisions, or None for no change."""
        if self.combine == INDEPENDENT:
            wanted = (num_p if p_desired is None else p_desired, num_d if d_desired is None else d_desired)
            return None if wanted == (num_p, num_d) else wanted
        p_up = p_desired is not None and p_desired > num_p
        d_up = d_desired is not None and d_desired > num_d
        if p_up or d_up:
            return (p_desired if p_up else num_p, d_desired if d_up else num_d)  # type: ignore[return-value]
        p_down = p_desired is not None and p_desired < num_p
        d_down = d_desired is not None and d_desired < num_d
        if p_down and d_down:
            return p_desired, d_desired  # type: ignore[return-value]
        return None

    def prefill_desired(self, workers: dict[str, dict[str, float]], num_workers: int) -> int | None:
        x_sla = self.ttft_regression.max_load(self.ttft_ms)
        if x_sla is None or not workers or num_workers == 0:
            return None
        target = x_sla - self.sampled_mean("prefill", "last_isl")
        if target <= 0:  # the TTFT target is out of reach at the current ISL
            return None
        return one_step([m["active_prefill_tokens"] for m in workers.values()], target, num_workers)

    def decode_desired(self, workers: dict[str, dict[str, float]], num_workers: int) -> int | None:
        x_sla = self.itl_regression.max_load(self.itl_ms)
        if x_sla is None or x_sla <= 0 or not workers or num_workers == 0:
            return None
        return one_step([m["active_decode_blocks"] for m in workers.values()], x_sla, num_workers)

    def observe(self, recent: Gauges) -> None:
        for m in recent["prefill"].values():
            if m.get("last_ttft_ms", 0.0) > 0 and m.get("last_isl", 0.0) > 0:
                self.ttft_regression.add(m["active_prefill_tokens"] + m["last_isl"], m["last_ttft_ms"])
        for m in recent["decode"].values():
            if m.get("last_itl_ms", 0.0) > 0 and m["active_decode_blocks"] > 0:
                self.itl_regression.add(m["active_decode_blocks"], m["last_itl_ms"])

    def sampled_mean(self, role: str, gauge: str) -> float:
        """cluster_averaged: over every kept sample and worker that has the gauge; 0 if none."""
        values = [m[gauge] for s in self.samples for m in s[role].values() if gauge in m]
        return sum(values) / len(values) if values else 0.0

    def deployment_ready(self, fleet: Fleet) -> bool:
        return (len(fleet.ready["prefill"]), len(fleet.ready["decode"])) == fleet.targets

    def sample(self, now_s: float, fleet: Fleet) -> Gauges:
        """The frontend's per-worker gauges at now_s, derived from the engine objects."""
        self.track_first_tokens(now_s, fleet)
        prefill: dict[str, dict[str, float]] = {}
        for engine in fleet.ready["prefill"]:
            gauges = {"active_prefill_tokens": float(engine.inflight_tokens)}
            if self.last_first_token is not None:
                _, ttft_s, isl = self.last_first_token
                gauges["last_ttft_ms"] = ttft_s * 1000.0
                gauges["last_isl"] = float(isl)
            prefill[engine.id] = gauges
        decode: dict[str, dict[str, float]] = {}
        for engine in fleet.ready["decode"]:
            steps = engine.steps_done(now_s) if engine.batch else 0  # type: ignore[attr-defined]
            if steps:
                self.last_itl_ms[engine.id] = engine.step_ms + engine.growth * (steps - 1)  # type: ignore[attr-defined]
            kv_tokens = engine.kv + engine.batch * steps  # type: ignore[attr-defined]
            gauges = {"active_decode_blocks": float(math.ceil(kv_tokens / KV_BLOCK_TOKENS))}
            if engine.id in self.last_itl_ms:
                gauges["last_itl_ms"] = self.last_itl_ms[engine.id]
            decode[engine.id] = gauges
        return {"prefill": prefill, "decode": decode}

    def track_first_tokens(self, now_s: float, fleet: Fleet) -> None:
        trace = fleet.trace
        while self.arrived < len(trace) and trace.arrival_s[self.arrived] <= now_s:
            self.awaiting_first_token.append(self.arrived)
            self.arrived += 1
        waiting = []
        for i in self.awaiting_first_token:
            at = fleet.first_token[i]
            if at <= now_s:  # NaN (not yet admitted to decode) compares False
                if self.last_first_token is None or at > self.last_first_token[0]:
                    self.last_first_token = (at, fleet.ttft[i], trace.input_tokens[i])
            else:
                waiting.append(i)
        self.awaiting_first_token = waiting


def one_step(loads: list[float], target: float, workers: int) -> int | None:
    """One replica up when every worker is above the target, one down when every worker
    would stay below it with one worker fewer (with the 80% sensitivity)."""
    if all(load > target for load in loads):
        return workers + 1
    if workers > 1:
        boundary = target * (workers - 1) / workers * LOAD_SCALING_DOWN_SENSITIVITY / 100.0
        if all(load < boundary for load in loads):
            return workers - 1
    return None
