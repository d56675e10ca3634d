"""Requests that survive engine faults, on loopback: engine simulators as processes
(killed with SIGKILL, as a node loss or an OOM kill ends them) behind the real router.

- a decode engine killed mid-stream: the stream goes on from another decode engine and
  equals an unbroken one, token for token, usage included;
- prefill engines killed at random points, twenty times, and started again under a new
  engine id: every request completes, and no decode request names a dead engine id
  once the router has seen the new one;
- one prefill's KV hand-off broken: the router's probes find the pair, it takes no
  more traffic, every request completes, and it is used again once it works;
- prompts decode computes itself while a good pair is probed: no probe fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from loopback import CONSUMER, PRODUCER, counter, free_port, router, wait_until

from pdcluster import observability as obs

SIM = str(Path(sys.executable).parent / "pdcluster-engine-sim")
MODEL = "sim-model"
# Ten times slower than the H200 profile: tens of ms per token, so a stream can be
# killed in its middle; recompute, as the operator renders it.
SLOW = ("--sim-time-scale", "0.1", "--sim-record", "400")
KV = {
    "prefill": PRODUCER,
    "decode": CONSUMER.removesuffix("}") + ',"kv_load_failure_policy":"recompute"}',
}


class Engine:
    """An engine simulator process on fixed ports, so it can die and come back."""

    def __init__(self, role: str, *args: str):
        self.role = role
        self.args = args
        self.port, self.bootstrap = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [SIM, "serve", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
             "--kv-transfer-config", KV[self.role], *SLOW, *self.args],
            env={**os.environ, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap),
                 "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "30"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    async def healthy(self) -> None:
        async with aiohttp.ClientSession() as http:

            async def answers() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{self.url}/health") as resp:
                        return resp.status == 200
                return False

            await wait_until(answers, timeout=60, interval=0.05, message=f"{self.role} engine healthy")


@contextlib.contextmanager
def engines(*roles: str) -> Iterator[list[Engine]]:
    """Engines of these roles; "prefill+faults" is a prefill that serves /sim/faults."""
    out = [
        Engine(role.partition("+")[0], *(("--sim-faults",) if role.endswith("+faults") else ()))
        for role in roles
    ]
    try:
        for e in out:
            e.start()
        yield out
    finally:
        for e in out:
            if e.proc is not None and e.proc.poll() is None:
                e.proc.terminate()
                e.proc.wait(timeout=30)


@contextlib.asynccontextmanager
async def routed(prefills: list[Engine], decodes: list[Engine], *args: str) -> AsyncIterator[str]:
    for e in prefills + decodes:
        await e.healthy()
    flags = [f for p in prefills for f in ("--prefill", f"{p.url}#bootstrap={p.bootstrap}")]
    flags += [f for d in decodes for f in ("--decode", d.url)]
    async with router(*flags, *args) as service:
        yield f"http://127.0.0.1:{service.args.port}"


async def stream_events(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/completions"
) -> AsyncIterator[Any]:
    async with http.post(f"{url}{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        buffer = b""
        async for chunk in resp.content.iter_any():
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                payload = event.removeprefix(b"data: ")
                yield "[DONE]" if payload == b"[DONE]" else orjson.loads(payload)


def tokens_of(events: list[Any], chat: bool) -> list[str]:
    """The text of each token event: `text`, or a chat delta's `content` (not the role's)."""
    out = []
    for e in events:
        if e == "[DONE]" or not e["choices"]:
            continue
        choice = e["choices"][0]
        if chat and "role" in choice["delta"]:
            continue
        out.append(choice["delta"].get("content", "") if chat else choice["text"])
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_a_decode_killed_mid_stream_is_resumed_token_for_token(chat: bool) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 60,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": "Resume me exactly where I stopped. " * 30}]
    else:
        body["prompt"] = "Resume me exactly where I stopped. " * 30
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with engines("prefill", "decode", "decode") as (prefill, *decodes):
        async with routed([prefill], decodes) as url, aiohttp.ClientSession() as http:
            # The unbroken answer, from a decode engine on its own.
            unbroken = [e async for e in stream_events(http, decodes[1].url, body, path)]
            events: list[Any] = []
            killed: Engine | None = None
            async for event in stream_events(http, url, body, path):
                events.append(event)
                if killed is None and len(events) == 10:
                    busy = next(b for b in (await backends(http, url))["decode"] if b["inflight_requests"])
                    killed = next(d for d in decodes if d.url == busy["url"])
                    killed.kill()
            async with http.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
    assert killed is not None
    assert tokens_of(events, chat) == tokens_of(unbroken, chat)
    assert len(tokens_of(events, chat)) == 60 and events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events if e != "[DONE]" and e["choices"]]
    assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None for c in choices)
    assert all(e.get("prompt_token_ids") is None for e in events if e != "[DONE]")
    assert len({e["id"] for e in events if e != "[DONE]"}) == 1, "one request id across both engines"
    assert {e["object"] for e in events if e != "[DONE]"} == {
        "chat.completion.chunk" if chat else "text_completion"
    }
    usage = next(e["usage"] for e in events if e != "[DONE]" and not e["choices"])
    assert usage == next(e["usage"] for e in unbroken if e != "[DONE]" and not e["choices"])
    assert counter(metrics, obs.ROUTER_RESUMED_STREAMS + "_total", outcome="resumed") == 1
    assert counter(metrics, obs.ROUTER_REQUESTS + "_total", outcome="ok") == 1


async def backends(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/backends") as resp:
        return await resp.json()


def request_number(record: dict[str, Any]) -> int:
    """The test's own number of a recorded request ("request <n>: ..."); -1 for another."""
    prompt = record["body"].get("prompt")
    head = prompt.partition(":")[0] if isinstance(prompt, str) else ""
    return int(head.removeprefix("request ")) if head.startswith("request ") else -1


