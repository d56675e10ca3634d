"""Soak: the router at steady high load for --minutes (default 10) while the engines
under it scale up and down, on the local cluster.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--concurrency 32] [--scale-every 45]

Everything is the real thing except the GPUs: the local control plane (`soak` cluster),
the operator as a process, and a PDCluster of engine simulators (examples/pdcluster-sim.yaml,
H200 Llama-3.1-8B timings) with the operator's router pod in front, which follows the
engine pods through the apiserver. Every --scale-every seconds the PDCluster's prefill and
decode replica counts take the next step of a cycle (1:2, 2:3, 1:1, 2:2, 1:3, 2:1), so
engines start, become ready and drain (preStop, SIGTERM) under load.

Clients: --concurrency closed-loop workers sending streamed completions (a ~250-token
prompt, 32 output tokens) straight to the router pod. A request counts as an error
unless it ends with [DONE] after 32 tokens; 429 (SLO admission) is counted apart.
Printed per minute and at the end: requests, errors, 429s, p50/p99 latency and TTFT,
and the router process's RSS; then the drift of p99 latency and of RSS from the first
minute to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "e2e"), str(REPO / "e2e" / "local")]

from harness import install_crd, make_sim_cluster, rss_mib, settled, start_operator, stop_on_sigterm  # noqa: E402

from localcluster import State, load_state  # noqa: E402
from pdcluster import constants as C  # noqa: E402
from pdcluster.io.kube import Kube, KubeConfig  # noqa: E402

NAMESPACE = "soak"
NAME = "soak"
SCALE_CYCLE = [(1, 2), (2, 3), (1, 1), (2, 2), (1, 3), (2, 1)]  # (prefill, decode)
OUTPUT_TOKENS = 32
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "and",
    "keeps",
    "on",
    "running",
]


@dataclass
class Sample:
    at: float  # seconds since the load started
    status: int
    ok: bool
    latency: float
    ttft: float


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spec(prefill: int, decode: int) -> dict[str, Any]:
    return make_sim_cluster(
        NAME,
        prefill={"replicas": prefill, "minReplicas": 1, "maxReplicas": 4},
        decode={"replicas": decode, "minReplicas": 1, "maxReplicas": 4},
    )


async def apply(kube: Kube, doc: dict[str, Any]) -> None:
    doc = {"apiVersion": C.API_VERSION, "kind": C.KIND, **doc}
    doc["metadata"] = {**doc["metadata"], "namespace": NAMESPACE}
    await kube.apply(doc, field_manager="soak")


async def router_pod(kube: Kube) -> dict[str, Any]:
    selector = f"{C.LABEL_CLUSTER}={NAME},{C.LABEL_ROLE}={C.ROLE_ROUTER}"
    while True:
        pods = [
            p
            for p in await kube.list("v1", "Pod", NAMESPACE, label_selector=selector)
            if p["status"].get("podIP")
        ]
        if pods:
            return pods[0]
        await asyncio.sleep(0.5)


def router_rss_mib(state: State, pod: dict[str, Any]) -> float:
    """RSS of the router container's process (the pod runner records its pid)."""
    pid_file = Path(state.run_dir) / "pods" / f"{NAMESPACE}_{pod['metadata']['name']}" / "router.pid"
    return rss_mib(json.loads(pid_file.read_text())[0])


