"""llm-d's per-role autoscaling of a prefill/decode deployment: one KEDA ScaledObject (and so
one HorizontalPodAutoscaler) per role, each scaling on a vLLM gauge summed over its pods.

Sources:
- llm-d/llm-d guides/workload-autoscaling/keda-epp-token-aware/pd-disaggregation/base/
  decode-scaledobject.yaml @56cb1218 and prefill-scaledobject.yaml @04c0115b: one
  ScaledObject per role, "prefill and decode scale independently"; decode on
  sum(vllm:kv_cache_usage_perc) over decode pods, metricType AverageValue, threshold 0.8
  ("pods' worth of full KV cache per replica"); pollingInterval 15; minReplicaCount 1,
  maxReplicaCount 10; HPA behavior scaleUp stabilizationWindowSeconds 0 with at most 1 pod
  per 180 s, scaleDown stabilizationWindowSeconds 300 with at most 1 pod per 300 s. The
  same README explains AverageValue: "the HPA computes ceil(value / threshold)".
- That guide's prefill trigger is the router's in-flight prompt tokens / a calibrated
  prefill rate (seconds of backlog, threshold 1.5). The prefill signal here is instead
  vllm:num_requests_waiting summed over prefill pods, with an AverageValue target of 5
  waiting requests per replica: the queue threshold llm-d pairs with KV 0.8, i.e. the
  workload variant autoscaler's queueLengthThreshold and the EPP saturation detector's
  queueDepthThreshold, both 5 (llm-d-incubation/workload-variant-autoscaler
  docs/saturation-scaling-config.md @93aa06c4). llm-d ships no ScaledObject on
  num_requests_waiting for a P/D prefill pool that I could find, so 5 is an assumption.
- Kubernetes HPA (pkg/controller/podautoscaler, and the HPA docs): a sync every 15 s
  (--horizontal-pod-autoscaler-sync-period); for an External AverageValue metric,
  ratio = value / (target * current pods) and, unless |ratio - 1| <= 0.1 (the default
  --horizontal-pod-autoscaler-tolerance) leaves the pods as they are, desired =
  ceil(value / target); then the stabilization windows (up: the lowest recommendation of
  the window, down: the highest) and the rate policies (pods added or removed within
  periodSeconds count against the limit), bounded by min and max replicas.

Deliberate differences:
- The gauges are read through the fleet's Prometheus emulation (metrics.snapshot) as their
  mean over `window_s` (default 30 s: the two latest 15 s scrapes, as the evaluator needs
  two samples) instead of KEDA's instant query of the latest one. The snapshot sums the prefill queue over the
  pods; decode KV usage is its per-pod mean times the pods reporting. A missing series
  reads 0, as the guides' `or vector(0)` makes it; no scrapes at all skips the sync.
- A GPU budget, which HPAs know nothing of: each HPA keeps its own desired count, and when
  both together want more engines than `gpu_budget` holds (engines of `gpus_per_engine`
  GPUs) the fleet gets both clipped in proportion (largest remainder, at least 1 each),
  as a quota would leave the extra pods uncreated.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pdcluster.perf import Profile
from pdcluster.sim import scrapes
from pdcluster.sim.fleet import Fleet

SYNC_PERIOD_S = 15.0
TOLERANCE = 0.1
PREFILL_WAITING_PER_REPLICA = 5.0
DECODE_KV_PER_REPLICA = 0.8


@dataclass(frozen=True)
class Behavior:
    """One direction of an HPA's `behavior`: a stabilization window and one Pods policy."""

    stabilization_s: float
    pods: int
    period_s: float


SCALE_UP = Behavior(stabilization_s=0.0, pods=1, period_s=180.0)
SCALE_DOWN = Behavior(stabilization_s=300.0, pods=1, period_s=300.0)


