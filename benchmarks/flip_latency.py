"""How fast a flexible engine changes role: from the decision (a new split given to the
router) to the first request the flipped engine serves in its new role, under steady
streaming load. Three engine simulators started as MooncakeConnector kv_both (H200
profile, real time) behind one router, in this process; the split alternates between
1:2 and 2:1, so engine 1 flips from decode to prefill and back.

Printed per flip: when the new prefill -> decode pairs had passed their hand-off probe
(the router uses a new pair only then), and when the flipped engine got its first
request in the new role; then the median and the worst, and what the load was. The
decision here is the router's; in a cluster the operator's ConfigMap write and the
router's watch come before it (tests/e2e/test_flexible_vllm.py prints that part: the
spec change to the roles applied, with real vLLM).

    python benchmarks/flip_latency.py [--flips 10] [--clients 24] [--tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from pdcluster.enginesim.cli import parse
from pdcluster.enginesim.main import Simulator
from pdcluster.router.discovery import parse_static
from pdcluster.router.flags import parser
from pdcluster.router.main import RouterService

BOTH = '{"kv_connector":"MooncakeConnector","kv_role":"kv_both"}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_engine() -> Simulator:
    config = parse(["sim-model", "--host", "127.0.0.1", "--port", str(free_port()), "--kv-transfer-config", BOTH,
                    "--sim-profile", "h200-llama3.1-8b", "--sim-record", "100000"])  # fmt: skip
    config.bootstrap_port = free_port()
    sim = Simulator(config)
    await sim.start()
    return sim


async def first_leg_after(http: aiohttp.ClientSession, sim: Simulator, leg: str, since: float) -> float | None:
    """When `sim` first received a client request of `leg` (prefill or decode) after `since`."""
    async with http.get(f"http://127.0.0.1:{sim.config.port}/sim/requests") as r:
        records = await r.json()
    times = []
    for record in records:
        params = record["body"].get("kv_transfer_params") or {}
        kind = "prefill" if params.get("do_remote_decode") else "decode" if params.get("do_remote_prefill") else ""
        probe = record["headers"].get("X-Request-Id", "").startswith("kv-probe-")
        if kind == leg and not probe and record["received_at"] >= since:
            times.append(record["received_at"])
    return min(times, default=None)


async def client(http: aiohttp.ClientSession, url: str, tokens: int, stop: asyncio.Event, done: list[int]) -> None:
    body = {"prompt": "flip " * 200, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        async with http.post(f"{url}/v1/completions", json=body) as r:
            await r.read()
            done.append(r.status)


async def run(flips: int, clients: int, tokens: int) -> None:
    sims = [await start_engine() for _ in range(3)]
    flags = [a for s in sims for a in ("--flexible", f"http://127.0.0.1:{s.config.port}#bootstrap={s.config.bootstrap_port}")]
    args = parser().parse_args(["--host", "127.0.0.1", "--port", str(free_port()), *flags, "--prefill-engines", "1",
                                "--no-admission"])  # fmt: skip
    service = RouterService(args, parse_static([], [], [], args.flexible))
    await service.start()
    pool, router = service.pool, service.router
    assert pool is not None and router is not None and router.prober is not None
    url = f"http://127.0.0.1:{args.port}"
    stop, done = asyncio.Event(), []
    async with aiohttp.ClientSession() as http:
        load = [asyncio.create_task(client(http, url, tokens, stop, done)) for _ in range(clients)]
        await asyncio.sleep(2.0)  # warm: every engine in its first role
        probed_s, first_s = [], []
        for n in range(flips):
            prefill_engines, leg = (2, "prefill") if n % 2 == 0 else (1, "decode")
            decided = time.time()
            pool.assign(prefill_engines)
            while not router.prober.settled():
                await asyncio.sleep(0.001)
            probed_s.append(time.time() - decided)
            await asyncio.sleep(1.0)  # the flipped engine serves in its new role by now
            first = await first_leg_after(http, sims[1], leg, decided)
            if first is None:
                sys.exit(f"flip {n + 1}: engine 1 got no {leg} request within a second and more")
            first_s.append(first - decided)
            print(f"flip {n + 1}: engine 1 -> {leg}: pairs probed {probed_s[-1] * 1000:.0f} ms, "
                  f"first {leg} request {first_s[-1] * 1000:.0f} ms after the decision")  # fmt: skip
        stop.set()
        await asyncio.gather(*load)
    await service.stop()
    for sim in sims:
        await sim.stop()
    failed = sum(1 for status in done if status != 200)
    print(f"\n{flips} flips under {clients} streaming clients ({tokens} tokens each), {len(done)} requests, "
          f"{failed} failed")  # fmt: skip
    print(f"decision -> new pairs probed:        median {statistics.median(probed_s) * 1000:.0f} ms, "
          f"worst {max(probed_s) * 1000:.0f} ms")  # fmt: skip
    print(f"decision -> first request in new role: median {statistics.median(first_s) * 1000:.0f} ms, "
          f"worst {max(first_s) * 1000:.0f} ms (target: under 1000 ms)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flips", type=int, default=10)
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(a.flips, a.clients, a.tokens))


if __name__ == "__main__":
    main()
