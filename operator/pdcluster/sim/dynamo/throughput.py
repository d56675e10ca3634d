"""NVIDIA Dynamo's SLA planner (throughput-based, disaggregated), re-implemented;
`DynamoLoad` (sim/dynamo/load.py) adds its load-based mode on top.

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
see one performance model; and ARIMA is a small auto-ARIMA without MA terms (predictors.py)
instead of pmdarima's.
"""

from __future__ import annotations

import math

import numpy as np

from pdcluster.perf import Profile
from pdcluster.sim import scrapes
from pdcluster.sim.dynamo.predictors import PREDICTORS
from pdcluster.sim.fleet import Fleet

# Ranges of Dynamo's H200 profiling sweep (ISL 100..16372, decode context up to 13585):
# its interpolators clamp to them.
PREFILL_ISL_RANGE = (100.0, 16372.0)
DECODE_MAX_CONTEXT = 13585.0
DECODE_MIN_CONTEXT = 350.0
GRID = 100


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
        m = scrapes.frontend_averages(fleet.scrapes, now_s, self.interval_s)
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
