"""The Mooncake store on a slice of a public trace, through the real router and a real
mooncake_master, in the local cluster: the same fleet with and without the store, side
by side in one run.

Two PDClusters of examples/pdcluster-sim.yaml (engine simulators on the H200 profile,
autoscaling off, the same split) run at once: `nostore` as it is, `store` with
`mooncake.store.enabled`. Their simulators run vLLM's MooncakeStoreConnector against
the master (enginesim/store_connector.py: vLLM's block keys, loads of the leading stored run,
writes of every computed block) and their router sends prompts the store holds straight
to decode. Each request of the slice goes to both routers at its trace time (divided by
--speed), as a stream of at most --max-tokens tokens; the prompts are token ids whose
512-token blocks repeat where the trace's hash_ids do (e2e/local/pddemo/workload.py prompt_ids).
Engines run --speed times faster than real time (--sim-time-scale), so the load is the
trace's; the TTFTs printed are wall-clock and therefore --speed times shorter than the
modelled ones.

Reported per PDCluster: requests answered, prompt tokens the prefill engines computed,
tokens loaded from the store (prefill and decode), requests that skipped prefill, TTFT
p50/p90; and for the store, the prefill tokens saved over the slice's reusable tokens
(leading blocks an earlier request of the slice had: what an unbounded store could
serve, as in benchmarks/store_bench.py).

    .venv/bin/python benchmarks/store_cluster.py [--trace synthetic] [--start 0] [--requests 200] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "e2e" / "local"), str(REPO / "tests" / "e2e")]

import aiohttp  # noqa: E402
from harness import counter, install_crd, make_sim_cluster, settled, start_operator, stop_on_sigterm  # noqa: E402

from localcluster import cluster, nodes  # noqa: E402
from pdcluster import constants as C  # noqa: E402
from pdcluster.io.kube import Kube, KubeConfig  # noqa: E402
from pdcluster.sim.trace import load_trace  # noqa: E402
from pdcluster.vllm.hashing import block_keys  # noqa: E402
from pddemo.workload import Phase, Request, prompt_ids, workload  # noqa: E402

NAMESPACE = "bench-store"
TRACES = {"conversation": "mooncake_conversation_trace.jsonl", "synthetic": "mooncake_synthetic_trace.jsonl"}
MAX_MODEL_LEN = 131072  # the example's
BLOCK_SIZE = 64  # the engines' --block-size: fewer keys per long prompt than vLLM's 16 on two cores


def pdcluster(name: str, store: bool, speed: float, prefill: int, decode: int) -> dict:
    doc = make_sim_cluster(name)
    spec = doc["spec"]
    spec["engine"]["args"] = [
        *spec["engine"]["args"],
        f"--sim-time-scale={speed:g}",
        f"--block-size={BLOCK_SIZE}",
    ]
    spec["prefill"] |= {"replicas": prefill}
    spec["decode"] |= {"replicas": decode}
    spec["mooncake"] = {"image": C.DEFAULT_MOONCAKE_IMAGE}
    # Every request served, so both fleets compute the same prompts (early rejection
    # would turn away different ones).
    spec["router"] = {**spec.get("router", {}), "admission": {"enabled": False}}
    if store:
        spec["mooncake"]["store"] = {"enabled": True, "engineSegmentSize": "1Gi", "engineBufferSize": "64Mi"}
    doc["metadata"]["namespace"] = NAMESPACE
    return doc


def reusable_tokens(prompts: list[list[int]]) -> int:
    """Tokens in leading --block-size blocks an earlier prompt of the slice had, at most
    all but each prompt's last token: what an unbounded store could serve these engines."""
    seen: set[bytes] = set()
    reusable = 0
    for ids in prompts:
        keys = [k.encode() for k in block_keys(ids, BLOCK_SIZE, "m", "0")]
        lead = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
        reusable += min(lead * BLOCK_SIZE, len(ids) - 1)
        seen.update(keys)
    return reusable


