"""Metric names and histogram buckets shared by the router, the engine simulator, the
fleet simulator and the autoscaler's PromQL, so all of them speak about the same series.

vLLM names and buckets are those of vLLM's V1 metrics (vllm/v1/metrics/loggers.py and
buckets.py). Prometheus adds the labels `pdcluster` (cluster name) and `role` from pod
labels when it scrapes, see the chart's PodMonitor and the local cluster's scrape config.
"""

import math
from bisect import bisect_left
from typing import Final

# ------------------------------------------------------------------ vLLM (engine) side
VLLM_TTFT: Final = "vllm:time_to_first_token_seconds"
VLLM_ITL: Final = "vllm:inter_token_latency_seconds"
VLLM_E2E: Final = "vllm:e2e_request_latency_seconds"
VLLM_QUEUE_TIME: Final = "vllm:request_queue_time_seconds"
VLLM_PREFILL_TIME: Final = "vllm:request_prefill_time_seconds"
VLLM_DECODE_TIME: Final = "vllm:request_decode_time_seconds"
VLLM_RUNNING: Final = "vllm:num_requests_running"
VLLM_WAITING: Final = "vllm:num_requests_waiting"
VLLM_KV_USAGE: Final = "vllm:kv_cache_usage_perc"
VLLM_PROMPT_TOKENS: Final = "vllm:prompt_tokens"  # counter, exposed with _total
# counter{source}: local_compute, local_cache_hit, external_kv_transfer (v1/metrics/loggers.py)
VLLM_PROMPT_TOKENS_BY_SOURCE: Final = "vllm:prompt_tokens_by_source"
VLLM_GENERATION_TOKENS: Final = "vllm:generation_tokens"  # counter, exposed with _total
VLLM_REQUEST_SUCCESS: Final = "vllm:request_success"  # counter{finished_reason}
VLLM_ITERATION_TOKENS: Final = "vllm:iteration_tokens_total"  # histogram
VLLM_PREFIX_QUERIES: Final = "vllm:prefix_cache_queries"  # counter, tokens
VLLM_PREFIX_HITS: Final = "vllm:prefix_cache_hits"  # counter, tokens
# Histogram on the sending side: Mooncake is prefill-push, so prefill records the transfers
# (vLLM's mooncake_connector.py, MooncakeConnector.get_kv_connector_stats).
VLLM_MOONCAKE_XFER_TIME: Final = "vllm:mooncake_xfer_time_seconds"
VLLM_MOONCAKE_XFER_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
VLLM_MOONCAKE_FAILED_RECVS: Final = "vllm:mooncake_num_failed_recvs"  # counter: KV pulls that failed on decode
VLLM_CACHE_CONFIG: Final = "vllm:cache_config_info"  # gauge 1{block_size, num_gpu_blocks, ...}
VLLM_REQUEST_PROMPT_TOKENS: Final = "vllm:request_prompt_tokens"  # histogram, per finished request
VLLM_LABELS: Final = ("model_name", "engine")

VLLM_TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_ITERATION_TOKEN_BUCKETS: Final = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def vllm_request_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets up to max_model_len (build_1_2_5_buckets)."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(out)
            out.append(value)
        exponent += 1