@dataclass
class HPA:
    """A HorizontalPodAutoscaler on one External AverageValue metric."""

    target: float
    replicas: int  # spec.replicas, as the HPA last set it
    min_replicas: int = 1
    max_replicas: int = 10
    up: Behavior = SCALE_UP
    down: Behavior = SCALE_DOWN
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    events: deque[tuple[float, int]] = field(default_factory=deque)  # (when, replicas added)

    def sync(self, now_s: float, value: float, pods: int) -> int:
        """The replicas after one sync, given the metric's value and the pods that exist."""
        recommended = self.recommend(value, pods)
        stabilized = self.stabilize(now_s, recommended)
        desired = self.rate_limited(now_s, stabilized)
        if desired != self.replicas:
            self.events.append((now_s, desired - self.replicas))
            self.replicas = desired
        return self.replicas

    def recommend(self, value: float, pods: int) -> int:
        if pods > 0 and abs(value / (self.target * pods) - 1.0) <= TOLERANCE:
            return pods
        return math.ceil(value / self.target)

    def stabilize(self, now_s: float, recommended: int) -> int:
        horizon = max(self.up.stabilization_s, self.down.stabilization_s)
        while self.recommendations and self.recommendations[0][0] < now_s - horizon:
            self.recommendations.popleft()
        up, down = recommended, recommended
        for at, past in self.recommendations:
            if at > now_s - self.up.stabilization_s:
                up = min(up, past)
            if at > now_s - self.down.stabilization_s:
                down = max(down, past)
        self.recommendations.append((now_s, recommended))
        # Move only as far as every recommendation in the window agrees.
        return min(max(self.replicas, up), down)

    def rate_limited(self, now_s: float, desired: int) -> int:
        horizon = max(self.up.period_s, self.down.period_s)
        while self.events and self.events[0][0] < now_s - horizon:
            self.events.popleft()
        if desired > self.replicas:
            added = sum(n for at, n in self.events if at > now_s - self.up.period_s)
            limit = self.replicas - added + self.up.pods
            return max(self.replicas, min(desired, limit, self.max_replicas))
        if desired < self.replicas:
            added = sum(n for at, n in self.events if at > now_s - self.down.period_s)
            limit = self.replicas - added - self.down.pods
            return min(self.replicas, max(desired, limit, self.min_replicas))
        return desired


def clip_to_budget(prefill: int, decode: int, engines: int) -> tuple[int, int]:
    """Both counts scaled down in proportion to fit `engines`, at least one each."""
    if prefill + decode <= engines:
        return prefill, decode
    shares = (prefill * engines / (prefill + decode), decode * engines / (prefill + decode))
    clipped = [math.floor(s) for s in shares]
    if sum(clipped) < engines:  # the engine left over goes to the larger remainder
        clipped[0 if shares[0] - clipped[0] >= shares[1] - clipped[1] else 1] += 1
    if clipped[0] < 1:
        clipped = [1, max(engines - 1, 1)]
    elif clipped[1] < 1:
        clipped = [max(engines - 1, 1), 1]
    return clipped[0], clipped[1]


class LLMD:
    name = "llmd"

    def __init__(
        self,
        profile: Profile,
        *,
        ttft_ms: float,
        itl_ms: float,
        gpu_budget: int,
        start: tuple[int, int],
        interval_s: float = SYNC_PERIOD_S,
        gpus_per_engine: int | None = None,
        prefill_waiting_target: float = PREFILL_WAITING_PER_REPLICA,
        decode_kv_target: float = DECODE_KV_PER_REPLICA,
        max_replicas: int = 10,
        window_s: int = 30,
    ) -> None:
        # The SLO targets only document the deployment: llm-d's HPAs read no latency.
        self.ttft_ms = ttft_ms
        self.itl_ms = itl_ms
        self.start = start
        self.interval_s = interval_s
        self.gpus_per_engine = profile.gpus if gpus_per_engine is None else gpus_per_engine
        self.gpu_budget = gpu_budget  # < 0: none
        self.window_s = window_s
        self.prefill = HPA(prefill_waiting_target, start[0], max_replicas=max_replicas)
        self.decode = HPA(decode_kv_target, start[1], max_replicas=max_replicas)
        self.last_reason = ""

    def initial(self) -> tuple[int, int]:
        return self.start

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None:
        snap = scrapes.snapshot(fleet.scrapes, now_s, self.window_s, 0.5)
        if snap is None:
            return None
        waiting = snap.prefill_queue or 0.0
        kv_pods = (snap.decode_kv_usage or 0.0) * (snap.decode.ready or 0.0)
        prefill = self.prefill.sync(now_s, waiting, len(fleet.active("prefill")))
        decode = self.decode.sync(now_s, kv_pods, len(fleet.active("decode")))
        wanted = (prefill, decode)
        if self.gpu_budget >= 0:
            wanted = clip_to_budget(prefill, decode, self.gpu_budget // self.gpus_per_engine)
        self.last_reason = (
            f"waiting {waiting:.1f} (target {self.prefill.target:g}/pod), KV {kv_pods:.2f} pods "
            f"(target {self.decode.target:g}/pod): HPAs {prefill}:{decode}, budget {wanted[0]}:{wanted[1]}"
        )
        return wanted
