"""vLLM's Prometheus metrics, by the names, types, labels and buckets of vLLM 0.33
(vllm/v1/metrics/loggers.py, vllm/v1/metrics/buckets.py, and the Mooncake connector's
.../kv_connector/v1/mooncake/stats.py). The names the operator and the router read are
pdcluster.observability's; those only a dashboard or a client would read are written
here, beside the one exposition that serves them."""

from __future__ import annotations

from collections.abc import Sequence

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
    """Every family the simulator exports, registered in vLLM's order."""

    def __init__(
        self,
        max_model_len: int,
        registry: CollectorRegistry | None = None,
        kv_tokens: int | None = None,
        block_size: int = 16,
    ):
        self.registry = registry or CollectorRegistry()
        self._publish_cache_config(kv_tokens, block_size)
        self.running = self._gauge(obs.VLLM_RUNNING, "Number of requests in model execution batches.")
        self.waiting = self._gauge(obs.VLLM_WAITING, "Number of requests waiting to be processed.")
        self.kv_usage = self._gauge(obs.VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = self._counter(obs.VLLM_PROMPT_TOKENS, "Number of prefill tokens processed.")
        self.prompt_by_source = self._counter(
            obs.VLLM_PROMPT_TOKENS_BY_SOURCE, "Number of prompt tokens by source.", "source"
        )
        self.generation_tokens = self._counter(
            obs.VLLM_GENERATION_TOKENS, "Number of generation tokens processed."
        )
        self.prefix_queries = self._counter(
            obs.VLLM_PREFIX_QUERIES, "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = self._counter(
            obs.VLLM_PREFIX_HITS, "Prefix cache hits, in terms of number of cached tokens."
        )
        self.success = self._counter(
            obs.VLLM_REQUEST_SUCCESS, "Count of successfully processed requests.", "finished_reason"
        )
        self.preemptions = self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self._add_latency_histograms()
        self._add_token_histograms(obs.vllm_request_token_buckets(max_model_len))
        self._add_mooncake_connector_metrics()

    def _publish_cache_config(self, kv_tokens: int | None, block_size: int) -> None:
        """vLLM's info gauge of its KV cache: value 1, the facts in labels (the router
        reads block size and hash from it to key store lookups)."""
        Gauge(
            obs.VLLM_CACHE_CONFIG,
            "Information of the LLMEngine CacheConfig",
            ("block_size", "num_gpu_blocks", "prefix_caching_hash_algo"),
            registry=self.registry,
        ).labels(str(block_size), str(kv_tokens // block_size) if kv_tokens else "None", "sha256").set(1)

    def _add_latency_histograms(self) -> None:
        self.ttft = self._histogram(
            obs.VLLM_TTFT, "Histogram of time to first token in seconds.", obs.VLLM_TTFT_BUCKETS
        )
        self.itl = self._histogram(
            obs.VLLM_ITL, "Histogram of inter-token latency in seconds.", obs.VLLM_ITL_BUCKETS
        )
        self.tpot = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            obs.VLLM_ITL_BUCKETS,
        )
        phases = obs.VLLM_REQUEST_LATENCY_BUCKETS
        self.e2e = self._histogram(obs.VLLM_E2E, "Histogram of e2e request latency in seconds.", phases)
        self.queue = self._histogram(
            obs.VLLM_QUEUE_TIME, "Histogram of time spent in WAITING phase for request.", phases
        )
        self.inference = self._histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            phases,
        )
        self.prefill = self._histogram(
            obs.VLLM_PREFILL_TIME, "Histogram of time spent in PREFILL phase for request.", phases
        )
        self.decode = self._histogram(
            obs.VLLM_DECODE_TIME, "Histogram of time spent in DECODE phase for request.", phases
        )

    def _add_token_histograms(self, request_token_buckets: Sequence[float]) -> None:
        self.request_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", request_token_buckets
        )
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", request_token_buckets
        )
        self.request_max_tokens = self._histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            request_token_buckets,
        )
        self.iteration_tokens = self._histogram(
            obs.VLLM_ITERATION_TOKENS,
            "Histogram of number of tokens per engine_step.",
            obs.VLLM_ITERATION_TOKEN_BUCKETS,
        )

    def _add_mooncake_connector_metrics(self) -> None:
        self.xfer_time = self._histogram(
            obs.VLLM_MOONCAKE_XFER_TIME,
            "Histogram of transfer duration for Mooncake KV Cache transfers.",
            obs.VLLM_MOONCAKE_XFER_BUCKETS,
        )
        self.xfer_bytes = self._histogram(
            "vllm:mooncake_bytes_transferred",
            "Histogram of bytes transferred per Mooncake KV Cache transfer.",
            _MOONCAKE_BYTES_BUCKETS,
        )
        self.failed_recvs = self._counter(
            obs.VLLM_MOONCAKE_FAILED_RECVS, "Number of failed Mooncake KV Cache receives."
        )
        self.expired = self._counter(
            "vllm:mooncake_num_kv_expired_reqs", "Number of requests that had their KV expire."
        )

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, obs.VLLM_LABELS, registry=self.registry)

    def _counter(self, name: str, doc: str, *extra_labels: str) -> Counter:
        """`extra_labels` follow vLLM's model and engine labels."""
        return Counter(name, doc, (*obs.VLLM_LABELS, *extra_labels), registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, obs.VLLM_LABELS, buckets=buckets, registry=self.registry)