# ---------------------------------------------------------------------- router side
# The router measures what users see; the autoscaler prefers these over engine metrics.
ROUTER_TTFT: Final = "pdcluster_router_time_to_first_token_seconds"
ROUTER_ITL: Final = "pdcluster_router_inter_token_latency_seconds"
# A streamed request's mean time per output token (first token to last), once per
# request: what a per-request ITL target bounds. The token gaps' tail is not it on
# colocated engines, where a step that carries a prompt chunk delays every stream once.
ROUTER_TPOT: Final = "pdcluster_router_time_per_output_token_seconds"
ROUTER_E2E: Final = "pdcluster_router_e2e_request_latency_seconds"
# Where a streamed request's time to first token went, as the router sees it: the
# prefill exchange (its queue and compute), then the prefill's answer to the first token
# (KV hand-off and the decode engine's wait).
ROUTER_PREFILL: Final = "pdcluster_router_prefill_seconds"
ROUTER_AFTER_PREFILL: Final = "pdcluster_router_first_token_after_prefill_seconds"
# TTFT beyond prefill: a streamed request's TTFT less its prompt's own prefill compute,
# as the prefill engine reports it per request (docs/metrics.md); what
# `slo.ttftMs` bounds when `ttftIncludesPrefill` is false.
ROUTER_TTFT_BEYOND_PREFILL: Final = "pdcluster_router_ttft_beyond_prefill_seconds"
ROUTER_REQUESTS: Final = "pdcluster_router_requests"  # counter{outcome}, exposed with _total
ROUTER_REJECTIONS: Final = "pdcluster_router_rejections"  # counter{reason}
ROUTER_UPSTREAM_ERRORS: Final = "pdcluster_router_upstream_errors"  # counter{role, backend}
ROUTER_INFLIGHT: Final = "pdcluster_router_inflight_requests"  # gauge{role, backend}
ROUTER_INFLIGHT_TOKENS: Final = "pdcluster_router_inflight_tokens"  # gauge{role, backend}
ROUTER_PROMPT_TOKENS: Final = "pdcluster_router_prompt_tokens"  # counter
ROUTER_LOCAL_PREFILLS: Final = "pdcluster_router_local_prefills"  # counter: short prompts prefilled on decode
ROUTER_GENERATION_TOKENS: Final = "pdcluster_router_generation_tokens"  # counter
ROUTER_BACKENDS: Final = "pdcluster_router_backends"  # gauge{role}: ready backends
# Prompt hits in the Mooncake store (router/store_hits.py): every lookup by outcome, what one
# costs, and the requests that went straight to decode with the tokens decode loaded.
ROUTER_STORE_LOOKUPS: Final = "pdcluster_router_store_lookups"  # counter{outcome}
ROUTER_STORE_LOOKUP_SECONDS: Final = "pdcluster_router_store_lookup_seconds"
ROUTER_PREFILL_BYPASSED: Final = "pdcluster_router_prefill_bypassed"  # counter
ROUTER_STORE_PREFIX_TOKENS: Final = "pdcluster_router_store_prefix_tokens"  # counter
ROUTER_RETRIES: Final = "pdcluster_router_retries"  # counter{role}: attempts after one failed there
ROUTER_RESUMED_STREAMS: Final = "pdcluster_router_resumed_streams"  # counter{outcome}
ROUTER_RESUME_OUTCOMES: Final = ("resumed", "not_resumable")
ROUTER_KV_PROBES: Final = "pdcluster_router_kv_probes"  # counter{outcome}
ROUTER_KV_PAIRS: Final = "pdcluster_router_kv_pairs"  # gauge{verdict}: passed | failed | unverified
ROUTER_CIRCUIT_OPENS: Final = "pdcluster_router_circuit_opens"  # counter{role, backend}
# client connections the router's HTTP front cut: slow or silent clients, bodies over the
# limit refused at their head, connections past the limit
ROUTER_CONNECTIONS_CUT: Final = "pdcluster_router_connections_cut"  # counter{reason}
ROUTER_CONNECTION_CUT_REASONS: Final = ("head_timeout", "body_timeout", "too_large", "over_limit")
# precise-prefix routing: engines' KV events and prompts' exact block hashes
ROUTER_KV_EVENT_BATCHES: Final = "pdcluster_router_kv_event_batches"  # counter
ROUTER_KV_EVENT_LOSSES: Final = "pdcluster_router_kv_event_losses"  # counter{reason}
ROUTER_KV_EVENT_LOSS_REASONS: Final = ("gap", "disconnect", "undecodable")
ROUTER_EXACT_BLOCKS: Final = "pdcluster_router_exact_blocks"  # counter{outcome}
ROUTER_EXACT_OUTCOMES: Final = ("ok", "error", "unsupported")
# prompt tokens the picked engine holds in its prefix cache, by what says so
ROUTER_CACHED_PROMPT_TOKENS: Final = "pdcluster_router_cached_prompt_tokens"  # counter{source}
ROUTER_CACHE_SOURCES: Final = ("events", "guess")
# spans the router's trace export dropped: queue_full (more waited than it keeps),
# refused (the collector answered a final error: 400, 401, ...), unreachable (no answer,
# or only retryable ones, within the export timeout)
ROUTER_TRACE_SPANS_DROPPED: Final = "pdcluster_router_trace_spans_dropped"  # counter{reason}
ROUTER_TRACE_DROP_REASONS: Final = ("queue_full", "refused", "unreachable")
ROUTER_STORE_OUTCOMES: Final = ("hit", "partial", "miss", "short", "error", "unsupported")
ROUTER_STORE_LOOKUP_BUCKETS: Final = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25,
)  # fmt: skip
ROUTER_OUTCOMES: Final = ("ok", "rejected", "client_error", "upstream_error", "timeout", "cancelled")

