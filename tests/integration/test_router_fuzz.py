"""Malformed and random request bodies get a 4xx (or a normal answer), never a 5xx or a
crash, and the router keeps serving."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loopback import CONSUMER, PRODUCER, engine_url, prefill_url, router, simulator

FIELDS = [
    "prompt", "messages", "model", "max_tokens", "max_completion_tokens", "min_tokens", "n", "stream",
    "stream_options", "ignore_eos", "kv_transfer_params", "temperature", "stop", "request_id",
]  # fmt: skip
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | json_values},
        optional={"content": st.text(max_size=30) | json_values},
    ),
    max_size=4,
)
bodies = st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=12),
    json_values
    | st.text(max_size=200)
    | st.lists(st.integers(0, 50000), max_size=40)
    | messages
    | st.integers(1, 3000),
    max_size=8,
)


@pytest.fixture(scope="module")
async def router_url() -> AsyncIterator[str]:
    flags = ("--sim-profile", "zero", "--max-model-len", "4096")
    async with (
        simulator(*flags, "--kv-transfer-config", PRODUCER, model="m") as p,
        simulator(*flags, "--kv-transfer-config", CONSUMER, model="m") as d,
        router("--request-timeout", "10", "--prefill", prefill_url(p), "--decode", engine_url(d)) as service,
    ):
        yield f"http://127.0.0.1:{service.args.port}"


async def send(url: str, path: str, data: bytes) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, data=data, headers={"Content-Type": "application/json"}) as resp,
    ):
        return resp.status, await resp.read()


def check(status: int, raw: bytes) -> None:
    assert status < 500, raw[:500]
    if status >= 400:
        error = orjson.loads(raw)["error"]
        assert error["code"] == status and isinstance(error["message"], str)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, chat=st.booleans())
async def test_random_json_bodies(router_url: str, body: dict[str, Any], chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    check(*await send(router_url, path, json.dumps(body).encode()))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=300))
async def test_random_bytes(router_url: str, raw: bytes) -> None:
    check(*await send(router_url, "/v1/completions", raw))


async def test_still_healthy_after_fuzzing(router_url: str) -> None:
    status, raw = await send(router_url, "/v1/completions", orjson.dumps({"prompt": "x", "max_tokens": 3}))
    assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == 3
