"""Precise prefix routing on loopback: engine simulators with a prefix cache publish
vLLM's KV events over ZMQ, the router follows them and routes by what each engine's
cache holds; what the router says a pick had cached is what the engine then reports as
its prefix-cache hits."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import zmq
from loopback import CONSUMER, PRODUCER, counter, free_port, free_port_run, router, simulator
from test_router_pd import WaitUntil, post, scrape

from pdcluster import observability as obs
from pdcluster.enginesim.main import Simulator
from pdcluster.router.main import RouterService

BLOCK = 16  # the simulator's default --block-size
CHARS_PER_BLOCK = BLOCK * 4  # the simulator's tokenizer: one token per 4 bytes


def url_of(sim: Simulator) -> str:
    return f"http://{sim.config.host}:{sim.config.port}"


def text(seed: str, blocks: int) -> str:
    return "".join(f"{seed}{i:06d}".ljust(CHARS_PER_BLOCK, ".") for i in range(blocks))


def completion(prompt: str) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}


@contextlib.asynccontextmanager
async def engines(
    port: int, *extra: str, blocks: int = 64, n: int = 2, replay: int | None = None
) -> AsyncIterator[list[Simulator]]:
    """`n` simulators with a prefix cache of `blocks` blocks, publishing KV events on
    `port` (and replaying them on `replay`), each on its own loopback address (one port,
    as in a cluster)."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
    }
    if replay is not None:
        config["replay_endpoint"] = f"tcp://*:{replay}"
    events = json.dumps(config)
    argv = ("--sim-profile", "zero", "--sim-record", "100", "--enable-prefix-caching",
            "--num-gpu-blocks-override", str(blocks), "--kv-events-config", events, *extra)  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(simulator(*argv, host=f"127.0.0.{2 + i}")) for i in range(n)]


async def served_by(http: aiohttp.ClientSession, sims: list[Simulator]) -> list[int]:
    """How many client requests each engine has received."""
    counts = []
    for sim in sims:
        async with http.get(f"{url_of(sim)}/sim/requests") as resp:
            records = await resp.json()
        counts.append(
            len([r for r in records if not r["headers"].get("X-Request-Id", "").startswith("kv-probe-")])
        )
    return counts


async def kv_view(
    http: aiohttp.ClientSession, service: RouterService, role: str, key: str = "url"
) -> dict[Any, dict[str, Any]]:
    """What the router knows of each engine's cache, by `key` of its backend."""
    async with http.get(f"http://127.0.0.1:{service.args.port}/backends") as resp:
        view = await resp.json()
    return {b[key]: b["kv_events"] for b in view[role]}


async def test_the_router_knows_what_each_engine_holds(wait_until: WaitUntil) -> None:
    port = free_port()
    async with (
        aiohttp.ClientSession() as http,
        engines(port) as sims,
        router(
            *(a for s in sims for a in ("--colocated", url_of(s))),
            "--policy", "precise-prefix", "--kv-events-port", str(port), "--kv-probe-interval", "0",
        ) as service,
    ):  # fmt: skip
        url = f"http://127.0.0.1:{service.args.port}/v1/completions"
        shared = text("doc", 40)
        status, _, _ = await post(http, url, completion(shared + " first question"))
        assert status == 200
        first = (await served_by(http, sims)).index(1)
        holder = url_of(sims[first])

        async def indexed() -> bool:
            return (await kv_view(http, service, "colocated"))[holder]["blocks"] >= 40

        await wait_until(indexed, interval=0.05)
        # The same document with other questions goes where it is cached, every time,
        # though the other engine is idle and the router's tie-break would rotate.
        for i in range(4):
            status, _, _ = await post(http, url, completion(shared + f" question {i}"))
            assert status == 200
        assert await served_by(http, sims) == ([5, 0] if first == 0 else [0, 5])
        metrics = await scrape(http, f"http://127.0.0.1:{service.args.port}/metrics")
        engine = await scrape(http, f"{holder}/metrics")
        view = await kv_view(http, service, "colocated")
    assert all(v["live"] for v in view.values() if v["blocks"]) and view[holder]["live"]
    # One batch: the later prompts stored no new full block.
    assert counter(metrics, obs.ROUTER_KV_EVENT_BATCHES + "_total") == 1
    assert counter(metrics, obs.ROUTER_EXACT_BLOCKS + "_total", outcome="ok") == 5
    # What the router counted as cached for its picks is what the engine served from cache.
    predicted = counter(metrics, obs.ROUTER_CACHED_PROMPT_TOKENS + "_total", source="events")
    assert predicted == counter(engine, obs.VLLM_PREFIX_HITS + "_total") == 4 * 40 * BLOCK


