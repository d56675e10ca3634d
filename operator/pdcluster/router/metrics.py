"""The router's Prometheus metrics (names and buckets from pdcluster.observability).

Request-path metrics are plain prometheus-client objects. Per-backend load gauges and
backend counts are read from the router's own state at scrape time instead of being
updated on every request.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pdcluster import __version__
from pdcluster import observability as obs

if TYPE_CHECKING:
    from pdcluster.router.membership import Upstream

REJECTION_REASONS = ("slo", "no_backend", "unauthorized")


class _LoadCollector(Collector):
    def __init__(self, snapshot: Callable[[], tuple[Iterable[Upstream], dict[str, int]]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        upstreams, ready = self._snapshot()
        requests = GaugeMetricFamily(
            obs.ROUTER_INFLIGHT, "Requests the router has in flight.", labels=("role", "backend")
        )
        tokens = GaugeMetricFamily(
            obs.ROUTER_INFLIGHT_TOKENS,
            "Tokens in flight: prompt tokens not yet prefilled (prefill, engine), KV tokens held (decode).",
            labels=("role", "backend"),
        )
        for u in upstreams:
            requests.add_metric((u.role, u.id), u.inflight_requests)
            tokens.add_metric((u.role, u.id), u.inflight_tokens)
        backends = GaugeMetricFamily(obs.ROUTER_BACKENDS, "Ready backends.", labels=("role",))
        for role, count in ready.items():
            backends.add_metric((role,), count)
        yield from (requests, tokens, backends)


class _HistogramCollector(Collector):
    def __init__(self, name: str, documentation: str, histogram: obs.Histogram):
        self._name, self._documentation, self._histogram = name, documentation, histogram

    def collect(self) -> Iterator[HistogramMetricFamily]:
        h = self._histogram
        cumulative = list(itertools.accumulate(h.counts))
        buckets = [(floatToGoString(b), n) for b, n in zip(h.bounds, cumulative, strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        yield HistogramMetricFamily(self._name, self._documentation, buckets=buckets, sum_value=h.sum)


class RouterMetrics:
    def __init__(self, snapshot: Callable[[], tuple[Iterable[Upstream], dict[str, int]]]):
        self.registry = r = CollectorRegistry()
        Gauge(obs.BUILD_INFO, "The running build: always 1", ("version", "component"), registry=r).labels(
            __version__, "router"
        ).set(1)
        self._add_latencies(r)
        self._add_outcomes(r)
        self._add_store(r)
        self._add_kv(r)
        r.register(_LoadCollector(snapshot))

    def forget(self, backend_id: str) -> None:
        """A backend left: its series go with it."""
        for role in ("prefill", "decode", "colocated"):
            with contextlib.suppress(KeyError):
                self.upstream_errors.remove(role, backend_id)

    def _add_latencies(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            obs.ROUTER_TTFT,
            "Time to first token seen by clients (streamed requests).",
            buckets=obs.ROUTER_TTFT_BUCKETS,
            registry=r,
        )
        # Observed once per token: plain arithmetic, read at scrape time.
        self.itl = obs.Histogram(obs.ROUTER_ITL_BUCKETS)
        r.register(
            _HistogramCollector(obs.ROUTER_ITL, "Time between streamed tokens seen by clients.", self.itl)
        )
        self.tpot = Histogram(
            obs.ROUTER_TPOT,
            "A streamed request's mean time per output token after the first, observed when it ends.",
            buckets=obs.ROUTER_ITL_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            obs.ROUTER_PREFILL,
            "Time from a streamed request's arrival to its prefill's answer.",
            buckets=obs.ROUTER_TTFT_BUCKETS,
            registry=r,
        )
        self.after_prefill = Histogram(
            obs.ROUTER_AFTER_PREFILL,
            "Time from a streamed request's prefill answer to its first token (KV hand-off, decode wait).",
            buckets=obs.ROUTER_TTFT_BUCKETS,
            registry=r,
        )
        self.ttft_beyond_prefill = Histogram(
            obs.ROUTER_TTFT_BEYOND_PREFILL,
            "TTFT beyond prefill: a streamed request's time to first token less its prompt's own prefill "
            "compute, as its prefill engine reports it (vLLM --enable-per-request-metrics).",
            buckets=obs.ROUTER_TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            obs.ROUTER_E2E, "Request latency seen by clients.", buckets=obs.ROUTER_E2E_BUCKETS, registry=r
        )

    def _add_outcomes(self, r: CollectorRegistry) -> None:
        requests = Counter(obs.ROUTER_REQUESTS, "Requests by outcome.", ("outcome",), registry=r)
        self.requests = {outcome: requests.labels(outcome) for outcome in obs.ROUTER_OUTCOMES}
        rejections = Counter(
            obs.ROUTER_REJECTIONS, "Requests refused before dispatch, by reason.", ("reason",), registry=r
        )
        self.rejections = {reason: rejections.labels(reason) for reason in REJECTION_REASONS}
        self.upstream_errors = Counter(
            obs.ROUTER_UPSTREAM_ERRORS, "Failed upstream requests.", ("role", "backend"), registry=r
        )
        self.prompt_tokens = Counter(
            obs.ROUTER_PROMPT_TOKENS, "Prompt tokens routed (approximate).", registry=r
        )
        self.local_prefills = Counter(
            obs.ROUTER_LOCAL_PREFILLS,
            "Requests whose prompt was short enough for its decode engine to prefill (no KV hand-off).",
            registry=r,
        )
        self.generation_tokens = Counter(
            obs.ROUTER_GENERATION_TOKENS, "Tokens generated for clients.", registry=r
        )
        retries = Counter(
            obs.ROUTER_RETRIES, "Attempts made after an attempt failed, by the role that failed.", ("role",),
            registry=r,
        )  # fmt: skip
        self.retries = {role: retries.labels(role) for role in ("prefill", "decode", "colocated")}
        resumed = Counter(
            obs.ROUTER_RESUMED_STREAMS, "Streams whose decode engine died mid-answer: resumed on another "
            "engine, or not resumable (ended with an error event).", ("outcome",), registry=r,
        )  # fmt: skip
        self.resumed = {outcome: resumed.labels(outcome) for outcome in obs.ROUTER_RESUME_OUTCOMES}
        cut = Counter(
            obs.ROUTER_CONNECTIONS_CUT, "Client connections the router cut: a head or body not received in "
            "time, a body over the limit, past the connection limit.", ("reason",), registry=r,
        )  # fmt: skip
        self.connections_cut = {reason: cut.labels(reason) for reason in obs.ROUTER_CONNECTION_CUT_REASONS}
        self.circuit_opens = Counter(
            obs.ROUTER_CIRCUIT_OPENS, "Times an engine was taken out of rotation after failing in a row.",
            ("role", "backend"), registry=r,
        )  # fmt: skip
        dropped = Counter(
            obs.ROUTER_TRACE_SPANS_DROPPED, "Spans the trace export dropped, by reason: queue_full, refused "
            "(a final error from the collector), unreachable (not taken within the export timeout).",
            ("reason",), registry=r,
        )  # fmt: skip
        self.trace_spans_dropped = {reason: dropped.labels(reason) for reason in obs.ROUTER_TRACE_DROP_REASONS}

    def _add_store(self, r: CollectorRegistry) -> None:
        lookups = Counter(
            obs.ROUTER_STORE_LOOKUPS, "Prompt-hit lookups in the Mooncake store, by outcome.", ("outcome",),
            registry=r,
        )  # fmt: skip
        self.store_lookups = {outcome: lookups.labels(outcome) for outcome in obs.ROUTER_STORE_OUTCOMES}
        self.store_lookup_time = Histogram(
            obs.ROUTER_STORE_LOOKUP_SECONDS,
            "Time a store lookup added to a request (tokenize and key query).",
            buckets=obs.ROUTER_STORE_LOOKUP_BUCKETS,
            registry=r,
        )
        self.prefill_bypassed = Counter(
            obs.ROUTER_PREFILL_BYPASSED,
            "Requests sent straight to decode: their prefix was stored.",
            registry=r,
        )
        self.store_prefix_tokens = Counter(
            obs.ROUTER_STORE_PREFIX_TOKENS, "Prompt tokens decode loaded from the store instead of prefill.",
            registry=r,
        )  # fmt: skip

    def _add_kv(self, r: CollectorRegistry) -> None:
        probes = Counter(
            obs.ROUTER_KV_PROBES, "KV hand-off probes through prefill -> decode pairs, by outcome.", ("outcome",),
            registry=r,
        )  # fmt: skip
        self.kv_probes = {outcome: probes.labels(outcome) for outcome in ("passed", "failed")}
        self.kv_pairs = Gauge(
            obs.ROUTER_KV_PAIRS, "Prefill -> decode pairs by probe verdict (failed ones take no traffic).",
            ("verdict",), registry=r,
        )  # fmt: skip
        self.kv_event_batches = Counter(
            obs.ROUTER_KV_EVENT_BATCHES,
            "KV event batches received from engines (precise-prefix).",
            registry=r,
        )
        losses = Counter(
            obs.ROUTER_KV_EVENT_LOSSES, "Times an engine's KV events could no longer be trusted, by reason; "
            "its cache counts as unknown until its next batch.", ("reason",), registry=r,
        )  # fmt: skip
        self.kv_event_losses = {reason: losses.labels(reason) for reason in obs.ROUTER_KV_EVENT_LOSS_REASONS}
        exact = Counter(
            obs.ROUTER_EXACT_BLOCKS, "Prompts hashed as the engines hash them (precise-prefix), by outcome.",
            ("outcome",), registry=r,
        )  # fmt: skip
        self.exact_blocks = {outcome: exact.labels(outcome) for outcome in obs.ROUTER_EXACT_OUTCOMES}
        cached = Counter(
            obs.ROUTER_CACHED_PROMPT_TOKENS, "Prompt tokens the picked engine holds in its prefix cache, as its "
            "KV events say (events) or as the router guesses from its own dispatches (guess).", ("source",),
            registry=r,
        )  # fmt: skip
        self.cached_prompt_tokens = {source: cached.labels(source) for source in obs.ROUTER_CACHE_SOURCES}
