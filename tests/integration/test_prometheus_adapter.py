"""The Prometheus adapter against a real Prometheus (Debian's binary) on loopback.

Three exporters (prometheus_client, as vLLM and the router use) stand in for the router
and one engine of each role; prometheus_client spells vLLM's colons as underscores for
this Prometheus (OpenMetrics negotiation), so the adapter must find either. Prometheus scrapes
them every second and attaches `pdcluster`, `namespace` and `role` as target labels,
as the cluster's scrape config does from pod labels. Each burst of traffic is written
under the exporters' lock, which their scrapes also take, so every scrape sees all of a
burst or none of it and ratios of counters are exact. The expected quantiles come from
the fleet simulator's histogram_quantile on the same buckets, so this also checks that
the simulator evaluates PromQL the way Prometheus does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import loopback
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pdcluster import observability as obs
from pdcluster.io.prometheus import Prometheus, PrometheusUnavailable
from pdcluster.observability import VLLM_PREFIX_HITS, VLLM_PREFIX_QUERIES
from pdcluster.sim.scrapes import histogram_quantile

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(loopback.PROMETHEUS).exists(), reason="Debian's prometheus is not installed"),
]

WINDOW_S = 15
WaitUntil = Callable[..., Awaitable[Any]]


class Locked:
    """A registry's collector that reads it under `lock`."""

    def __init__(self, registry: CollectorRegistry, lock: threading.Lock) -> None:
        self.registry, self.lock = registry, lock

    def collect(self) -> list[Any]:
        with self.lock:
            return list(self.registry.collect())


class Exporters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.router, self.prefill, self.decode = CollectorRegistry(), CollectorRegistry(), CollectorRegistry()
        r, p, d = self.router, self.prefill, self.decode
        self.ttft = Histogram(obs.ROUTER_TTFT, "", buckets=obs.ROUTER_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(obs.ROUTER_ITL, "", buckets=obs.ROUTER_ITL_BUCKETS, registry=r)
        self.requests = Counter(obs.ROUTER_REQUESTS, "", ("outcome",), registry=r)
        self.requests.labels("ok")  # a counter's child exists from the start, as in the router
        self.prompt_tokens = Counter(obs.ROUTER_PROMPT_TOKENS, "", registry=r)
        self.generation_tokens = Counter(obs.ROUTER_GENERATION_TOKENS, "", registry=r)
        self.prefill_ttft = Histogram(obs.VLLM_TTFT, "", buckets=obs.VLLM_TTFT_BUCKETS, registry=p)
        self.queue_time = Histogram(
            obs.VLLM_QUEUE_TIME, "", buckets=obs.VLLM_REQUEST_LATENCY_BUCKETS, registry=p
        )
        self.waiting = Gauge(obs.VLLM_WAITING, "", registry=p)
        self.prefilled_tokens = Counter(obs.VLLM_PROMPT_TOKENS, "", registry=p)
        self.prefilled = Counter(obs.VLLM_REQUEST_SUCCESS, "", registry=p)
        self.prefix_queries = Counter(VLLM_PREFIX_QUERIES, "", registry=p)
        self.prefix_hits = Counter(VLLM_PREFIX_HITS, "", registry=p)
        self.decode_itl = Histogram(obs.VLLM_ITL, "", buckets=obs.VLLM_ITL_BUCKETS, registry=d)
        self.kv_usage = Gauge(obs.VLLM_KV_USAGE, "", registry=d)
        Gauge(obs.VLLM_WAITING, "", registry=d)
        self.generated = Counter(obs.VLLM_GENERATION_TOKENS, "", registry=d)
        self.waiting.set(4)  # gauges are constant for the whole test
        self.kv_usage.set(0.42)
        self.servers = []
        self.ports = {}
        for role, registry in (("router", r), ("prefill", p), ("decode", d)):
            port = loopback.free_port()
            served = CollectorRegistry()
            served.register(Locked(registry, self.lock))
            self.servers.append(start_http_server(port, addr="127.0.0.1", registry=served))
            self.ports[role] = port

    def close(self) -> None:
        for server, _ in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def exporters() -> Iterator[Exporters]:
    ex = Exporters()
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def prometheus(exporters: Exporters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("prometheus")
    jobs = "".join(
        f"""
  - job_name: {role}
    static_configs:
      - targets: ["127.0.0.1:{port}"]
        labels: {{{obs.PROM_LABEL_CLUSTER}: demo, namespace: team-a, {obs.PROM_LABEL_ROLE}: {role}}}
"""
        for role, port in exporters.ports.items()
    )
    with loopback.prometheus(root, f"global:\n  scrape_interval: 1s\nscrape_configs:{jobs}") as url:
        yield url


UP = 'up{pdcluster="demo"}'


async def value(url: str, promql: str) -> float | None:
    """What Prometheus answers now; None while it is starting or has no answer."""
    async with aiohttp.ClientSession() as session:
        try:
            return await Prometheus(url, session, timeout_s=1.0).query(promql)
        except PrometheusUnavailable:
            return None


def at_least(url: str, promql: str, want: float) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        answer = await value(url, promql)
        return answer is not None and answer >= want

    return check


async def every_target_up(url: str, wait_until: WaitUntil) -> None:
    await wait_until(at_least(url, f"count({UP} == 1)", 3), interval=0.25, message="every target up")


def bucket_counts(bounds: tuple[float, ...], values: list[float]) -> list[int]:
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(bounds) if v <= b), len(bounds))] += 1
    return counts