async def client(url: str, samples: list[Sample], started: float, stop: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        while not stop.is_set():
            # A per-request prefix, so prefix-aware routing has something to spread.
            prompt = " ".join(rng.choice(WORDS) for _ in range(250))
            body = {"prompt": prompt, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "stream": True}
            sent = time.monotonic()
            first = 0.0
            status, ok = 0, False
            try:
                async with http.post(url, json=body) as resp:
                    status = resp.status
                    raw = bytearray()
                    async for chunk in resp.content.iter_any():
                        first = first or time.monotonic()
                        raw += chunk
                events = [e for e in bytes(raw).split(b"\n\n") if e.strip()]
                tokens = sum(1 for e in events if b'"text"' in e and b'"error"' not in e)
                ok = status == 200 and events[-1:] == [b"data: [DONE]"] and tokens == OUTPUT_TOKENS
            except (aiohttp.ClientError, TimeoutError):
                pass
            done = time.monotonic()
            samples.append(Sample(sent - started, status, ok, done - sent, (first or done) - sent))
            if status == 429:
                await asyncio.sleep(0.2)  # as a client honouring Retry-After would, roughly


def minute_line(minute: int, window: list[Sample], rss: float) -> dict[str, Any]:
    served = [s for s in window if s.ok]
    errors = [s for s in window if not s.ok and s.status != 429]
    row = {
        "minute": minute + 1,
        "requests": len(window),
        "rps": len(window) / 60,
        "errors": len(errors),
        "429": sum(1 for s in window if s.status == 429),
        "p50_ms": percentile([s.latency for s in served], 0.5) * 1000,
        "p99_ms": percentile([s.latency for s in served], 0.99) * 1000,
        "ttft_p99_ms": percentile([s.ttft for s in served], 0.99) * 1000,
        "router_rss_mib": rss,
    }
    print(
        f"  min {row['minute']:2d}: {row['requests']:6d} req ({row['rps']:5.1f}/s), {row['errors']} errors, "
        f"{row['429']} x 429, latency p50 {row['p50_ms']:6.0f} ms p99 {row['p99_ms']:6.0f} ms, "
        f"TTFT p99 {row['ttft_p99_ms']:5.0f} ms, router RSS {rss:5.1f} MiB",
        flush=True,
    )
    return row


async def run(args: argparse.Namespace) -> int:
    cluster = [sys.executable, str(REPO / "e2e" / "local" / "cluster"), "--name", args.cluster]
    subprocess.run([*cluster, "up"], check=True)
    state = load_state(args.cluster)
    assert state is not None
    async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
        await install_crd(kube)
        if await kube.get("v1", "Namespace", NAMESPACE) is None:
            await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
            while await kube.get("v1", "ServiceAccount", "default", NAMESPACE) is None:
                await asyncio.sleep(0.2)
        op = start_operator(
            state.kubeconfig, NAMESPACE, Path(state.run_dir) / "soak-operator.log",
            f"--prometheus-url={state.prometheus_url}",
        )  # fmt: skip
        try:
            return await soak(args, state, kube, op)
        finally:
            op.kill()
            await kube.delete(C.API_VERSION, C.KIND, NAME, NAMESPACE)
            if not args.keep:
                subprocess.run([*cluster, "down"])


async def soak(args: argparse.Namespace, state: State, kube: Kube, op: Any) -> int:
    await apply(kube, spec(*SCALE_CYCLE[-1]))
    while not settled(await kube.get(C.API_VERSION, C.KIND, NAME, NAMESPACE)):
        await asyncio.sleep(1)
    pod = await router_pod(kube)
    url = f"http://{pod['status']['podIP']}:8000/v1/completions"
    print(f"Ready; load: {args.concurrency} clients for {args.minutes} min against {url}", flush=True)

    samples: list[Sample] = []
    rss: list[tuple[float, float]] = []
    stop = asyncio.Event()
    started = time.monotonic()
    clients = [
        asyncio.create_task(client(url, samples, started, stop, seed)) for seed in range(args.concurrency)
    ]
    rows = []
    scale_steps = 0
    next_scale = args.scale_every
    for minute in range(args.minutes):
        first_sample = len(samples)
        while (elapsed := time.monotonic() - started) < (minute + 1) * 60:
            if elapsed >= next_scale:
                await apply(kube, spec(*SCALE_CYCLE[scale_steps % len(SCALE_CYCLE)]))
                scale_steps += 1
                next_scale += args.scale_every
            rss.append((elapsed, router_rss_mib(state, pod)))
            await asyncio.sleep(5)
        window = [s for s in samples[first_sample:] if minute * 60 <= s.at < (minute + 1) * 60]
        rows.append(minute_line(minute, window, rss[-1][1]))
    stop.set()
    await asyncio.gather(*clients)
    failures = op.failures()
    router_restarts = (await kube.get("v1", "Pod", pod["metadata"]["name"], NAMESPACE))["status"][
        "containerStatuses"
    ][0]["restartCount"]

    total = len(samples)
    errors = [s for s in samples if not s.ok and s.status != 429]
    first, last = rows[0], rows[-1]
    print(f"\n{total} requests in {args.minutes} min ({total / (args.minutes * 60):.1f}/s), "
          f"{scale_steps} scaling steps (prefill:decode cycle {SCALE_CYCLE})")  # fmt: skip
    print(f"errors (not 429): {len(errors)}; 429: {sum(1 for s in samples if s.status == 429)}")
    if errors:
        print("  error statuses:", sorted({s.status for s in errors}))
    print(f"p99 latency: first minute {first['p99_ms']:.0f} ms, last {last['p99_ms']:.0f} ms, "
          f"drift {100 * (last['p99_ms'] / first['p99_ms'] - 1):+.1f}%")  # fmt: skip
    print(f"router RSS: first minute {first['router_rss_mib']:.1f} MiB, last {last['router_rss_mib']:.1f} MiB, "
          f"drift {last['router_rss_mib'] - first['router_rss_mib']:+.1f} MiB; restarts {router_restarts}")  # fmt: skip
    print(f"operator: {len(failures)} traceback/ERROR lines")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"minutes": rows, "errors": len(errors), "scale_steps": scale_steps}, indent=2)
        )
    return 1 if errors or failures or router_restarts else 0


def main() -> None:
    stop_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    p.add_argument("--scale-every", type=float, default=45.0, help="seconds between scaling steps")
    p.add_argument("--cluster", default="soak", help="local cluster name")
    p.add_argument("--keep", action="store_true", help="leave the cluster up afterwards")
    p.add_argument("--json", help="also write the per-minute figures here")
    sys.exit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