# Fine enough around typical SLOs to tell a 15 ms ITL from a 25 ms one and a 400 ms
# TTFT from a 600 ms one (histogram_quantile interpolates linearly inside a bucket).
ROUTER_ITL_BUCKETS: Final = (
    0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.0225, 0.025, 0.0275,
    0.03, 0.035, 0.04, 0.045, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip
ROUTER_TTFT_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6,
    0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0,
    30.0, 60.0, 120.0,
)  # fmt: skip
ROUTER_E2E_BUCKETS: Final = VLLM_REQUEST_LATENCY_BUCKETS

# Labels Prometheus attaches at scrape time (from pod labels pdcluster.io/cluster and
# pdcluster.io/role); every autoscaler query groups by them.
PROM_LABEL_CLUSTER: Final = "pdcluster"
PROM_LABEL_ROLE: Final = "role"

# ---------------------------------------------------------------------- operator side
# Labelled pdcluster_namespace/pdcluster, not namespace: a scrape of the operator's own pod
# would otherwise clash with the target's `namespace` label.
OPERATOR_DECISIONS: Final = (
    "pdcluster_scaling_decisions"  # counter{pdcluster_namespace, pdcluster, action, cause}
)
OPERATOR_DESIRED_REPLICAS: Final = "pdcluster_desired_replicas"  # gauge{pdcluster_namespace, pdcluster, role}
OPERATOR_RECONCILES: Final = "pdcluster_reconciles"  # counter{result}
OPERATOR_RECONCILE_SECONDS: Final = "pdcluster_reconcile_duration_seconds"  # histogram
# gauge{version, component} = 1 on the operator's and the router's /metrics: which build runs where
BUILD_INFO: Final = "pdcluster_build_info"


class Histogram:
    """A Prometheus histogram: per-bucket counts (the last is +Inf), sum and count.

    Plain arithmetic, for what is observed per token (the router's ITL, the simulators):
    no lock (one event loop owns it), and n equal observations cost one."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def observe_steps(self, first: float, growth: float, steps: int, weight: int, skipped: int) -> None:
        """`steps` values first, first + growth, ... each seen `weight` times, less
        `skipped` observations of the first value (decode steps: every running sequence
        gets a token per step, and a sequence's first token is a TTFT, not an ITL)."""
        if steps <= 0:
            return
        total = weight * steps - skipped
        below = 0
        for j, bound in enumerate(self.bounds):
            if growth > 0:
                fit = min(max(math.floor((bound - first) / growth) + 1, 0), steps)
            else:
                fit = steps if first <= bound else 0
            cumulative = weight * fit - (skipped if fit else 0)
            self.counts[j] += cumulative - below
            below = cumulative
            if fit == steps:
                break
        self.counts[-1] += total - below
        self.sum += weight * (steps * first + growth * steps * (steps - 1) / 2) - skipped * first
        self.count += total

    def snapshot(self) -> tuple[tuple[int, ...], float, int]:
        return tuple(self.counts), self.sum, self.count
