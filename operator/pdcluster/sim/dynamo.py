"""NVIDIA Dynamo's SLA planner (throughput-based, disaggregated), re-implemented;
`DynamoLoad` at the end adds its load-based mode on top.

From ai-dynamo/dynamo, components/src/dynamo/planner/utils/ (planner_core.py,
prefill_planner.py, disagg_planner.py @002a7c31; decode_planner.py, load_predictor.py
@0ff50012; perf_interpolation.py @0dcef4ef; defaults.py @01127723). Every
`adjustment_interval` (default 180 s, first one a full interval after start):

1. Window means over the interval of the frontend's TTFT, ITL, request duration, ISL
   and OSL, and the request count (increase of the counter, not a rate). A mean that is
   missing (no requests) skips the interval.
2. Correction factors p = TTFT / TTFT_profile(ISL) and
   d = ITL / ITL_profile(concurrency = num_req / num_d * duration / interval, ISL + OSL/2).
3. Predicted num_req, ISL, OSL for the next interval (constant or ARIMA).
4. num_p = ceil(num_req * ISL / interval * min(1, p) / prefill_thpt_per_gpu(ISL) / gpus),
   num_d = ceil(num_req * OSL / interval / decode_thpt_per_gpu(ITL_target / d, ISL + OSL/2) / gpus),
   each at least min_endpoint, then `_apply_global_gpu_budget`.

Differences, both deliberate: the interpolators evaluate the same fitted profile the
simulator runs (perf.Profile) on Dynamo's 100 x 100 decode grid and its profiled
ranges, instead of SciPy cubic interpolation of the raw points, so both autoscalers
see one performance model; and ARIMA is a small auto-ARIMA without MA terms (below)
instead of pmdarima's.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from pdcluster.perf import Profile
from pdcluster.sim import metrics
from pdcluster.sim.fleet import Fleet

# Ranges of Dynamo's H200 profiling sweep (ISL 100..16372, decode context up to 13585):
# its interpolators clamp to them.
PREFILL_ISL_RANGE = (100.0, 16372.0)
DECODE_MAX_CONTEXT = 13585.0
DECODE_MIN_CONTEXT = 350.0
GRID = 100


class ConstantPredictor:
    """Next value = last value (Dynamo's ConstantPredictor, with BasePredictor's data rules)."""

    minimum_points = 1

    def __init__(self) -> None:
        self.data: list[float] = []
        self._seen_nonzero = False

    def add(self, value: float) -> None:
        value = 0.0 if value is None or math.isnan(value) else float(value)
        # Leading zeros (an idle deployment) are skipped until traffic shows up.
        if value == 0.0 and not self._seen_nonzero:
            return
        self._seen_nonzero = True
        self.data.append(value)

    def last(self) -> float:
        return self.data[-1] if self.data else 0.0

    def predict(self) -> float:
        return self.last()


class ArimaPredictor(ConstantPredictor):
    """Auto-ARIMA(p, d, 0), p in 0..2, d in 0..1, picked by AIC, fitted by least squares.

    Like Dynamo's ARIMAPredictor: fewer than 5 points or a constant series return the
    last value, forecasts are clipped at 0, and a failed fit falls back to the last
    value. Unlike pmdarima's auto_arima it fits no moving-average terms.
    """

    minimum_points = 5
    window = 50

    def predict(self) -> float:
        y = np.asarray(self.data[-self.window :], dtype=float)
        if len(y) < self.minimum_points or np.all(y == y[0]):
            return self.last()
        try:
            forecast = _auto_arima_forecast(y)
        except (np.linalg.LinAlgError, ValueError):
            return self.last()
        return max(0.0, forecast) if math.isfinite(forecast) else self.last()


def _auto_arima_forecast(y: np.ndarray) -> float:
    best: tuple[float, float] | None = None
    skip = 3  # the same fitted span for every order, so AICs compare
    for d in (0, 1):
        series = np.diff(y, n=d) if d else y
        for p in (0, 1, 2):
            rows = len(series) - max(p, skip - d)
            if rows < p + 2:
                continue
            target = series[-rows:]
            columns = [np.ones(rows)] + [series[-rows - k : len(series) - k] for k in range(1, p + 1)]
            x = np.column_stack(columns)
            coef, *_ = np.linalg.lstsq(x, target, rcond=None)
            rss = float(np.sum((target - x @ coef) ** 2))
            aic = rows * math.log(max(rss / rows, 1e-12)) + 2 * (p + 1)
            nxt = coef[0] + sum(coef[k] * series[-k] for k in range(1, p + 1))
            forecast = float(y[-1] + nxt) if d else float(nxt)
            if best is None or aic < best[0]:
                best = (aic, forecast)
    if best is None:
        raise ValueError("too few points")
    return best[1]


PREDICTORS = {"constant": ConstantPredictor, "arima": ArimaPredictor}


class DecodeInterpolator:
    """Dynamo's decode grid: ITL and tokens/s/GPU over (KV usage, context length)."""

    def __init__(self, profile: Profile) -> None:
        d0, d1, d2 = profile.decode_coef
        self.max_kv = profile.max_kv_tokens
        self.xi = np.linspace(0.0, 1.0, GRID)
        self.yi = np.linspace(0.0, DECODE_MAX_CONTEXT, GRID)
        kv = np.outer(np.ones(GRID), self.xi) * self.max_kv  # [iy, ix]
        context = np.maximum(np.outer(self.yi, np.ones(GRID)), DECODE_MIN_CONTEXT)
        batch = np.maximum(kv / context, 1.0)
        self.itl = d0 + d1 * batch + d2 * kv
        self.thpt = batch / self.itl * 1000.0 / profile.gpus

    def _row(self, context: float) -> int:
        step = self.yi[1] - self.yi[0]
        return int(np.clip(round((context - self.yi[0]) / step), 0, GRID - 1))

    def interpolate_itl(self, concurrency: float, context: float) -> float:
        usage = concurrency * context / self.max_kv
        ix = int(np.clip(round((usage - self.xi[0]) / (self.xi[1] - self.xi[0])), 0, GRID - 1))
        return float(self.itl[self._row(context), ix])

    def find_best_throughput_per_gpu(self, itl: float, context: float) -> float:
        iy = self._row(context)
        for ix in range(GRID - 1, -1, -1):  # highest KV load whose ITL meets the target
            if self.itl[iy, ix] <= itl:
                return float(self.thpt[iy, ix])
        return float(self.thpt[iy, 0])


