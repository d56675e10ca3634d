"""The one table of what the control law reads, and how each field is taken from series.

Both readers of metrics derive from `SERIES`: the operator's PromQL
(pdcluster.io.prometheus) and the fleet simulator's evaluator over its own scrapes
(pdcluster.sim.scrapes). A field is a keyword of control.types.assemble; its series is
a metric of the router (no role) or of one engine role; its kind says how the window
turns the series into one number:

- `rate`: per-second increase of a counter, summed over the role's engines;
- `rate_before`: the same over the window before this one (the load's trend);
- `quantile`: histogram_quantile of the SLO quantile over the summed buckets' rate;
- `mean`: increase of the histogram's sum / increase of its count;
- `count_rate`: per-second increase of the histogram's count (observations);
- `buckets`: per-second rate of each bucket (not cumulative), the last one +Inf;
- `gauge_sum` / `gauge_avg`: each engine's mean over the window, summed / averaged;
- `engines`: engines reporting, the window's mean (counted on the role's waiting gauge).

Latency fields are in milliseconds (the series are in seconds). The parity test
(tests/integration/test_metrics_parity.py) exports one set of samples to a real
Prometheus and to the simulator's evaluator and compares every field.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from pdcluster import constants as C
from pdcluster import observability as obs


class Kind(StrEnum):
    rate = "rate"
    rate_before = "rate_before"
    quantile = "quantile"
    mean = "mean"
    count_rate = "count_rate"
    buckets = "buckets"
    gauge_sum = "gauge_sum"
    gauge_avg = "gauge_avg"
    engines = "engines"


@dataclass(frozen=True)
class Series:
    field: str  # keyword of control.types.assemble
    kind: Kind
    metric: str  # as exported, counters without _total
    role: str | None = None  # engine role; None: the router
    outcome: str | None = None  # the router's outcome label

    @property
    def counter(self) -> bool:
        return self.kind in (Kind.rate, Kind.rate_before)

    @property
    def histogram(self) -> bool:
        return self.kind in (Kind.quantile, Kind.mean, Kind.count_rate, Kind.buckets)

    @property
    def in_ms(self) -> bool:
        return self.kind in (Kind.quantile, Kind.mean)

    @property
    def key(self) -> str:
        """The simulator's name of the series: metric, role and label folded into one."""
        parts = [self.metric, self.role, self.outcome]
        return ":".join(p for p in parts if p) if self.kind != Kind.engines else f"engines:{self.role}"


SERIES: Final[tuple[Series, ...]] = (
    Series("ttft_ms", Kind.quantile, obs.ROUTER_TTFT),
    Series("ttft_mean_ms", Kind.mean, obs.ROUTER_TTFT),
    Series("ttft_beyond_prefill_ms", Kind.quantile, obs.ROUTER_TTFT_BEYOND_PREFILL),
    Series("router_prefill_ms", Kind.mean, obs.ROUTER_PREFILL),
    Series("router_after_prefill_ms", Kind.mean, obs.ROUTER_AFTER_PREFILL),
    Series("itl_ms", Kind.quantile, obs.ROUTER_ITL),
    Series("tpot_ms", Kind.quantile, obs.ROUTER_TPOT),
    Series("prompt_tokens_rate", Kind.rate, obs.ROUTER_PROMPT_TOKENS),
    Series("prompt_tokens_rate_before", Kind.rate_before, obs.ROUTER_PROMPT_TOKENS),
    Series("finished_rate", Kind.rate, obs.ROUTER_REQUESTS, outcome="ok"),
    Series("generated_tokens_rate", Kind.rate, obs.ROUTER_GENERATION_TOKENS),
    Series("prefill_ttft_ms", Kind.quantile, obs.VLLM_TTFT, C.ROLE_PREFILL),
    Series("queue_time_q_ms", Kind.quantile, obs.VLLM_QUEUE_TIME, C.ROLE_PREFILL),
    Series("queue_time_ms", Kind.mean, obs.VLLM_QUEUE_TIME, C.ROLE_PREFILL),
    Series("prefill_time_ms", Kind.mean, obs.VLLM_PREFILL_TIME, C.ROLE_PREFILL),
    Series("prefill_steps_rate", Kind.count_rate, obs.VLLM_ITERATION_TOKENS, C.ROLE_PREFILL),
    Series("prefilled_tokens_rate", Kind.rate, obs.VLLM_PROMPT_TOKENS, C.ROLE_PREFILL),
    Series("prefilled_rate", Kind.rate, obs.VLLM_REQUEST_SUCCESS, C.ROLE_PREFILL),
    Series("prefix_queries_rate", Kind.rate, obs.VLLM_PREFIX_QUERIES, C.ROLE_PREFILL),
    Series("prefix_hits_rate", Kind.rate, obs.VLLM_PREFIX_HITS, C.ROLE_PREFILL),
    Series("prompt_tokens", Kind.buckets, obs.VLLM_REQUEST_PROMPT_TOKENS, C.ROLE_PREFILL),
    Series("kv_handoff_ms", Kind.mean, obs.VLLM_MOONCAKE_XFER_TIME, C.ROLE_PREFILL),
    Series("prefill_queue", Kind.gauge_sum, obs.VLLM_WAITING, C.ROLE_PREFILL),
    Series("prefill_ready", Kind.engines, obs.VLLM_WAITING, C.ROLE_PREFILL),
    Series("decode_itl_ms", Kind.quantile, obs.VLLM_ITL, C.ROLE_DECODE),
    Series("decode_tokens_rate", Kind.rate, obs.VLLM_GENERATION_TOKENS, C.ROLE_DECODE),
    Series("decode_running", Kind.gauge_sum, obs.VLLM_RUNNING, C.ROLE_DECODE),
    Series("decode_kv_usage", Kind.gauge_avg, obs.VLLM_KV_USAGE, C.ROLE_DECODE),
    Series("decode_ready", Kind.engines, obs.VLLM_WAITING, C.ROLE_DECODE),
    Series("colocated_prompt_tokens_rate", Kind.rate, obs.VLLM_PROMPT_TOKENS, C.ROLE_COLOCATED),
    Series("colocated_finished_rate", Kind.rate, obs.VLLM_REQUEST_SUCCESS, C.ROLE_COLOCATED),
    Series("colocated_ttft_ms", Kind.quantile, obs.VLLM_TTFT, C.ROLE_COLOCATED),
    Series("colocated_queue_time_q_ms", Kind.quantile, obs.VLLM_QUEUE_TIME, C.ROLE_COLOCATED),
    Series("colocated_itl_ms", Kind.quantile, obs.VLLM_ITL, C.ROLE_COLOCATED),
    Series("colocated_kv_usage", Kind.gauge_avg, obs.VLLM_KV_USAGE, C.ROLE_COLOCATED),
    Series("colocated_waiting", Kind.gauge_sum, obs.VLLM_WAITING, C.ROLE_COLOCATED),
    Series("colocated_ready", Kind.engines, obs.VLLM_WAITING, C.ROLE_COLOCATED),
)
BY_FIELD: Final = {s.field: s for s in SERIES}
# Does Prometheus hold anything of this cluster at all (the router's or any engine's)?
PRESENCE: Final = (obs.ROUTER_PROMPT_TOKENS + "_total", obs.VLLM_WAITING)
# What the demo's live view reads beside the control law's table (which it reads whole,
# to judge the SLO as the law does: pdcluster.slo): the requests the router receives,
# whatever their outcome.
WATCHED: Final[tuple[Series, ...]] = (Series("requests_rate", Kind.rate, obs.ROUTER_REQUESTS),)
