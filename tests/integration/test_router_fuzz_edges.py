"""What tests/integration/test_router_fuzz.py leaves out: each known field missing or of a
wrong type (a 400 naming it), huge prompts and bodies, invalid UTF-8 and lone surrogates,
and clients that leave at any point of the exchange. Throughout: JSON errors, never a
5xx, and no request left running on an engine or counted in flight by the router."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loopback import CONSUMER, PRODUCER, engine_url, prefill_url, router, simulator, wait_until

from pdcluster.enginesim.main import Simulator
from pdcluster.router.main import RouterService
from pdcluster.router.server import MAX_BODY_BYTES


@dataclass
class Stack:
    prefill: Simulator
    decode: Simulator
    service: RouterService
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def busy(self) -> list[str]:
        """Whatever is still in flight anywhere (empty when everything has ended)."""
        router = self.service.router
        pool = self.service.pool
        assert router is not None and pool is not None
        out = [
            f"{sim.config.role} engine: {sim.cores[0].load}"
            for sim in (self.prefill, self.decode)
            if sim.cores[0].load
        ]
        if router.inflight:
            out.append(f"router: {router.inflight} in flight")
        out += [
            f"{u.id}: {u.inflight_requests} requests" for u in pool.all_upstreams() if u.inflight_requests
        ]
        return out


@pytest.fixture(scope="module")
async def stack() -> AsyncIterator[Stack]:
    # Real-time decode (~6 ms a token), so a client can leave in the middle of a stream.
    context = ("--max-model-len", "4096")
    async with (
        simulator(*context, "--kv-transfer-config", PRODUCER, "--sim-profile", "zero", model="m") as p,
        simulator(*context, "--kv-transfer-config", CONSUMER, model="m") as d,
        router(
            "--request-timeout", "30", "--no-admission", "--prefill", prefill_url(p), "--decode", engine_url(d)
        ) as service,
    ):  # fmt: skip
        yield Stack(p, d, service, service.args.port)


async def post(url: str, data: bytes, path: str = "/v1/completions") -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, data=data, headers={"Content-Type": "application/json"}) as resp,
    ):
        return resp.status, await resp.read()


def json_error(status: int, raw: bytes) -> dict[str, Any]:
    assert 400 <= status < 500, (status, raw[:300])
    error = orjson.loads(raw)["error"]
    assert error["code"] == status and isinstance(error["message"], str)
    return error


async def settled(stack: Stack, timeout: float = 30.0) -> None:
    """Nothing left in flight once the ends have reached every part: no leaked engine or
    router request. The deadline only ends a leak's wait; it bounds no measured time."""
    await wait_until(
        lambda: not stack.busy(), timeout=timeout, interval=0.05, message="nothing left in flight"
    )


# ---------------------------------------------------------------------- fields
VALID = {
    False: {"prompt": "hi", "model": "m", "max_tokens": 2, "min_tokens": 0, "n": 1, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "kv_transfer_params": {}},
    True: {"messages": [{"role": "user", "content": "hi"}], "model": "m", "max_completion_tokens": 2,
           "n": 1, "stream": False, "ignore_eos": False},
}  # fmt: skip
int64 = st.integers(-(2**63), 2**63 - 1)  # what JSON parsers take as integers
anything = st.one_of(
    st.booleans(), int64, st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
    st.lists(int64, max_size=3), st.dictionaries(st.text(max_size=3), int64, max_size=2),
)  # fmt: skip
WRONG = {
    "prompt": anything.filter(lambda v: not isinstance(v, str) and not (isinstance(v, list) and v and all(isinstance(t, int) and 0 <= t < 2**31 for t in v))),
    "messages": anything,
    "model": anything.filter(lambda v: not isinstance(v, str)),
    "max_tokens": anything.filter(lambda v: not (isinstance(v, int) and not isinstance(v, bool) and v >= 1)),
    "max_completion_tokens": anything.filter(lambda v: not (isinstance(v, int) and not isinstance(v, bool) and v >= 1)),
    "min_tokens": anything.filter(lambda v: not (isinstance(v, int) and not isinstance(v, bool) and v >= 0)),
    "n": anything.filter(lambda v: not (isinstance(v, int) and not isinstance(v, bool) and v >= 1)),
    "stream": anything.filter(lambda v: not isinstance(v, bool)),
    "ignore_eos": anything.filter(lambda v: not isinstance(v, bool)),
    "stream_options": anything.filter(lambda v: not isinstance(v, dict)),
    "kv_transfer_params": anything.filter(lambda v: not isinstance(v, dict)),
}  # fmt: skip


