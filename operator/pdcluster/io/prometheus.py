"""The autoscaler's Prometheus queries: every PromQL expression of the project lives here.

We call Prometheus's HTTP API (GET /api/v1/query, instant queries) with aiohttp, which
the operator already ships. prometheus-api-client would block the event loop (it is
synchronous) and pulls pandas and matplotlib.

Series are selected by the labels Prometheus attaches at scrape time from pod labels
(pdcluster.observability): `pdcluster` (the cluster's name), `role` and `namespace`.
Latency quantiles are histogram_quantile over rate() of the buckets summed by `le`;
the router's histograms are preferred (user-visible), the engines' are per role.

vLLM's names contain colons. prometheus_client (which vLLM serves its metrics with)
escapes them to underscores when a Prometheus that asks for OpenMetrics without an
escaping scheme scrapes it (prometheus_client 0.26 with Prometheus 2.x), and keeps them
in the text format: every vLLM series is matched under both spellings.

Outcomes: a MetricsSnapshot; None when Prometheus answers but holds no series of the
cluster (nothing scraped yet); PrometheusUnavailable when it cannot be asked (refused,
timed out, an error status). The operator turns the last two into a condition and
passes None to the control law, which then holds.
"""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp

from pdcluster import observability as obs
from pdcluster.control.types import MetricsSnapshot, assemble


class PrometheusUnavailable(Exception):
    """Prometheus could not be asked; the message says why."""


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _series(name: str, labels: str) -> str:
    """A selector of `name` (either spelling of a vLLM name) with `labels`."""
    spellings = sorted({name, name.replace(":", "_")})
    if len(spellings) == 1:
        return f"{name}{{{labels}}}"
    return f'{{__name__=~"{"|".join(spellings)}",{labels}}}'