async def scrape(http: aiohttp.ClientSession, kube: Kube, name: str) -> dict[str, float]:
    pods = await kube.list("v1", "Pod", NAMESPACE, label_selector=f"{C.LABEL_CLUSTER}={name}")
    out = {"prefill_computed": 0.0, "loaded": 0.0}
    for pod in pods:
        if pod["metadata"]["labels"][C.LABEL_ROLE] != C.ROLE_PREFILL:
            continue
        async with http.get(f"http://{pod['status']['podIP']}:8000/metrics") as r:
            text = await r.text()
        out["prefill_computed"] += counter(text, "vllm:prompt_tokens_by_source_total", source="local_compute")
        # Prefill gets no hand-off: what it did not compute came from the store.
        out["loaded"] += counter(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    svc = await kube.get("v1", "Service", f"{name}-router", NAMESPACE)
    async with http.get(f"http://{svc['spec']['clusterIP']}:{C.ROUTER_PORT}/metrics") as r:
        text = await r.text()
    out["bypassed"] = counter(text, "pdcluster_router_prefill_bypassed_total")
    # Decode loads from the store only for a request that skipped prefill (its other
    # external tokens are the hand-off's): the router counts those.
    out["loaded"] += counter(text, "pdcluster_router_store_prefix_tokens_total")
    return out


async def stream(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, float | None]:
    """(HTTP status, 0 when none came; TTFT in seconds, None without a token)."""
    started = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/completions", json=body) as r:
            ttft = None
            async for line in r.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - started
            return r.status, ttft
    except (aiohttp.ClientError, TimeoutError):
        return 0, None


async def replay(routers: dict[str, str], requests: list[Request], max_tokens: int) -> dict[str, list]:
    """Per router, (status, TTFT) of each request."""
    answers: dict[str, list] = {name: [] for name in routers}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def one(r: Request) -> None:
            body = {
                "prompt": prompt_ids(r),
                "max_tokens": max(1, min(r.output_tokens, max_tokens)),
                "ignore_eos": True,
                "stream": True,
            }
            results = await asyncio.gather(*(stream(http, url, body) for url in routers.values()))
            for name, answer in zip(routers, results, strict=True):
                answers[name].append(answer)

        started = time.monotonic()
        tasks = []
        for r in requests:
            await asyncio.sleep(max(0.0, r.at_s - (time.monotonic() - started)))
            tasks.append(asyncio.create_task(one(r)))
        await asyncio.gather(*tasks)
    return answers


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


async def measure(state: cluster.State, args: argparse.Namespace) -> dict:
    trace = load_trace(REPO.parent / "shared" / "traces" / TRACES[args.trace])
    start_s = trace.arrival_s[min(args.start, len(trace.arrival_s) - 1)] - trace.arrival_s[0]
    requests = [
        r
        for r in workload(trace, start_s, [Phase(1e9, args.speed)])
        if r.input_tokens < MAX_MODEL_LEN
    ][: args.requests]
    prompts = [prompt_ids(r) for r in requests]
    total, reusable = sum(map(len, prompts)), reusable_tokens(prompts)
    names = {"nostore": False, "store": True}
    async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
        await install_crd(kube)
        if not await kube.get("v1", "Namespace", NAMESPACE):
            await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        operator = start_operator(state.kubeconfig, NAMESPACE, Path(state.run_dir) / "bench-operator.log")
        try:
            for name, store in names.items():
                doc = pdcluster(name, store, args.speed, args.prefill, args.decode)
                await kube.apply(doc, field_manager="store-cluster-bench")
            started = time.monotonic()
            for name in names:
                while not settled(await kube.get(C.API_VERSION, C.KIND, name, NAMESPACE)):
                    if time.monotonic() - started > 300:
                        raise SystemExit(f"{name} not Ready after 300 s")
                    await asyncio.sleep(1)
            routers = {}
            for name in names:
                svc = await kube.get("v1", "Service", f"{name}-router", NAMESPACE)
                routers[name] = f"http://{svc['spec']['clusterIP']}:{C.ROUTER_PORT}"
            print(f"{len(requests)} requests over {requests[-1].at_s:.0f} s", file=sys.stderr)
            answers = await replay(routers, requests, args.max_tokens)
            async with aiohttp.ClientSession() as http:
                figures = {name: await scrape(http, kube, name) for name in names}
        finally:
            operator.kill(signal.SIGTERM)
            for name in names:
                await kube.delete(C.API_VERSION, C.KIND, name, NAMESPACE)
    out = {
        "trace": args.trace,
        "requests": len(requests),
        "prompt_tokens": total,
        "reusable_tokens": reusable,
    }
    for name in names:
        ok = [t for status, t in answers[name] if status == 200 and t is not None]
        statuses: dict[str, int] = {}
        for status, _ in answers[name]:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        out[name] = {
            **figures[name],
            "answered": len(ok),
            "statuses": statuses,
            "ttft_p50_ms": quantile(ok, 0.5) * 1000,
            "ttft_p90_ms": quantile(ok, 0.9) * 1000,
        }
    saved = out["nostore"]["prefill_computed"] - out["store"]["prefill_computed"]
    out["store"]["saved"] = saved
    out["store"]["saved_of_reusable"] = saved / reusable if reusable else float("nan")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", choices=sorted(TRACES), default="synthetic")
    p.add_argument("--start", type=int, default=0, help="index of the slice's first request")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument(
        "--speed", type=float, default=4.0, help="trace seconds per second, and the engines' time scale"
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--cluster", default="bench-store", help="local cluster name (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="leave the cluster up")
    args = p.parse_args()
    stop_on_sigterm()
    state = cluster.up(args.cluster, nodes.NodePool(gpu_nodes=1, cpu_nodes=1))
    try:
        out = asyncio.run(measure(state, args))
    finally:
        if not args.keep:
            cluster.down(args.cluster)
    print(f"{out['trace']}: {out['requests']} requests, {out['prompt_tokens']} prompt tokens, "
          f"{out['reusable_tokens'] / out['prompt_tokens']:.1%} reusable within the slice")  # fmt: skip
    print(
        "| PDCluster | answered | prefill tokens computed | loaded from store | bypassed prefill | TTFT p50 | TTFT p90 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in ("nostore", "store"):
        f = out[name]
        print(f"| {name} | {f['answered']}/{out['requests']} | {f['prefill_computed']:.0f} | {f['loaded']:.0f} "
              f"| {f['bypassed']:.0f} | {f['ttft_p50_ms']:.0f} ms | {f['ttft_p90_ms']:.0f} ms |")  # fmt: skip
    s = out["store"]
    print(f"prefill tokens saved: {s['saved']:.0f} ({s['saved_of_reusable']:.0%} of the reusable ones)")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
