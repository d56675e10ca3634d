"""The autoscaler's Prometheus queries, and the live view's (pdcluster.series.WATCHED):
every PromQL expression of the project lives here.

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

Secured servers: `Credentials` carries the request headers (Authorization for a bearer
token or basic auth, a tenant's X-Scope-OrgID) and the CA bundle to verify https with;
io/prometheus_auth.py builds them from the operator's flags or a spec's Secrets.

Outcomes: a MetricsSnapshot; None when Prometheus answers but holds no series of the
cluster (nothing scraped yet); PrometheusUnavailable when it cannot be asked (refused,
timed out, an error status). The operator turns the last two into a condition and
passes None to the control law, which then holds.
"""

from __future__ import annotations

import asyncio
import base64
import math
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from pdcluster import observability as obs
from pdcluster.control.types import MetricsSnapshot, assemble
from pdcluster.series import BY_FIELD, PRESENCE, SERIES, WATCHED, Kind, Series

PRESENT = "present"  # the query that tells an unknown cluster from one without traffic


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


def _promql(s: Series, labels: str, window_s: int, quantile: float) -> str:
    w = f"[{window_s}s]"
    if s.kind == Kind.rate:
        return f"sum(rate({_series(s.metric + '_total', labels)}{w}))"
    if s.kind == Kind.rate_before:
        return f"sum(rate({_series(s.metric + '_total', labels)}{w} offset {window_s}s))"
    if s.kind == Kind.quantile:
        return (
            f"histogram_quantile({quantile}, sum by (le) (rate({_series(s.metric + '_bucket', labels)}{w})))"
        )
    if s.kind == Kind.mean:
        total, count = _series(s.metric + "_sum", labels), _series(s.metric + "_count", labels)
        return f"sum(rate({total}{w})) / sum(rate({count}{w}))"
    if s.kind == Kind.count_rate:
        return f"sum(rate({_series(s.metric + '_count', labels)}{w}))"
    if s.kind == Kind.buckets:
        return f"sum by (le) (rate({_series(s.metric + '_bucket', labels)}{w}))"
    if s.kind == Kind.gauge_sum:
        return f"sum(avg_over_time({_series(s.metric, labels)}{w}))"
    if s.kind == Kind.gauge_avg:
        return f"avg(avg_over_time({_series(s.metric, labels)}{w}))"
    # engines: a subquery needs its own step (its default, the evaluation interval, may exceed the window)
    step = max(window_s // 8, 1)
    return f"avg_over_time(count({_series(s.metric, labels)})[{window_s}s:{step}s])"


def _cluster_labels(namespace: str, cluster: str) -> str:
    return f'{obs.PROM_LABEL_CLUSTER}="{_label_value(cluster)}",namespace="{_label_value(namespace)}"'


def _labels(s: Series, cluster_labels: str) -> str:
    labels = cluster_labels
    if s.role:
        labels += f',{obs.PROM_LABEL_ROLE}="{s.role}"'
    if s.outcome:
        labels += f',outcome="{s.outcome}"'
    return labels


def queries(namespace: str, cluster: str, window_s: int, quantile: float) -> dict[str, str]:
    """Field of the snapshot (pdcluster.series) -> PromQL, for one cluster."""
    base = _cluster_labels(namespace, cluster)
    out = {s.field: _promql(s, _labels(s, base), window_s, quantile) for s in SERIES}
    out[PRESENT] = " or ".join(f"count({_series(m, base)})" for m in PRESENCE)
    return out


def watched_queries(namespace: str, cluster: str, window_s: int, quantile: float) -> dict[str, str]:
    """Field of pdcluster.series.WATCHED -> PromQL, for one cluster."""
    base = _cluster_labels(namespace, cluster)
    return {s.field: _promql(s, _labels(s, base), window_s, quantile) for s in WATCHED}


def _in_unit(s: Series, value: float | None) -> float | None:
    """Latency fields are in ms; their series in seconds."""
    return value * 1000.0 if value is not None and s.in_ms else value


def _buckets(result: list[dict]) -> tuple[tuple[float, float], ...]:
    """Cumulative `le` series -> (upper bound, rate in that bucket alone), ascending."""
    cumulative = sorted(
        (float(r["metric"]["le"]), float(r["value"][1])) for r in result if "le" in r["metric"]
    )
    out, below = [], 0.0
    for upper, value in cumulative:
        value = value if math.isfinite(value) else below
        out.append((upper, max(value - below, 0.0)))
        below = max(value, below)
    return tuple(out)


@dataclass(frozen=True)
class Credentials:
    """What a request to a secured Prometheus carries: headers and the CAs to trust."""

    headers: Mapping[str, str] = field(default_factory=dict)
    tls: ssl.SSLContext | None = None  # None: the system's CAs


NO_CREDENTIALS = Credentials()


def credentials(
    *,
    bearer_token: str | None = None,
    basic_auth: tuple[str, str] | None = None,
    ca_pem: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Credentials:
    """Credentials from their parts; a bearer token and basic auth exclude each other.
    ValueError says what is wrong with them."""
    if bearer_token is not None and basic_auth is not None:
        raise ValueError("a bearer token and basic auth exclude each other")
    out = dict(headers or {})
    if bearer_token is not None:
        out["Authorization"] = f"Bearer {bearer_token.strip()}"
    if basic_auth is not None:
        user, password = basic_auth
        out["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    context = None
    if ca_pem is not None:
        try:
            context = ssl.create_default_context(cadata=ca_pem)
        except (ssl.SSLError, ValueError) as e:
            raise ValueError(f"the CA bundle holds no PEM certificate that can be loaded ({e})") from None
    return Credentials(headers=out, tls=context)


_REFUSED = {
    401: "Prometheus wants credentials (401 Unauthorized): set a bearer token or basic auth",
    403: "Prometheus refused these credentials (403 Forbidden)",
}


class Prometheus:
    """A small client of one Prometheus server."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        timeout_s: float = 5.0,
        creds: Credentials = NO_CREDENTIALS,
    ) -> None:
        self.url = base_url.rstrip("/") + "/api/v1/query"
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.headers = dict(creds.headers)
        self.ssl: ssl.SSLContext | bool = creds.tls or True

    async def _ask(self, promql: str, at: float | None) -> dict:
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        try:
            async with self.session.get(
                self.url, params=params, timeout=self.timeout, headers=self.headers, ssl=self.ssl
            ) as resp:
                if resp.status in _REFUSED:
                    raise PrometheusUnavailable(f"{self.url}: {_REFUSED[resp.status]}")
                body = await resp.json(content_type=None)
        except aiohttp.ClientConnectorCertificateError as e:
            raise PrometheusUnavailable(
                f"{self.url}: its certificate is not trusted ({e.certificate_error}): set a CA bundle"
            ) from e
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise PrometheusUnavailable(f"{self.url}: {type(e).__name__}: {e}") from e
        if not isinstance(body, dict) or body.get("status") != "success":
            detail = body.get("error", body) if isinstance(body, dict) else body
            raise PrometheusUnavailable(f"{self.url}: query failed: {detail}")
        return body["data"]

    async def query(self, promql: str, at: float | None = None) -> float | None:
        """The value of an expression that yields at most one series, evaluated at `at`
        (Unix seconds; Prometheus' now when None); None when empty or NaN."""
        data = await self._ask(promql, at)
        if data["resultType"] == "scalar":
            sample = data["result"]
        elif data["result"]:
            sample = data["result"][0]["value"]
        else:
            return None
        value = float(sample[1])
        return value if math.isfinite(value) else None

    async def query_buckets(self, promql: str, at: float | None = None) -> tuple[tuple[float, float], ...]:
        """A `sum by (le)` expression as (upper bound, rate in that bucket alone)."""
        data = await self._ask(promql, at)
        return _buckets(data["result"]) if data["resultType"] == "vector" else ()

    async def router_p99_ms(
        self, namespace: str, cluster: str, window_s: int
    ) -> tuple[int | None, int | None]:
        """The router's TTFT and ITL p99 in ms, for `kubectl get pdc`."""
        q = queries(namespace, cluster, window_s, 0.99)
        at = time.time()
        ttft, itl = await asyncio.gather(self.query(q["ttft_ms"], at), self.query(q["itl_ms"], at))
        return (None if ttft is None else round(ttft * 1000), None if itl is None else round(itl * 1000))

    async def snapshot(
        self, namespace: str, cluster: str, window_s: int, quantile: float, at: float | None = None
    ) -> MetricsSnapshot | None:
        """The window ending at `at` (Unix seconds, now when None)."""
        exprs = queries(namespace, cluster, window_s, quantile)
        # One instant for every query: evaluated as each request arrives, a scrape between
        # two of them gives their rates different windows, and ratios of them (the mean
        # prompt) drift by tenths of a percent.
        at = time.time() if at is None else at

        async def value(name: str):
            if name in BY_FIELD and BY_FIELD[name].kind == Kind.buckets:
                return await self.query_buckets(exprs[name], at)
            v = await self.query(exprs[name], at)
            return _in_unit(BY_FIELD[name], v) if name in BY_FIELD else v

        values = dict(zip(exprs, await asyncio.gather(*(value(n) for n in exprs)), strict=True))
        if not values.pop(PRESENT):
            return None
        return assemble(window_s=window_s, **values)

    async def watched(
        self, namespace: str, cluster: str, window_s: int, quantile: float
    ) -> dict[str, float | None]:
        """The fields of pdcluster.series.WATCHED (latencies in ms), evaluated at one instant."""
        exprs = watched_queries(namespace, cluster, window_s, quantile)
        at = time.time()
        values = await asyncio.gather(*(self.query(e, at) for e in exprs.values()))
        return {s.field: _in_unit(s, v) for s, v in zip(WATCHED, values, strict=True)}