def queries(namespace: str, cluster: str, window_s: int, quantile: float) -> dict[str, str]:
    """Name -> PromQL for one cluster's snapshot."""
    base = f'{obs.PROM_LABEL_CLUSTER}="{_label_value(cluster)}",namespace="{_label_value(namespace)}"'
    prefill = f'{base},{obs.PROM_LABEL_ROLE}="prefill"'
    decode = f'{base},{obs.PROM_LABEL_ROLE}="decode"'
    w = f"[{window_s}s]"

    def quantile_of(metric: str, labels: str) -> str:
        return f"histogram_quantile({quantile}, sum by (le) (rate({_series(metric + '_bucket', labels)}{w})))"

    def rate(metric: str, labels: str) -> str:
        return f"sum(rate({_series(metric, labels)}{w}))"

    def engines(labels: str) -> str:
        # A subquery needs its own step (its default, the evaluation interval, may exceed the window).
        step = max(window_s // 8, 1)
        return f"avg_over_time(count({_series(obs.VLLM_WAITING, labels)})[{window_s}s:{step}s])"

    queue_time = obs.VLLM_QUEUE_TIME
    return {
        "ttft": quantile_of(obs.ROUTER_TTFT, base),
        "itl": quantile_of(obs.ROUTER_ITL, base),
        "prefill_ttft": quantile_of(obs.VLLM_TTFT, prefill),
        "decode_itl": quantile_of(obs.VLLM_ITL, decode),
        "queue_time_q": quantile_of(queue_time, prefill),
        "queue_time": f"{rate(queue_time + '_sum', prefill)} / {rate(queue_time + '_count', prefill)}",
        "prompt_tokens": rate(obs.ROUTER_PROMPT_TOKENS + "_total", base),
        "prompt_tokens_before": (
            f"sum(rate({_series(obs.ROUTER_PROMPT_TOKENS + '_total', base)}{w} offset {window_s}s))"
        ),
        "finished": rate(obs.ROUTER_REQUESTS + "_total", f'{base},outcome="ok"'),
        "generated_tokens": rate(obs.ROUTER_GENERATION_TOKENS + "_total", base),
        "prefilled_tokens": rate(obs.VLLM_PROMPT_TOKENS + "_total", prefill),
        "prefilled": rate(obs.VLLM_REQUEST_SUCCESS + "_total", prefill),
        "decode_tokens": rate(obs.VLLM_GENERATION_TOKENS + "_total", decode),
        "prefix_queries": rate(obs.VLLM_PREFIX_QUERIES + "_total", prefill),
        "prefix_hits": rate(obs.VLLM_PREFIX_HITS + "_total", prefill),
        "prefill_queue": f"sum(avg_over_time({_series(obs.VLLM_WAITING, prefill)}{w}))",
        "kv_usage": f"avg(avg_over_time({_series(obs.VLLM_KV_USAGE, decode)}{w}))",
        "prefill_ready": engines(prefill),
        "decode_ready": engines(decode),
        # Does Prometheus hold anything of this cluster at all?
        "series": f"count({_series(obs.ROUTER_PROMPT_TOKENS + '_total', base)}) or "
        f"count({_series(obs.VLLM_WAITING, base)})",
    }


class Prometheus:
    """A small client of one Prometheus server."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession, timeout_s: float = 5.0) -> None:
        self.url = base_url.rstrip("/") + "/api/v1/query"
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def query(self, promql: str, at: float | None = None) -> float | None:
        """The value of an expression that yields at most one series, evaluated at `at`
        (Unix seconds; Prometheus' now when None); None when empty or NaN."""
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        try:
            async with self.session.get(self.url, params=params, timeout=self.timeout) as resp:
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise PrometheusUnavailable(f"{self.url}: {type(e).__name__}: {e}") from e
        if not isinstance(body, dict) or body.get("status") != "success":
            detail = body.get("error", body) if isinstance(body, dict) else body
            raise PrometheusUnavailable(f"{self.url}: query failed: {detail}")
        data = body["data"]
        if data["resultType"] == "scalar":
            sample = data["result"]
        elif data["result"]:
            sample = data["result"][0]["value"]
        else:
            return None
        value = float(sample[1])
        return value if math.isfinite(value) else None

    async def router_p99_ms(
        self, namespace: str, cluster: str, window_s: int
    ) -> tuple[int | None, int | None]:
        """The router's TTFT and ITL p99 in ms, for `kubectl get pdc`."""
        q = queries(namespace, cluster, window_s, 0.99)
        at = time.time()
        ttft, itl = await asyncio.gather(self.query(q["ttft"], at), self.query(q["itl"], at))
        return (None if ttft is None else round(ttft * 1000), None if itl is None else round(itl * 1000))

    async def snapshot(
        self, namespace: str, cluster: str, window_s: int, quantile: float
    ) -> MetricsSnapshot | None:
        names, exprs = zip(*queries(namespace, cluster, window_s, quantile).items(), strict=True)
        # One instant for every query: evaluated as each request arrives, a scrape between
        # two of them gives their rates different windows, and ratios of them (the mean
        # prompt) drift by tenths of a percent.
        at = time.time()
        values = dict(zip(names, await asyncio.gather(*(self.query(e, at) for e in exprs)), strict=True))
        if not values["series"]:
            return None

        def ms(name: str) -> float | None:
            v = values[name]
            return None if v is None else v * 1000.0

        return assemble(
            window_s=window_s,
            prompt_tokens_rate=values["prompt_tokens"] or 0.0,
            prompt_tokens_rate_before=values["prompt_tokens_before"],
            prefilled_tokens_rate=values["prefilled_tokens"] or 0.0,
            prefilled_rate=values["prefilled"] or 0.0,
            finished_rate=values["finished"] or 0.0,
            generated_tokens_rate=values["generated_tokens"] or 0.0,
            ttft_ms=ms("ttft"),
            itl_ms=ms("itl"),
            prefill_ttft_ms=ms("prefill_ttft"),
            decode_itl_ms=ms("decode_itl"),
            queue_time_ms=ms("queue_time"),
            queue_time_q_ms=ms("queue_time_q"),
            prefill_queue=values["prefill_queue"],
            decode_kv_usage=values["kv_usage"],
            prefix_queries_rate=values["prefix_queries"] or 0.0,
            prefix_hits_rate=values["prefix_hits"] or 0.0,
            decode_tokens_rate=values["decode_tokens"],
            prefill_ready=values["prefill_ready"],
            decode_ready=values["decode_ready"],
        )