async def recorded(http: aiohttp.ClientSession, engine: Engine) -> list[dict[str, Any]]:
    async with http.get(f"{engine.url}/sim/requests") as resp:
        return await resp.json()


@pytest.mark.parametrize("seed", [0])
async def test_prefills_killed_at_random_points_lose_no_request(seed: int) -> None:
    """Twenty rounds: six requests in flight, one prefill SIGKILLed after a random delay
    and started again (a new random engine id, as vLLM's). Every request completes with
    all its tokens; after the router has the new id, decode is never told the old one."""
    rng = random.Random(seed)
    body = {"model": MODEL, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    with engines("prefill", "prefill", "decode") as (*prefills, decode):
        async with routed(prefills, [decode], "--no-admission") as url, aiohttp.ClientSession() as http:

            async def one(i: int) -> dict[str, Any]:
                prompt = f"request {i}: " + "a long prompt to prefill " * rng.randint(20, 400)
                async with http.post(f"{url}/v1/completions", json={**body, "prompt": prompt}) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

            # engine id -> the number of the first request sent once the router had its successor
            dead: dict[str, int] = {}
            answers = 0
            for round_ in range(20):
                victim = prefills[round_ % 2]
                batch = [asyncio.ensure_future(one(round_ * 10 + i)) for i in range(6)]
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                old = {
                    b["engine_id"] for b in (await backends(http, url))["prefill"] if b["url"] == victim.url
                }
                victim.kill()
                for answer in await asyncio.gather(*batch):
                    assert answer["usage"]["completion_tokens"] == 12, answer
                    answers += 1
                victim.start()
                await victim.healthy()

                async def successor_known(old: set[str] = old) -> bool:
                    now = {b["engine_id"] for b in (await backends(http, url))["prefill"]}
                    return bool(now) and not now & old and len(now) == 2

                await wait_until(successor_known, interval=0.05, message="the router has the new engine id")
                for engine_id in old:
                    dead[engine_id] = round_ * 10 + 9
                await one(round_ * 10 + 9)  # one through the new engine
                answers += 1
            sent = await recorded(http, decode)
            async with http.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
    assert answers == 20 * 7
    # Ordered by what was sent, not by the clock: requests numbered from dead[id] on left
    # after the router knew the successor of engine `id`.
    stale = [
        r for r in sent
        if (r["body"].get("kv_transfer_params") or {}).get("remote_engine_id") in dead
        and request_number(r) >= dead[r["body"]["kv_transfer_params"]["remote_engine_id"]]
    ]  # fmt: skip
    assert any(request_number(r) >= 0 for r in sent)  # the numbers are read at all
    assert not stale, stale[:3]
    assert counter(metrics, obs.ROUTER_REQUESTS + "_total", outcome="upstream_error") == 0
    print(f"prefill retries: {counter(metrics, obs.ROUTER_RETRIES + '_total', role='prefill'):.0f}")


async def test_a_broken_hand_off_is_found_and_routed_around() -> None:
    body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    with engines("prefill", "prefill+faults", "decode") as (good, bad, decode):
        async with (
            routed([good, bad], [decode], "--no-admission", "--kv-probe-interval", "1") as url,
            aiohttp.ClientSession() as http,
        ):

            async def pairs(verdict: str) -> float:
                async with http.get(f"{url}/metrics") as resp:
                    return counter(await resp.text(), obs.ROUTER_KV_PAIRS, verdict=verdict)

            async def until(verdict: str, count: int) -> None:
                async def reached() -> bool:
                    return await pairs(verdict) == count

                await wait_until(reached, interval=0.1, message=f"{count} pairs {verdict}")

            await until("passed", 2)
            async with http.post(f"{bad.url}/sim/faults", json={"kv_send": "fail"}) as resp:
                assert resp.status == 200
            await until("failed", 1)
            # From here on the router knows the pair is broken: every request below is sent
            # after that (and none was sent before).
            for i in range(20):
                prompt = f"request {i}: " + "routed around a broken pair " * 20
                async with http.post(f"{url}/v1/completions", json={**body, "prompt": prompt}) as resp:
                    assert resp.status == 200, await resp.text()
            sent_to_bad = [
                r for r in await recorded(http, bad)
                if not r["headers"].get("X-Request-Id", "").startswith("kv-probe-")
            ]  # fmt: skip
            assert not sent_to_bad, sent_to_bad[:2]  # only probes went through the broken pair
            async with http.post(f"{bad.url}/sim/faults", json={"kv_send": "ok"}) as resp:
                assert resp.status == 200
            await until("passed", 2)
            async with http.get(f"{url}/metrics") as resp:
                text = await resp.text()
    assert counter(text, obs.ROUTER_KV_PROBES + "_total", outcome="failed") >= 2
    assert counter(text, obs.ROUTER_REQUESTS + "_total", outcome="ok") == 20


async def test_prompts_decode_computes_itself_do_not_fail_a_good_pair() -> None:
    """Short prompts go to decode alone (--prefill-on-decode-below), so decode's
    `local_compute` counter grows by more than a probe's prompt during every probe of the
    good pair; no pull fails meanwhile, so every probe passes and no pair leaves rotation."""
    short = {"model": MODEL, "max_tokens": 1, "temperature": 0}
    with engines("prefill", "decode") as (prefill, decode):
        async with (
            routed(
                [prefill], [decode], "--no-admission", "--kv-probe-interval", "0.5",
                "--prefill-on-decode-below", "4096",
            ) as url,
            aiohttp.ClientSession() as http,
        ):  # fmt: skip

            async def probes(outcome: str) -> float:
                async with http.get(f"{url}/metrics") as resp:
                    return counter(await resp.text(), obs.ROUTER_KV_PROBES + "_total", outcome=outcome)

            async def short_prompts(worker: int, rounds: int) -> None:
                for i in range(rounds):
                    prompt = f"request {worker}-{i}: " + "computed by decode alone " * 60
                    async with http.post(f"{url}/v1/completions", json={**short, "prompt": prompt}) as resp:
                        assert resp.status == 200, await resp.text()

            passed_before = await probes("passed")
            # Counted in probes, not seconds: until six more have run under this load.
            while await probes("passed") + await probes("failed") < passed_before + 6:
                await asyncio.gather(*(short_prompts(w, 5) for w in range(4)))
            failed, passed = await probes("failed"), await probes("passed")
            sent = await recorded(http, decode)
    assert any(request_number(r) == -1 and r["body"].get("kv_transfer_params") for r in sent)  # probes ran
    assert sum(1 for r in sent if r["body"]["prompt"][:8] == "request ") >= 20  # decode computed these
    assert failed == 0 and passed >= 6, (failed, passed)
