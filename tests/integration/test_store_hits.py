"""Prompt hits end to end on loopback: engine simulators running the store connector the
operator renders (MultiConnector: MooncakeConnector + MooncakeStoreConnector) against a
real mooncake_master, behind the real router. A prompt whose prefix the store holds goes
straight to decode; a partial hit, a miss and a master that is down take the prefill
path; every request completes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from loopback import MasterProcess, counter, free_port, mooncake_master, router, wait_until

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.render.engine import kv_transfer_config
from pdcluster.router.prompt import token_ids
from pdcluster.vllm.hashing import block_keys

MAX_COMPUTED = 256  # --store-max-computed-tokens
SYSTEM = "You are a careful assistant for a storage team. " * 160  # about 2,000 tokens
MAX_TOKENS = 8


@pytest.fixture
def master() -> Any:
    with mooncake_master() as m:
        if m is None:
            pytest.skip("mooncake_master is not installed or does not start here")
        yield m


SIM = str(Path(sys.executable).parent / "pdcluster-engine-sim")
MODEL = "sim-model"
BLOCK = 16  # the simulator's --block-size default, vLLM's


@contextlib.contextmanager
def engine(kv_config: str, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """An engine simulator as its own process (a store client that outlives a master
    crash is not safe to keep in the test's process); yields (URL, bootstrap port)."""
    port, bootstrap = free_port(), free_port()
    proc = subprocess.Popen(
        [SIM, "serve", MODEL, "--host", "127.0.0.1", "--port", str(port), "--sim-profile", "zero",
         "--kv-transfer-config", kv_config],
        env={**os.environ, **env, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}", bootstrap
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def healthy(url: str) -> None:
    async with aiohttp.ClientSession() as http:

        async def answers() -> bool:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/health") as resp:
                    return resp.status == 200
            return False

        await wait_until(answers, timeout=60, interval=0.1, message=f"{url} healthy")


@pytest.fixture
async def pool(master: MasterProcess, tmp_path: Path) -> AsyncIterator[Any]:
    config = tmp_path / "engine.json"
    config.write_text(
        json.dumps(
            {
                "mode": "embedded",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master.rpc,
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": 64 << 20,
                "local_buffer_size": 16 << 20,
            }
        )
    )
    env = {"MOONCAKE_CONFIG_PATH": str(config), "PYTHONHASHSEED": "0"}
    spec = PDClusterSpec.model_validate({"model": {"name": "m"}, "mooncake": {"store": {"enabled": True}}})
    connector = {role: json.dumps(kv_transfer_config(spec, role)) for role in C.ENGINE_ROLES}
    with (
        engine(connector[C.ROLE_PREFILL], env) as (p, bootstrap),
        engine(connector[C.ROLE_DECODE], env) as (d, _),
    ):
        await healthy(p)
        await healthy(d)
        async with router(
            "--prefill", f"{p}#bootstrap={bootstrap}",
            "--decode", d,
            "--store-master", master.http,
            "--hash-seed", "0",
            "--store-max-computed-tokens", str(MAX_COMPUTED),
        ) as r:  # fmt: skip
            yield p, d, f"http://127.0.0.1:{r.args.port}", master


async def metrics(http: aiohttp.ClientSession, base: str) -> str:
    async with http.get(f"{base}/metrics") as resp:
        return await resp.text()


async def stored(master: MasterProcess, prompt: str) -> None:
    """Until the master holds the prompt's last full block: the prefill writes its
    blocks after answering."""
    keys = block_keys(token_ids(prompt), BLOCK, MODEL, "0")
    async with aiohttp.ClientSession() as http:

        async def held() -> bool:
            async with http.get(f"{master.http}/batch_query_keys?keys={keys[-1]}") as resp:
                return bool((await resp.json(content_type=None))["data"][keys[-1]]["ok"])

        await wait_until(held, interval=0.05, message="the prompt's last block in the store")


async def test_stored_prefixes_skip_prefill_and_nothing_else_fails(pool: Any) -> None:
    p, d, base, master = pool
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def complete(prompt: str) -> dict[str, Any]:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
            assert answer["usage"]["completion_tokens"] == MAX_TOKENS  # nothing lost
            return answer

        async def engines() -> tuple[str, str, str]:
            return (
                await metrics(http, p),
                await metrics(http, d),
                await metrics(http, base),
            )

        # A miss: the ordinary path; prefill computes all of it and writes its blocks.
        await complete(SYSTEM + "Question one?")
        await stored(master, SYSTEM + "Question one?")
        pm, dm, rm = await engines()
        assert counter(rm, "pdcluster_router_store_lookups_total", outcome="miss") == 1
        prefill_computed = counter(pm, "vllm:prompt_tokens_by_source_total", source="local_compute")
        assert prefill_computed > 1900

        # A hit: the same system prompt and a short question go straight to decode,
        # which loads the stored prefix and computes the rest.
        await complete(SYSTEM + "Question two?")
        pm2, dm2, rm2 = await engines()
        assert counter(rm2, "pdcluster_router_store_lookups_total", outcome="hit") == 1
        assert counter(rm2, "pdcluster_router_prefill_bypassed_total") == 1
        assert counter(pm2, "vllm:prompt_tokens_by_source_total", source="local_compute") == prefill_computed
        loaded = counter(dm2, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - counter(
            dm, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        computed = counter(dm2, "vllm:prompt_tokens_by_source_total", source="local_compute") - counter(
            dm, "vllm:prompt_tokens_by_source_total", source="local_compute"
        )
        assert loaded >= 1900 and 0 < computed <= MAX_COMPUTED, (loaded, computed)
        assert counter(rm2, "pdcluster_router_store_prefix_tokens_total") == loaded

        # A partial hit: too much left to compute for decode; prefill loads the prefix
        # from the store itself and computes only the long question.
        long_question = "Explain each step in detail please. " * 80  # about 720 tokens
        await complete(SYSTEM + long_question)
        pm3, _, rm3 = await engines()
        assert counter(rm3, "pdcluster_router_store_lookups_total", outcome="partial") == 1
        assert counter(rm3, "pdcluster_router_prefill_bypassed_total") == 1
        assert counter(pm3, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= 1900
        added = counter(pm3, "vllm:prompt_tokens_by_source_total", source="local_compute") - prefill_computed
        assert 0 < added < 1000, added

        # A prompt the store never saw: a miss.
        await complete("A prompt the store never saw. " * 40)
        assert counter(await metrics(http, base), "pdcluster_router_store_lookups_total", outcome="miss") == 2


async def test_a_master_that_is_down_costs_no_request(pool: Any) -> None:
    _, _, base, master = pool
    master.stop()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for i in range(3):
            body = {"prompt": SYSTEM + f"Question {i}?", "max_tokens": MAX_TOKENS, "ignore_eos": True}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["usage"]["completion_tokens"] == MAX_TOKENS
        text = await metrics(http, base)
    assert counter(text, "pdcluster_router_store_lookups_total", outcome="error") == 3
    assert counter(text, "pdcluster_router_prefill_bypassed_total") == 0
    assert master.start()  # back, so the engines' teardown need not wait out a dead master
