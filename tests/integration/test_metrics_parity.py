"""One metrics contract: the operator's PromQL on a real Prometheus and the fleet
simulator's evaluator give the same snapshot from the same exported samples.

Every series of pdcluster.series is exported by pods of the router and of both roles
(some in vLLM's colon spelling, some in the underscore one), plus decoys that the
queries must leave out: another cluster's engine, decode's own TTFT, the router's
rejected requests. The samples go to Prometheus through `promtool tsdb
create-blocks-from openmetrics` (with their timestamps, no scraping), and the same
samples, summed per role as the simulator's scrapes hold them, to
pdcluster.sim.scrapes.snapshot. Both snapshots are compared field by field at
instants between two samples (so that a window's ends are not a matter of inclusion),
with full windows and with windows that begin before the first sample (where
Prometheus extrapolates rates only by half a scrape interval).
"""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from loopback import prometheus

from pdcluster import observability as obs
from pdcluster.control.types import MetricsSnapshot
from pdcluster.io.prometheus import Prometheus
from pdcluster.series import SERIES, Kind
from pdcluster.sim import scrapes as M

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="Debian's prometheus is not installed"),
]

STEP_S, SAMPLES, WINDOW_S = 5, 100, 120
BOUNDS = M.histogram_bounds()
# pod -> (cluster, role); None: the router
PODS = {
    "router-0": ("demo", None),
    "prefill-0": ("demo", "prefill"),
    "prefill-1": ("demo", "prefill"),
    "decode-0": ("demo", "decode"),
    "decode-1": ("demo", "decode"),
    "decode-2": ("demo", "decode"),
    "colocated-0": ("demo", "colocated"),
    "colocated-1": ("demo", "colocated"),
    "other-prefill-0": ("other", "prefill"),
}


@dataclasses.dataclass
class Family:
    """One metric of one pod over time: cumulative values (counter), bucket counts
    (not cumulative), sum and count (histogram), or values (gauge)."""

    kind: str
    values: list = dataclasses.field(default_factory=list)


def exported(rng: random.Random) -> dict[tuple[str, str, str], Family]:
    """(pod, metric, outcome) -> its samples, for every series the contract reads."""
    out: dict[tuple[str, str, str], Family] = {}
    for pod, (_, role) in PODS.items():
        metrics = {s.metric: s for s in SERIES if s.role == role}
        if role == "decode":  # decode engines also report a TTFT, which prefill's must not include
            metrics[obs.VLLM_TTFT] = next(s for s in SERIES if s.metric == obs.VLLM_TTFT)
        for metric, s in metrics.items():
            outcomes = ("ok", "rejected") if s.outcome else ("",)
            for outcome in outcomes:
                kind = "counter" if s.counter else "histogram" if s.histogram else "gauge"
                fam = out[(pod, metric, outcome)] = Family(kind)
                bounds = M.BUCKETS[metric] if kind == "histogram" else ()
                # Start well above zero so that Prometheus extrapolates every series to
                # the window's ends alike (it stops a counter's extrapolation at zero).
                value = rng.uniform(1e4, 2e4)
                counts = [rng.randint(50, 100) for _ in range(len(bounds) + 1)] if bounds else []
                total = sum(n * 0.7 * bounds[min(i, len(bounds) - 1)] for i, n in enumerate(counts))
                for _ in range(SAMPLES):
                    if kind == "counter":
                        value += rng.randint(0, 400) * rng.choice((1, 1, 7))
                        fam.values.append(value)
                    elif kind == "histogram":
                        for _ in range(rng.randint(0, 30)):
                            i = min(int(rng.expovariate(0.25)), len(bounds))
                            counts[i] += 1
                            low = bounds[i - 1] if i else 0.0
                            total += rng.uniform(low, bounds[i] if i < len(bounds) else 2 * low)
                        fam.values.append((tuple(counts), total, sum(counts)))
                    else:
                        fam.values.append(
                            rng.uniform(0.0, 1.0) if metric == obs.VLLM_KV_USAGE else rng.randint(0, 40)
                        )
    return out


