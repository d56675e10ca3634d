"""Calibration: requests from a real trace, replayed through simulators over HTTP and
timed from the client side, reproduce the latency profile the simulator runs on.

- isolated requests (one at a time): TTFT = Profile.prefill_one_ms(L) and the mean
  inter-token latency = Profile.decode_step_ms(1, kv);
- a batch of B concurrent requests: TTFT = Profile.prefill_ms([L] * B) and ITL =
  Profile.decode_step_ms(B, B * kv);
- prefill on one simulator, decode on another, through the router: TTFT = prefill +
  KV transfer (bytes per token over the link) + one decode step.
Prompts are token-id lists, so their length is exact. Prints each check's
measured/expected ratios (median, min, max); the simulator is calibrated when medians
are within 10%. Wall-clock timing on a shared machine: a benchmark, not a test.

    .venv/bin/python benchmarks/enginesim_calibration.py
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))  # loopback uses harness

import aiohttp
import orjson
from loopback import CONSUMER, PRODUCER, engine_url, prefill_url, router, simulator

from pdcluster import perf

# No chunking, so a prompt is one prefill pass, as in the profile's measurements.
BUDGET = ("--max-num-batched-tokens", "65536")
MAX_OUTPUT = 32


def trace_slice(count: int) -> list[tuple[int, int]]:
    """(input, output) lengths of the first requests of the Mooncake conversation trace
    within the profile's measured range (100 to ~16k tokens), outputs capped."""
    path = perf.traces_dir() / "mooncake_conversation_trace.jsonl"
    picked = []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            if 1000 <= row["input_length"] <= 16000 and row["output_length"] >= 8:
                picked.append((row["input_length"], min(row["output_length"], MAX_OUTPUT)))
            if len(picked) == count:
                return picked
    raise AssertionError("trace too short")


async def timed_stream(
    http: aiohttp.ClientSession, url: str, prompt_tokens: int, max_tokens: int
) -> list[float]:
    """Client-side arrival times of each token, relative to sending."""
    body = {
        "prompt": list(range(prompt_tokens)),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    data = orjson.dumps(body)
    times: list[float] = []
    started = time.monotonic()
    async with http.post(
        f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 200
        buffer = b""
        async for chunk in resp.content.iter_any():
            now = time.monotonic() - started
            buffer += chunk
            events, _, buffer = buffer.rpartition(b"\n\n")
            times += [now] * events.count(b'"text":')
    assert len(times) == max_tokens
    return times


def mean_itl(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


def report(ratios: list[float], what: str) -> bool:
    """Measured/expected ratios; calibrated when the median is within 10%."""
    median = statistics.median(ratios)
    ok = 0.9 <= median <= 1.1
    print(
        f"{what:32} median {median:.3f}  min {min(ratios):.3f}  max {max(ratios):.3f}  "
        f"({len(ratios)} requests){'' if ok else '  OFF'}"
    )
    return ok


async def isolated_requests(http: aiohttp.ClientSession) -> bool:
    ttft, itl = [], []
    async with simulator(*BUDGET, model="m") as sim:
        profile, url = sim.profile, engine_url(sim)
        for prompt, output in trace_slice(10):
            times = await timed_stream(http, url, prompt, output)
            ttft.append(times[0] / (profile.prefill_one_ms(prompt) / 1000))
            # Mean step over the KV sizes this request's decode passed through.
            expected_itl = (
                statistics.fmean(profile.decode_step_ms(1, prompt + i) for i in range(1, output)) / 1000
            )
            itl.append(mean_itl(times) / expected_itl)
    return report(ttft, "isolated TTFT") & report(itl, "isolated ITL")


async def a_batch(http: aiohttp.ClientSession) -> bool:
    batch, prompt, output = 16, 2000, 48
    async with simulator(*BUDGET, model="m") as sim:
        profile, url = sim.profile, engine_url(sim)
        # The requests must reach the engine together to share one prefill batch; send
        # them, then time each from the moment all are out.
        runs = await asyncio.gather(*(timed_stream(http, url, prompt, output) for _ in range(batch)))
    expected_ttft = profile.prefill_ms([prompt] * batch) / 1000
    expected_itl = (
        statistics.fmean(profile.decode_step_ms(batch, batch * (prompt + i)) for i in range(1, output)) / 1000
    )
    return report([t[0] / expected_ttft for t in runs], f"batch of {batch}: TTFT") & report(
        [mean_itl(t) / expected_itl for t in runs], f"batch of {batch}: ITL"
    )


async def disaggregated(http: aiohttp.ClientSession) -> bool:
    gbps = 50.0  # a slow link, so the transfer is a visible share of TTFT
    async with (
        simulator(*BUDGET, "--kv-transfer-config", PRODUCER, "--sim-kv-gbps", str(gbps), model="m") as p,
        simulator(*BUDGET, "--kv-transfer-config", CONSUMER, model="m") as d,
        router("--no-admission", "--prefill", prefill_url(p), "--decode", engine_url(d)) as service,
    ):
        profile, ratios = p.profile, []
        for prompt, output in trace_slice(6):
            times = await timed_stream(http, f"http://127.0.0.1:{service.args.port}", prompt, output)
            expected = (
                profile.prefill_one_ms(prompt)
                + profile.kv_transfer_ms(prompt, gbps)
                + profile.decode_step_ms(1, prompt)
            ) / 1000
            ratios.append(times[0] / expected)
    return report(ratios, "disaggregated TTFT")


async def main() -> int:
    async with aiohttp.ClientSession() as http:
        ok = [await isolated_requests(http), await a_batch(http), await disaggregated(http)]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