@st.composite
def one_field_wrong(draw: st.DrawFn) -> tuple[bool, dict[str, Any], str]:
    chat = draw(st.booleans())
    body = dict(VALID[chat])
    field = draw(st.sampled_from(sorted(set(body) & set(WRONG))))
    if draw(st.booleans()) and field in ("prompt", "messages"):
        del body[field]  # missing
    else:
        body[field] = draw(WRONG[field])
    return chat, body, field


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=one_field_wrong())
async def test_a_missing_or_mistyped_field_is_a_400_naming_it(
    stack: Stack, case: tuple[bool, dict, str]
) -> None:
    chat, body, field = case
    path = "/v1/chat/completions" if chat else "/v1/completions"
    error = json_error(*await post(stack.url, orjson.dumps(body), path))
    assert error["code"] == 400 and error["param"] == field, (body, error)


# ---------------------------------------------------------------------- size and encoding
async def test_huge_prompts_and_bodies(stack: Stack) -> None:
    # 10 MB of prompt: the engine refuses it for its context length; the router relays that.
    error = json_error(*await post(stack.url, orjson.dumps({"prompt": "x" * 10_000_000, "max_tokens": 1})))
    assert "context length" in error["message"]
    ids = orjson.dumps({"prompt": list(range(1_000_000)), "max_tokens": 1})
    assert "context length" in json_error(*await post(stack.url, ids))["message"]
    many = [{"role": "user", "content": "hi"}] * 200_000
    status, raw = await post(stack.url, orjson.dumps({"messages": many}), "/v1/chat/completions")
    json_error(status, raw)
    # Over the router's body limit: refused before anything is parsed.
    status, raw = await post(stack.url, b'{"prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}')
    assert json_error(status, raw)["code"] == 413
    await settled(stack)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\xff\xfe"}',
        b'{"prompt": "ok", "model": "\xc3\x28"}',
        b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # an encoded surrogate
        b'{"prompt": "\\ud800 lone surrogate"}',
        b'{"prompt": "ok", "stop": "\\udfff"}',
        b'{"prompt": "\xf4\x90\x80\x80"}',  # beyond U+10FFFF
    ],
)
async def test_invalid_utf8_and_surrogates(stack: Stack, raw: bytes) -> None:
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    status, answer = await post(stack.url, raw, path)
    assert status < 500, answer[:300]
    if status >= 400:
        json_error(status, answer)
    await settled(stack)


async def test_non_ascii_request_id_header(stack: Stack) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
    body = orjson.dumps({"prompt": "hi", "max_tokens": 2})
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: \xff\xfe\xc3\x28\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    status = int(head.split(b" ", 2)[1])
    assert status in (200, 400), head
    await settled(stack)


# ---------------------------------------------------------------------- clients that leave
# Each would run ~13 s to its end: what is still running 3 s after the client left leaked.
REQUESTS = [
    ("/v1/completions", {"prompt": "word " * 300, "max_tokens": 2000, "ignore_eos": True, "stream": True}),
    ("/v1/completions", {"prompt": "word " * 300, "max_tokens": 2000, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2000,
                              "ignore_eos": True, "stream": True}),
]  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    which=st.sampled_from(range(len(REQUESTS))),
    sent=st.just(1.0) | st.floats(0.0, 0.999),
    read=st.integers(0, 4000),
    wait=st.floats(0.0, 0.5),
)
async def test_clients_leaving_at_any_point_leak_nothing(
    stack: Stack, which: int, sent: float, read: int, wait: float
) -> None:
    """The client sends a fraction of the request (all of it when `sent` is 1), waits,
    reads `read` bytes of the answer and closes the connection."""
    path, body = REQUESTS[which]
    data = orjson.dumps(body)
    message = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
    writer.write(message if sent >= 1.0 else message[: int(len(message) * sent)])
    await writer.drain()
    await asyncio.sleep(wait)
    if sent >= 1.0 and read:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            await asyncio.wait_for(reader.readexactly(read), 10)
    writer.transport.abort()  # a reset, not a polite close
    await settled(stack)


async def test_still_serving_after_all_that(stack: Stack) -> None:
    status, raw = await post(stack.url, orjson.dumps({"prompt": "x", "max_tokens": 3}))
    assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == 3
    await settled(stack)