async def test_evictions_reach_the_router_where_a_guess_would_not(wait_until: WaitUntil) -> None:
    port = free_port()
    async with (
        aiohttp.ClientSession() as http,
        engines(port, blocks=48, n=1) as sims,
        router(
            "--colocated", url_of(sims[0]), "--policy", "precise-prefix",
            "--kv-events-port", str(port), "--kv-probe-interval", "0",
        ) as service,
    ):  # fmt: skip
        url = f"http://127.0.0.1:{service.args.port}/v1/completions"
        holder = url_of(sims[0])
        first, other = text("one", 40), text("two", 40)
        assert (await post(http, url, completion(first)))[0] == 200

        async def holds(n: int) -> Any:
            async def check() -> bool:
                return (await kv_view(http, service, "colocated"))[holder]["blocks"] == n

            return check

        await wait_until(await holds(40), interval=0.05)
        # Another prompt sent to the engine directly: its 48-block cache evicts most of
        # the first, which the router only hears of from the engine.
        assert (await post(http, f"{holder}/v1/completions", completion(other)))[0] == 200
        await wait_until(await holds(48), interval=0.05)
        assert (await post(http, url, completion(first)))[0] == 200
        metrics = await scrape(http, f"http://127.0.0.1:{service.args.port}/metrics")
        engine = await scrape(http, f"{holder}/metrics")
    # The first prompt's leading blocks were evicted (LRU): nothing of it is cached, the
    # router knew, and the engine computed it all.
    assert counter(metrics, obs.ROUTER_CACHED_PROMPT_TOKENS + "_total", source="events") == 0
    assert counter(engine, obs.VLLM_PREFIX_HITS + "_total") == 0


async def test_prefill_ranks_replay_what_the_router_missed_and_a_restart_resets_the_index(
    wait_until: WaitUntil,
) -> None:
    # Each DP rank binds its endpoints at port + rank: two ports each, kept out of the
    # ephemeral range the other free ports come from.
    base = free_port_run(4)
    port, replay = base, base + 2
    async with (
        aiohttp.ClientSession() as http,
        engines(port, "--kv-transfer-config", PRODUCER, "--data-parallel-size", "2", n=1, replay=replay) as (prefill,),
        simulator("--sim-profile", "zero", "--kv-transfer-config", CONSUMER) as decode,
        router(
            "--prefill", f"{url_of(prefill)}#bootstrap={prefill.config.bootstrap_port}",
            "--decode", f"http://127.0.0.1:{decode.config.port}", "--policy", "precise-prefix",
            "--kv-events-port", str(port), "--kv-events-replay-port", str(replay), "--kv-probe-interval", "0",
        ) as service,
    ):  # fmt: skip
        url = f"http://127.0.0.1:{service.args.port}/v1/completions"
        # Sent before the router has even found the ranks (their bootstrap answers later):
        # it learns of these blocks from the ranks' replay sockets.
        for i in range(4):
            assert (await post(http, url, completion(text(f"p{i}", 20))))[0] == 200
        held = [len(core.prefix) for core in prefill.cores]  # type: ignore[arg-type]
        assert sum(held) == 80 and all(held)

        async def ranks_indexed() -> bool:
            view = await kv_view(http, service, "prefill", key="dp_rank")
            return [view.get(r, {}).get("blocks") for r in range(2)] == held

        await wait_until(ranks_indexed, interval=0.05)
        # Rank 0's publisher goes, and one that numbers from 0 again takes its port: a
        # restarted engine, whose cache is empty.
        await prefill.cores[0].prefix.publisher.close()  # type: ignore[union-attr]
        restarted = zmq.Context.instance().socket(zmq.PUB)

        async def bound() -> bool:  # once ZMQ's I/O thread has let the old socket go
            with contextlib.suppress(zmq.ZMQError):
                restarted.bind(f"tcp://{prefill.config.host}:{port}")
                return True
            return False

        await wait_until(bound, interval=0.05)
        seq = 0
        try:

            async def rank0_restarted() -> bool:
                restarted.send_multipart((b"", seq.to_bytes(8, "big"), msgpack.packb([0.0, [], 0])))
                view = await kv_view(http, service, "prefill", key="dp_rank")
                return view[0] == {"live": True, "blocks": 0}

            await wait_until(rank0_restarted, interval=0.05)
            # A batch skipped, which no replay socket can fill: the index forgets rank 0.
            stored = {"type": "BlockStored", "block_hashes": [b"x" * 32], "medium": "GPU"}
            restarted.send_multipart((b"", (1).to_bytes(8, "big"), msgpack.packb([0.0, [stored], 0])))
            restarted.send_multipart((b"", (5).to_bytes(8, "big"), msgpack.packb([0.0, [], 0])))

            async def gap_seen() -> bool:
                metrics = await scrape(http, f"http://127.0.0.1:{service.args.port}/metrics")
                return counter(metrics, obs.ROUTER_KV_EVENT_LOSSES + "_total", reason="gap") == 1

            await wait_until(gap_seen, interval=0.05)
            view = await kv_view(http, service, "prefill", key="dp_rank")
        finally:
            restarted.close(linger=0)
    assert view[0] == {"live": True, "blocks": 0}  # the stored block is forgotten with the rest
    assert view[1]["blocks"] == held[1]
