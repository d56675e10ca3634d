"""The replay: each request of the workload sent to the router at its time, as a stream,
and what came back (client-side TTFT and mean ITL per request)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from pdcluster.sim.trace import MOONCAKE_BLOCK_TOKENS
from pddemo.workload import Engine, Request, prompt_ids


@dataclass
class Outcomes:
    sent: int = 0
    ok: int = 0
    rejected: int = 0
    failed: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # one mean per request
    last_error: str = ""

    @property
    def done(self) -> int:
        return self.ok + self.rejected + self.failed

    def fail(self, error: str) -> None:
        self.failed += 1
        self.last_error = error

    def answered(self, started: float, token_stamps: list[float]) -> None:
        if not token_stamps:
            self.fail("stream ended without tokens")
            return
        self.ok += 1
        self.ttft_s.append(token_stamps[0] - started)
        if len(token_stamps) > 1:
            self.itl_s.append((token_stamps[-1] - token_stamps[0]) / (len(token_stamps) - 1))


def completion_body(model: str, request: Request, engine: Engine) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "prompt": prompt_ids(request, MOONCAKE_BLOCK_TOKENS // engine.length_divisor, engine.vocabulary),
            "max_tokens": request.output_tokens,
            "ignore_eos": True,  # the trace's output length, not the simulator's EOS draw
            "stream": True,
        }
    )


async def send(
    session: aiohttp.ClientSession, url: str, model: str, request: Request, out: Outcomes, engine: Engine
) -> None:
    started = time.monotonic()
    stamps: list[float] = []
    try:
        async with session.post(
            f"{url}/v1/completions",
            data=completion_body(model, request, engine),
            headers={"Content-Type": "application/json"},
        ) as resp:
            if resp.status == 429:
                out.rejected += 1
                return
            if resp.status != 200:
                out.fail(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    stamps.append(time.monotonic())
    except (aiohttp.ClientError, TimeoutError) as e:
        out.fail(repr(e))
        return
    out.answered(started, stamps)


async def replay(url: str, model: str, requests: list[Request], out: Outcomes, engine: Engine) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.monotonic()
        tasks = []
        for request in requests:
            delay = started + request.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            out.sent += 1
            tasks.append(asyncio.create_task(send(session, url, model, request, out, engine)))
        await asyncio.gather(*tasks)
