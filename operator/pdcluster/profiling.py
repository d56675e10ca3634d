"""`pdctl profile`: measure one engine's latency profile and write it as a ConfigMap.

The engine is any OpenAI-compatible vLLM server (or the engine simulator) that nothing
else is using. Prefill: requests of prompt lengths from a few tokens to half the
model's context, one at a time, max_tokens 1; the latency is fitted as
a + b L + c L^2. Decode: B streams at once with short and with long prompts; each
stream's mean gap between tokens is a step, fitted as d0 + d1 B + d2 x KV tokens.
Prompts are random token ids so that no request reuses another's prefix cache. The KV
capacity comes from vllm:cache_config_info (num_gpu_blocks x block_size), else from
the KV usage the decode runs showed.

The ConfigMap's `profile.json` is what `autoscaling.profileConfigMap` names: the
control law's prior, which it corrects online from the engines' metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import re
import statistics
import sys
import time

import aiohttp
import numpy as np
import yaml

from pdcluster import perf

TOKEN_IDS = (100, 1000)  # ids every tokenizer of interest has, clear of special tokens
SHORT_PROMPT, DECODE_TOKENS = 16, 48


class ProfilingError(Exception):
    pass


async def _models(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/v1/models") as r:
        if r.status != 200:
            raise ProfilingError(f"{url}/v1/models answered {r.status}")
        body = await r.json()
    if not body.get("data"):
        raise ProfilingError(f"{url} serves no model")
    return body["data"][0]


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(*TOKEN_IDS) for _ in range(tokens)]


async def _prefill_ms(
    http: aiohttp.ClientSession, url: str, model: str, prompt: list[int]
) -> tuple[int, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    async with http.post(f"{url}/v1/completions", json=body) as r:
        answer = await r.json(content_type=None)
        if r.status != 200:
            raise ProfilingError(f"a {len(prompt)}-token prompt: {r.status} {answer}")
    took = (time.perf_counter() - start) * 1000.0
    return answer.get("usage", {}).get("prompt_tokens", len(prompt)), took


async def _stream_gaps(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> list[float]:
    """Milliseconds between one stream's tokens after its first."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": DECODE_TOKENS,
        "min_tokens": DECODE_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    stamps = []
    async with http.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise ProfilingError(f"a decode stream: {r.status} {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                stamps.append(time.perf_counter())
    return [(b - a) * 1000.0 for a, b in itertools.pairwise(stamps[1:])]


async def _kv_capacity(http: aiohttp.ClientSession, url: str) -> int | None:
    """num_gpu_blocks x block_size, from vllm:cache_config_info's labels."""
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    info = re.search(r"^vllm[:_]cache_config_info\{([^}]*)\}", text, re.MULTILINE)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1))) if info else {}
    if labels.get("num_gpu_blocks", "").isdigit() and labels.get("block_size", "").isdigit():
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    return None


def _fit(rows: list[list[float]], y: list[float]) -> tuple[float, float, float]:
    """Least squares with none of the coefficients negative (noise must not make a
    longer prompt faster)."""
    x, target = np.asarray(rows), np.asarray(y)
    free = [0, 1, 2]
    while free:
        theta = np.zeros(3)
        theta[free] = np.linalg.lstsq(x[:, free], target, rcond=None)[0]
        negative = [j for j in free if theta[j] < 0]
        if not negative:
            return float(theta[0]), float(theta[1]), float(theta[2])
        free = [j for j in free if j not in negative]
    return 0.0, 0.0, 0.0


async def measure(
    url: str,
    *,
    repeats: int = 3,
    max_concurrency: int = 16,
    max_prompt: int | None = None,
    max_kv_tokens: int | None = None,
    kv_bytes_per_token: int = 0,
    seed: int = 0,
    say=lambda _msg: None,
) -> perf.Profile:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        card = await _models(http, url)
        model, context = card["id"], int(card.get("max_model_len") or 2048)
        longest = min(max_prompt or context // 2, context - DECODE_TOKENS - 1)
        if longest < 8:
            raise ProfilingError(f"{model}'s context of {context} tokens leaves nothing to measure")
        await _prefill_ms(http, url, model, _prompt(rng, 8))  # warm-up
        lengths = sorted({max(round(longest / 2**k), 1) for k in range(8)})
        rows, y = [], []
        for n in lengths:
            times = []
            for _ in range(repeats):
                tokens, took = await _prefill_ms(http, url, model, _prompt(rng, n))
                times.append(took)
            rows.append([1.0, float(tokens), float(tokens) ** 2])
            y.append(statistics.median(times))
            say(f"prefill {tokens:>6} tokens: {y[-1]:8.1f} ms")
        prefill = _fit(rows, y)
        long_prompt = max(min(longest, (context - DECODE_TOKENS) // 2), SHORT_PROMPT)
        rows, y = [], []
        for prompt in (SHORT_PROMPT, long_prompt):
            batch = 1
            while batch <= max_concurrency:
                gaps = await asyncio.gather(
                    *(_stream_gaps(http, url, model, _prompt(rng, prompt)) for _ in range(batch))
                )
                step = statistics.median([g for stream in gaps for g in stream] or [0.0])
                kv_tokens = batch * (prompt + DECODE_TOKENS / 2)
                rows.append([1.0, float(batch), kv_tokens])
                y.append(step)
                say(f"decode {batch:>3} x {prompt:>5}-token prompts: {step:7.2f} ms per step")
                batch *= 2
        decode = _fit(rows, y)
        capacity = await _kv_capacity(http, url) or max_kv_tokens
    if capacity is None:
        raise ProfilingError(f"{url}/metrics has no vllm:cache_config_info: pass --max-kv-tokens")
    return perf.Profile(f"measured-{model}", prefill, decode, capacity, kv_bytes_per_token)


def config_map(profile: perf.Profile, name: str, namespace: str | None) -> dict:
    meta = {"name": name, "labels": {"app.kubernetes.io/component": "latency-profile"}}
    if namespace:
        meta["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {perf.PROFILE_KEY: perf.to_json(profile)},
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--name", required=True, help="name of the ConfigMap to write")
    p.add_argument("-n", "--namespace", help="its namespace (default: none, kubectl's)")
    p.add_argument("--repeats", type=int, default=3, help="requests per prompt length (the median counts)")
    p.add_argument("--max-concurrency", type=int, default=16, help="most decode streams at once")
    p.add_argument(
        "--max-prompt-tokens", type=int, help="longest prompt measured (default: half the context)"
    )
    p.add_argument("--max-kv-tokens", type=int, help="KV capacity, when the engine does not report it")
    p.add_argument("--kv-bytes-per-token", type=int, default=0, help="KV bytes per token (for transfer time)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    try:
        profile = asyncio.run(
            measure(
                args.url.rstrip("/"),
                repeats=args.repeats,
                max_concurrency=args.max_concurrency,
                max_prompt=args.max_prompt_tokens,
                max_kv_tokens=args.max_kv_tokens,
                kv_bytes_per_token=args.kv_bytes_per_token,
                seed=args.seed,
                say=lambda msg: print(msg, file=sys.stderr),
            )
        )
    except ProfilingError as e:
        print(f"pdctl profile: {e}", file=sys.stderr)
        return 2
    except (aiohttp.ClientError, TimeoutError) as e:
        print(f"pdctl profile: {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    yaml.safe_dump(config_map(profile, args.name, args.namespace), sys.stdout, sort_keys=False)
    return 0