def openmetrics(data: dict[tuple[str, str, str], Family], t0: int) -> str:
    lines: dict[str, list[str]] = {}
    for (pod, metric, outcome), fam in data.items():
        cluster, role = PODS[pod]
        name = metric.replace(":", "_") if pod.endswith("1") else metric  # both spellings
        labels = f'{obs.PROM_LABEL_CLUSTER}="{cluster}",namespace="team-a",pod="{pod}"'
        labels += f',{obs.PROM_LABEL_ROLE}="{role}"' if role else ""
        labels += f',outcome="{outcome}"' if outcome else ""
        for j, v in enumerate(fam.values):
            ts = t0 + j * STEP_S
            if fam.kind == "counter":
                lines.setdefault(name + "_total", []).append(f"{name}_total{{{labels}}} {v!r} {ts}")
            elif fam.kind == "gauge":
                lines.setdefault(name, []).append(f"{name}{{{labels}}} {v!r} {ts}")
            else:
                counts, total, count = v
                bounds = [*(repr(float(b)) for b in M.BUCKETS[metric]), "+Inf"]
                cumulative = 0
                for le, n in zip(bounds, counts, strict=True):
                    cumulative += n
                    lines.setdefault(name + "_bucket", []).append(
                        f'{name}_bucket{{{labels},le="{le}"}} {cumulative} {ts}'
                    )
                lines.setdefault(name + "_sum", []).append(f"{name}_sum{{{labels}}} {total!r} {ts}")
                lines.setdefault(name + "_count", []).append(f"{name}_count{{{labels}}} {count} {ts}")
    return "".join("\n".join(rows) + "\n" for rows in lines.values()) + "# EOF\n"


def scrapes(data: dict[tuple[str, str, str], Family], t0: int) -> M.Scrapes:
    """The same samples as the simulator keeps them: per role, summed (gauges as the
    contract aggregates them), decoys left out as the queries leave them out."""
    out = M.Scrapes(BOUNDS)
    for j in range(SAMPLES):
        hists, counters, gauges = {}, {}, {}
        for s in SERIES:
            fams = [
                fam
                for (pod, metric, outcome), fam in data.items()
                if PODS[pod] == ("demo", s.role) and metric == s.metric and outcome == (s.outcome or "")
            ]
            if s.counter:
                counters[s.key] = sum(f.values[j] for f in fams)
            elif s.histogram:
                parts = [f.values[j] for f in fams]
                counts = tuple(map(sum, zip(*(p[0] for p in parts), strict=True)))
                hists[s.key] = (counts, sum(p[1] for p in parts), sum(p[2] for p in parts))
            elif s.kind == Kind.engines:
                gauges[s.key] = float(len(fams))
            else:
                values = [f.values[j] for f in fams]
                gauges[s.key] = sum(values) / (len(values) if s.kind == Kind.gauge_avg else 1)
        out.record(M.Sample(float(t0 + j * STEP_S), hists, counters, gauges))
    return out


@pytest.fixture(scope="module")
def backfilled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, M.Scrapes, int]]:
    root = tmp_path_factory.mktemp("parity")
    t0 = (int(time.time()) - 3 * 3600) // 3600 * 3600
    data = exported(random.Random(7))
    (root / "samples.om").write_text(openmetrics(data, t0))
    subprocess.run(
        [PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(root / "samples.om"), str(root / "data")],
        check=True,
        capture_output=True,
    )
    with prometheus(root, "global:\n  scrape_interval: 1m\n") as url:
        yield url, scrapes(data, t0), t0


def assert_same(a: object, b: object, where: str) -> None:
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif a is None or b is None:
        assert a is b, f"{where}: Prometheus {a!r}, simulator {b!r}"
    else:
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9), f"{where}: Prometheus {a!r}, simulator {b!r}"


@pytest.mark.parametrize(("offset_s", "quantile"), [(302.5, 0.9), (477.5, 0.99), (157.5, 0.5), (62.5, 0.9)])
async def test_prometheus_and_the_simulator_read_the_same_snapshot(
    backfilled: tuple[str, M.Scrapes, int], offset_s: float, quantile: float
) -> None:
    url, sim, t0 = backfilled
    async with aiohttp.ClientSession() as session:
        real = await Prometheus(url, session).snapshot("team-a", "demo", WINDOW_S, quantile, at=t0 + offset_s)
    simulated = M.snapshot(sim, t0 + offset_s, WINDOW_S, quantile)
    assert isinstance(real, MetricsSnapshot) and isinstance(simulated, MetricsSnapshot)
    # Every field the contract fills is there: a parity of Nones would prove nothing.
    assert real.decode.running and real.prefill.prompt_tokens and real.decode_kv_usage is not None
    assert real.colocated.ttft_ms and real.colocated.kv_usage is not None and real.colocated.ready
    assert (real.request_rate_before is None) == (offset_s < WINDOW_S + STEP_S)
    assert_same(real, simulated, "snapshot")


async def test_an_unknown_cluster_has_no_snapshot(backfilled: tuple[str, M.Scrapes, int]) -> None:
    url, _, t0 = backfilled
    async with aiohttp.ClientSession() as session:
        assert await Prometheus(url, session).snapshot("team-a", "nobody", WINDOW_S, 0.9, at=t0 + 300) is None
