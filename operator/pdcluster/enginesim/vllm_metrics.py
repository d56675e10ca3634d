"""vLLM's Prometheus metrics, by the names, types, labels and buckets of vLLM 0.33
(vllm/v1/metrics/loggers.py, vllm/v1/metrics/buckets.py, and the Mooncake connector's
.../kv_connector/v1/mooncake/stats.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdcluster import observability as obs

FINISH_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
_MOONCAKE_BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))


class EngineMetrics:
    """The series of one DP engine (label engine=<rank>); families are shared."""

    def __init__(self, families: MetricFamilies, model_name: str, engine: int):
        labels = (model_name, str(engine))
        f = families
        self.running = f.running.labels(*labels)
        self.waiting = f.waiting.labels(*labels)
        self.kv_usage = f.kv_usage.labels(*labels)
        self.prompt_tokens = f.prompt_tokens.labels(*labels)
        self.prompt_by_source = {s: f.prompt_by_source.labels(*labels, s) for s in PROMPT_SOURCES}
        self.generation_tokens = f.generation_tokens.labels(*labels)
        self.prefix_queries = f.prefix_queries.labels(*labels)
        self.prefix_hits = f.prefix_hits.labels(*labels)
        self.success = {r: f.success.labels(*labels, r) for r in FINISH_REASONS}
        self.preemptions = f.preemptions.labels(*labels)
        self.ttft = f.ttft.labels(*labels)
        self.itl = f.itl.labels(*labels)
        self.tpot = f.tpot.labels(*labels)
        self.e2e = f.e2e.labels(*labels)
        self.queue = f.queue.labels(*labels)
        self.inference = f.inference.labels(*labels)
        self.prefill = f.prefill.labels(*labels)
        self.decode = f.decode.labels(*labels)
        self.request_prompt_tokens = f.request_prompt_tokens.labels(*labels)
        self.request_generation_tokens = f.request_generation_tokens.labels(*labels)
        self.request_max_tokens = f.request_max_tokens.labels(*labels)
        self.iteration_tokens = f.iteration_tokens.labels(*labels)
        self.xfer_time = f.xfer_time.labels(*labels)
        self.xfer_bytes = f.xfer_bytes.labels(*labels)
        self.failed_recvs = f.failed_recvs.labels(*labels)
        self.expired = f.expired.labels(*labels)


class MetricFamilies:
    def __init__(
        self,
        max_model_len: int,
        registry: CollectorRegistry | None = None,
        kv_tokens: int | None = None,
        block_size: int = 16,
    ):
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, obs.VLLM_LABELS
        # vLLM's info gauge of its KV cache: value 1, the facts in labels (the router
        # reads block size and hash from it to key store lookups).
        Gauge(
            obs.VLLM_CACHE_CONFIG,
            "Information of the LLMEngine CacheConfig",
            ("block_size", "num_gpu_blocks", "prefix_caching_hash_algo"),
            registry=r,
        ).labels(str(block_size), str(kv_tokens // block_size) if kv_tokens else "None", "sha256").set(1)
        token_buckets = obs.vllm_request_token_buckets(max_model_len)
        self.running = Gauge(
            obs.VLLM_RUNNING, "Number of requests in model execution batches.", labels, registry=r
        )
        self.waiting = Gauge(
            obs.VLLM_WAITING, "Number of requests waiting to be processed.", labels, registry=r
        )
        self.kv_usage = Gauge(
            obs.VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.", labels, registry=r
        )
        self.prompt_tokens = Counter(
            obs.VLLM_PROMPT_TOKENS, "Number of prefill tokens processed.", labels, registry=r
        )
        self.prompt_by_source = Counter(
            obs.VLLM_PROMPT_TOKENS_BY_SOURCE,
            "Number of prompt tokens by source.",
            (*labels, "source"),
            registry=r,
        )
        self.generation_tokens = Counter(
            obs.VLLM_GENERATION_TOKENS, "Number of generation tokens processed.", labels, registry=r
        )
        self.prefix_queries = Counter(
            obs.VLLM_PREFIX_QUERIES,
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        )
        self.prefix_hits = Counter(
            obs.VLLM_PREFIX_HITS,
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=r,
        )
        self.success = Counter(
            obs.VLLM_REQUEST_SUCCESS,
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=r,
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r
        )
        self.ttft = Histogram(
            obs.VLLM_TTFT,
            "Histogram of time to first token in seconds.",
            labels,
            buckets=obs.VLLM_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            obs.VLLM_ITL,
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=obs.VLLM_ITL_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            labels,
            buckets=obs.VLLM_ITL_BUCKETS,
            registry=r,
        )

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=obs.VLLM_REQUEST_LATENCY_BUCKETS, registry=r)

        self.e2e = latency(obs.VLLM_E2E, "Histogram of e2e request latency in seconds.")
        self.queue = latency(obs.VLLM_QUEUE_TIME, "Histogram of time spent in WAITING phase for request.")
        self.inference = latency(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."
        )
        self.prefill = latency(obs.VLLM_PREFILL_TIME, "Histogram of time spent in PREFILL phase for request.")
        self.decode = latency(obs.VLLM_DECODE_TIME, "Histogram of time spent in DECODE phase for request.")

        def tokens(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=token_buckets, registry=r)

        self.request_prompt_tokens = tokens(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed."
        )
        self.request_generation_tokens = tokens(
            "vllm:request_generation_tokens", "Number of generation tokens processed."
        )
        self.request_max_tokens = tokens(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."
        )
        self.iteration_tokens = Histogram(
            obs.VLLM_ITERATION_TOKENS,
            "Histogram of number of tokens per engine_step.",
            labels,
            buckets=obs.VLLM_ITERATION_TOKEN_BUCKETS,
            registry=r,
        )
        self.xfer_time = Histogram(
            obs.VLLM_MOONCAKE_XFER_TIME,
            "Histogram of transfer duration for Mooncake KV Cache transfers.",
            labels,
            buckets=obs.VLLM_MOONCAKE_XFER_BUCKETS,
            registry=r,
        )
        self.xfer_bytes = Histogram(
            "vllm:mooncake_bytes_transferred",
            "Histogram of bytes transferred per Mooncake KV Cache transfer.",
            labels,
            buckets=_MOONCAKE_BYTES_BUCKETS,
            registry=r,
        )
        self.failed_recvs = Counter(
            "vllm:mooncake_num_failed_recvs",
            "Number of failed Mooncake KV Cache receives.",
            labels,
            registry=r,
        )
        self.expired = Counter(
            "vllm:mooncake_num_kv_expired_reqs",
            "Number of requests that had their KV expire.",
            labels,
            registry=r,
        )