class Dynamo:
    name = "dynamo"

    def __init__(
        self,
        profile: Profile,
        *,
        ttft_ms: float,
        itl_ms: float,
        gpu_budget: int,
        start: tuple[int, int],
        interval_s: float = 180.0,
        predictor: str = "arima",
        correction: bool = True,
        min_endpoint: int = 1,
    ) -> None:
        self.profile = profile
        self.ttft_ms = ttft_ms
        self.itl_ms = itl_ms
        self.budget = gpu_budget
        self.start = start
        self.interval_s = interval_s
        self.correction = correction
        self.min_endpoint = min_endpoint
        self.engine_gpus = profile.gpus
        self.predictors = {k: PREDICTORS[predictor]() for k in ("num_req", "isl", "osl")}
        self.decode_interp = DecodeInterpolator(profile)
        self.p_correction = 1.0
        self.d_correction = 1.0
        self.last_reason = ""

    def initial(self) -> tuple[int, int]:
        return self.start

    def _isl(self, isl: float) -> float:
        return min(max(isl, PREFILL_ISL_RANGE[0]), PREFILL_ISL_RANGE[1])

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None:
        wanted = self.plan(now_s, fleet)
        if wanted is None:
            return None
        num_p, num_d = self.apply_global_gpu_budget(*wanted)
        self.last_reason += f": {num_p}:{num_d}"
        return num_p, num_d

    def plan(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None:
        """The replicas the formulas ask for, before the GPU budget (plan_adjustment)."""
        m = metrics.frontend_averages(fleet.scrapes, now_s, self.interval_s)
        if m is None:
            return None
        for key, value in (("num_req", m.num_req), ("isl", m.isl), ("osl", m.osl)):
            self.predictors[key].add(math.nan if value is None else value)
        if None in (m.ttft_ms, m.itl_ms, m.isl, m.osl):
            self.last_reason = "metrics contain None or NaN values (no active requests), skipping adjustment"
            return None
        if self.correction:
            isl = self._isl(m.isl)  # type: ignore[arg-type]
            self.p_correction = m.ttft_ms / self.profile.prefill_one_ms(int(isl))  # type: ignore[operator]
            num_d = len(fleet.ready["decode"])
            if num_d:
                concurrency = m.num_req / num_d * (m.request_duration_s or 0.0) / self.interval_s
                expect = self.decode_interp.interpolate_itl(concurrency, m.isl + m.osl / 2)  # type: ignore[operator]
                self.d_correction = m.itl_ms / expect  # type: ignore[operator]
        num_req = self.predictors["num_req"].predict()
        isl = self.predictors["isl"].predict()
        osl = self.predictors["osl"].predict()
        prefill_tokens = num_req * isl / self.interval_s * min(1.0, self.p_correction)
        prefill_per_gpu = self.profile.prefill_tokens_per_s(int(self._isl(isl))) / self.profile.gpus
        num_p = max(math.ceil(prefill_tokens / prefill_per_gpu / self.engine_gpus), self.min_endpoint)
        corrected_itl = self.itl_ms / self.d_correction if self.d_correction > 0 else self.itl_ms
        decode_per_gpu = self.decode_interp.find_best_throughput_per_gpu(corrected_itl, isl + osl / 2)
        if decode_per_gpu <= 0:
            num_d = self.min_endpoint
        else:
            decode_tokens = num_req * osl / self.interval_s
            num_d = max(math.ceil(decode_tokens / decode_per_gpu / self.engine_gpus), self.min_endpoint)
        self.last_reason = (
            f"num_req {num_req:.0f} isl {isl:.0f} osl {osl:.0f} p_corr {self.p_correction:.2f} "
            f"d_corr {self.d_correction:.2f}: wants {num_p}:{num_d}"
        )
        return num_p, num_d

    def apply_global_gpu_budget(self, num_p: int, num_d: int) -> tuple[int, int]:
        """planner_core._apply_global_gpu_budget (prefill and decode engines alike)."""
        gp = gd = self.engine_gpus
        if self.budget < 0:
            return num_p, num_d
        total = num_p * gp + num_d * gd
        if total <= self.budget:
            return num_p, num_d
        floor = self.min_endpoint * gp + self.min_endpoint * gd
        if self.budget < floor:
            return 0, 0
        scale = self.budget / total
        max_prefill = math.floor((self.budget - self.min_endpoint * gd) / gp)
        num_p = max(self.min_endpoint, min(max_prefill, math.floor(num_p * scale)))
        remaining = self.budget - num_p * gp
        num_d = max(self.min_endpoint, math.floor(remaining / gd))
        return num_p, num_d


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