def traffic(
    exporters: Exporters,
    ttfts: list[float],
    itls: list[float],
    prefill_ttfts: list[float],
    queue: list[float],
) -> None:
    """200 requests' worth of every series."""
    for v in ttfts:
        exporters.ttft.observe(v)
    for v in itls:
        exporters.itl.observe(v)
        exporters.decode_itl.observe(v)
    for v in prefill_ttfts:
        exporters.prefill_ttft.observe(v)
    for v in queue:
        exporters.queue_time.observe(v)
    exporters.requests.labels("ok").inc(200)
    exporters.prompt_tokens.inc(200 * 3000)
    exporters.generation_tokens.inc(200 * 150)
    exporters.prefilled.inc(200)
    exporters.prefilled_tokens.inc(200 * 3000)
    exporters.prefix_queries.inc(200 * 3000)
    exporters.prefix_hits.inc(200 * 750)
    exporters.generated.inc(200 * 150)


async def test_snapshot_matches_what_was_exported(
    exporters: Exporters, prometheus: str, wait_until: WaitUntil
) -> None:
    await every_target_up(prometheus, wait_until)
    # Two scrapes of every target before the traffic: every series has a zero to start from.
    await wait_until(
        at_least(prometheus, f"min(count_over_time({UP}[1h]))", 2), interval=0.25, message="two scrapes"
    )
    ttfts = [0.05 * (i % 20) + 0.01 for i in range(200)]
    itls = [0.004 + 0.0003 * (i % 50) for i in range(2000)]
    prefill_ttfts = [0.03 * (i % 10) + 0.02 for i in range(200)]
    queue = [0.001 * i for i in range(200)]
    with exporters.lock:
        traffic(exporters, ttfts, itls, prefill_ttfts, queue)
        # The snapshot is of a window that ends a few scrapes after the traffic, whenever
        # it is asked for: its rates do not depend on how long this test takes.
        at = time.time() + 2.5
    await wait_until(
        at_least(prometheus, f"min(timestamp({UP}))", at),
        interval=0.25,
        message="every target scraped after the window's end",
    )

    async with aiohttp.ClientSession() as session:
        snap = await Prometheus(prometheus, session).snapshot("team-a", "demo", WINDOW_S, 0.9, at=at)

    assert snap is not None
    expected_ttft = histogram_quantile(
        0.9, obs.ROUTER_TTFT_BUCKETS, bucket_counts(obs.ROUTER_TTFT_BUCKETS, ttfts)
    )
    assert snap.ttft_ms == pytest.approx(expected_ttft * 1000)
    expected_itl = histogram_quantile(
        0.9, obs.ROUTER_ITL_BUCKETS, bucket_counts(obs.ROUTER_ITL_BUCKETS, itls)
    )
    assert snap.itl_ms == pytest.approx(expected_itl * 1000)
    expected_decode = histogram_quantile(0.9, obs.VLLM_ITL_BUCKETS, bucket_counts(obs.VLLM_ITL_BUCKETS, itls))
    assert snap.decode.itl_ms == pytest.approx(expected_decode * 1000)
    expected_prefill = histogram_quantile(
        0.9, obs.VLLM_TTFT_BUCKETS, bucket_counts(obs.VLLM_TTFT_BUCKETS, prefill_ttfts)
    )
    assert snap.prefill.ttft_ms == pytest.approx(expected_prefill * 1000)
    assert snap.prefill.queue_time_ms == pytest.approx(sum(queue) / len(queue) * 1000)
    # Ratios of counters of one target: rate() extrapolates both alike (up to rounding).
    assert snap.mean_input_tokens == pytest.approx(3000, rel=1e-3)
    assert snap.mean_output_tokens == pytest.approx(150, rel=1e-3)
    assert snap.prefix_hit_ratio == pytest.approx(0.25, rel=1e-3)
    assert snap.decode_kv_usage == pytest.approx(0.42)
    assert snap.prefill_queue == pytest.approx(4)
    assert snap.prefill.ready == pytest.approx(1.0)
    assert snap.decode.ready == pytest.approx(1.0)
    # A rate: rate() spreads the 200 requests over at most the window and at least one
    # scrape interval (1 s).
    assert 200 / WINDOW_S <= snap.request_rate <= 200 / 1.0
    assert snap.prefill.tokens_per_s == pytest.approx(snap.request_rate * 3000, rel=0.35)


async def test_a_cluster_prometheus_has_never_seen_is_none(
    prometheus: str, exporters: Exporters, wait_until: WaitUntil
) -> None:
    await every_target_up(prometheus, wait_until)
    async with aiohttp.ClientSession() as session:
        assert await Prometheus(prometheus, session).snapshot("team-a", "other", WINDOW_S, 0.9) is None
        assert await Prometheus(prometheus, session).snapshot("team-b", "demo", WINDOW_S, 0.9) is None


async def test_an_unreachable_prometheus_is_unavailable() -> None:
    async with aiohttp.ClientSession() as session:
        client = Prometheus(f"http://127.0.0.1:{loopback.free_port()}", session, timeout_s=1.0)
        with pytest.raises(PrometheusUnavailable, match=r"127\.0\.0\.1"):
            await client.snapshot("team-a", "demo", WINDOW_S, 0.9)


async def test_an_error_answer_is_unavailable(prometheus: str, wait_until: WaitUntil) -> None:
    await wait_until(at_least(prometheus, "vector(1)", 1), interval=0.25, message="Prometheus answers")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(PrometheusUnavailable, match="query failed"):
            await Prometheus(prometheus, session).query("sum(rate(")
        assert await Prometheus(prometheus, session).query("0/0") is None
