"""`n` > 1 and batched prompts through prefill/decode, with the official OpenAI Python SDK
against the real router and engine simulators on loopback. The simulators serve one
prompt and n = 1 per request, as a check that the router fans out; their answers depend
on the prompt alone (greedy), so each choice's text is known from a plain request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from loopback import counter, wait_until
from test_router_pd import cluster, recorded
from test_router_retries import Engine, backends, engines, routed, stream_events

from pdcluster import observability as obs

MODEL = "sim-model"
PROMPTS = ["The first prompt of the batch", "A second, rather longer prompt of the batch"]
MESSAGES = [{"role": "user", "content": "Tell me about prefill and decode."}]


@pytest.fixture
async def sdk() -> AsyncIterator[tuple[openai.AsyncOpenAI, Any]]:
    async with cluster() as c:
        client = openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)
        try:
            yield client, c
        finally:
            await client.close()


async def _plain(client: openai.AsyncOpenAI, prompt: Any) -> Any:
    return await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)


async def test_completions_n_and_batch_non_stream(sdk: tuple[openai.AsyncOpenAI, Any]) -> None:
    client, c = sdk
    plain = [await _plain(client, p) for p in PROMPTS]
    answer = await client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=8, temperature=0)
    assert [ch.index for ch in answer.choices] == [0, 1, 2, 3]
    # Choice j of prompt i is index i * n + j, as OpenAI and vLLM number them.
    assert [ch.text for ch in answer.choices] == [plain[0].choices[0].text] * 2 + [plain[1].choices[0].text] * 2
    assert all(ch.finish_reason == plain[0].choices[0].finish_reason for ch in answer.choices)
    assert answer.usage is not None and plain[0].usage is not None and plain[1].usage is not None
    assert answer.usage.prompt_tokens == plain[0].usage.prompt_tokens + plain[1].usage.prompt_tokens
    assert answer.usage.completion_tokens == 2 * (plain[0].usage.completion_tokens + plain[1].usage.completion_tokens)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    async with aiohttp.ClientSession() as http:
        records = await recorded(http, c.decode)
        prefills = await recorded(http, c.prefill)
    fanned = records[2:]  # after the two plain requests
    assert len(fanned) == 4 and all(r["body"]["n"] == 1 for r in fanned)
    assert sorted(r["body"]["prompt"] for r in fanned) == sorted(PROMPTS * 2)
    assert len(prefills) == 6, "one prefill per flow: a prefill's KV feeds one decode"
    assert len({r["headers"]["X-Request-Id"] for r in fanned}) == 4


async def test_completions_token_id_prompts(sdk: tuple[openai.AsyncOpenAI, Any]) -> None:
    client, _ = sdk
    ids = [[101, 102, 103, 104], [201, 202]]
    plain = [await _plain(client, p) for p in ids]
    answer = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [(ch.index, ch.text) for ch in answer.choices] == [(i, p.choices[0].text) for i, p in enumerate(plain)]


async def test_completions_stream_interleaves_choices_under_one_id(sdk: tuple[openai.AsyncOpenAI, Any]) -> None:
    client, _ = sdk
    whole = await client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=12, temperature=0)
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPTS, n=2, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    ids, usages = set(), []
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    assert len(ids) == 1
    assert texts == {ch.index: ch.text for ch in whole.choices}
    assert finish == {ch.index: ch.finish_reason for ch in whole.choices}
    assert usages == [whole.usage], "one usage chunk, summed as the non-streamed answer's"


async def test_chat_n_non_stream_and_stream(sdk: tuple[openai.AsyncOpenAI, Any]) -> None:
    client, _ = sdk
    plain = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    answer = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, max_tokens=10, temperature=0
    )
    assert [ch.index for ch in answer.choices] == [0, 1, 2]
    assert {ch.message.content for ch in answer.choices} == {plain.choices[0].message.content}
    assert {ch.message.role for ch in answer.choices} == {"assistant"}
    assert answer.usage is not None and plain.usage is not None
    assert answer.usage.prompt_tokens == plain.usage.prompt_tokens
    assert answer.usage.completion_tokens == 3 * plain.usage.completion_tokens
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, max_tokens=10, temperature=0, stream=True
    )
    texts: dict[int, str] = {}
    roles: dict[int, int] = {}
    ids = set()
    async for chunk in stream:
        ids.add(chunk.id)
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            roles[ch.index] = roles.get(ch.index, 0) + (ch.delta.role is not None)
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert texts == {i: plain.choices[0].message.content for i in range(3)}
    assert roles == {0: 1, 1: 1, 2: 1}, "one role chunk per choice"


async def test_raw_stream_has_one_done(sdk: tuple[openai.AsyncOpenAI, Any]) -> None:
    _, c = sdk
    body = {"model": MODEL, "prompt": PROMPTS, "n": 2, "max_tokens": 6, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(f"{c.url}/v1/completions", json=body) as resp:
        raw = await resp.read()
    assert resp.status == 200
    assert raw.count(b"data: [DONE]") == 1 and raw.endswith(b"data: [DONE]\n\n")


async def test_fan_out_over_the_cap_is_refused(sdk: tuple[openai.AsyncOpenAI, Any]) -> None:
    client, _ = sdk
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=MODEL, prompt=PROMPTS, n=9, max_tokens=4)
    assert "needs 18 prefill/decode flows" in str(refused.value)
    assert "at most 16" in str(refused.value)


async def test_a_flow_the_engine_refuses_fails_the_request_naming_it(sdk: tuple[openai.AsyncOpenAI, Any]) -> None:
    client, _ = sdk
    too_long = "word " * 200_000  # past the simulator's context
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=MODEL, prompt=["short", too_long], max_tokens=4)
    assert "prompt 1, choice 0: This model's maximum context length" in str(refused.value)


def _tokens(events: list[Any]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for e in events:
        if e == "[DONE]":
            continue
        for ch in e.get("choices", []):
            out.setdefault(ch["index"], []).append(ch["text"])
    return out


async def _kill_a_busy_decode(http: aiohttp.ClientSession, url: str, decodes: list[Engine]) -> Engine:
    busy = next(b for b in (await backends(http, url))["decode"] if b["inflight_requests"])
    victim = next(d for d in decodes if d.url == busy["url"])
    victim.kill()
    return victim


async def test_each_flow_resumes_on_another_decode_token_for_token() -> None:
    body = {"model": MODEL, "prompt": "Resume every choice. " * 30, "n": 2, "max_tokens": 50,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    with engines("prefill", "decode", "decode") as (prefill, *decodes):
        async with routed([prefill], decodes) as url, aiohttp.ClientSession() as http:
            single = {**body, "n": 1}
            unbroken = [e async for e in stream_events(http, decodes[1].url, single)]
            events: list[Any] = []
            async for event in stream_events(http, url, body):
                events.append(event)
                if len(events) == 10:
                    await _kill_a_busy_decode(http, url, decodes)
            async with http.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
    expected = _tokens(unbroken)[0]
    assert _tokens(events) == {0: expected, 1: expected}, "no token lost or repeated in either choice"
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert counter(metrics, obs.ROUTER_RESUMED_STREAMS + "_total", outcome="resumed") >= 1


async def test_a_flow_failing_mid_stream_ends_the_stream_with_an_error() -> None:
    body = {"model": MODEL, "prompt": ["One choice. " * 20, "Another. " * 20], "max_tokens": 50,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    with engines("prefill", "decode") as (prefill, decode):
        async with routed([prefill], [decode]) as url, aiohttp.ClientSession() as http:
            events: list[Any] = []
            async for event in stream_events(http, url, body):
                events.append(event)
                if len(events) == 10:
                    decode.kill()  # no other decode to resume on
    errors = [e for e in events if e != "[DONE]" and "error" in e]
    assert len(errors) == 1 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert "flows failed: prompt " in errors[0]["error"]["message"]
    assert events.index(errors[0]) == len(events) - 2, "nothing after the error but [DONE]"


async def test_the_request_timeout_ends_a_fanned_out_stream_once() -> None:
    body = {"model": MODEL, "prompt": "Too long to finish. " * 10, "n": 2, "max_tokens": 400,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with engines("prefill", "decode") as (prefill, decode):
        async with routed([prefill], [decode], "--request-timeout", "1") as url, aiohttp.ClientSession() as http:
            events = [e async for e in stream_events(http, url, body)]
    errors = [e for e in events if e != "[DONE]" and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == 504
    assert events[-2:] == [errors[0], "[DONE]"] and events.count("[DONE]") == 1
    assert _tokens(events), "the stream had started before the timeout"


async def test_a_client_leaving_cancels_every_flow() -> None:
    # Minutes of tokens at this pace: only cancelling the flows ends them within the wait.
    body = {"model": MODEL, "prompt": ["Leave early. " * 10, "And here. " * 10], "n": 2, "max_tokens": 3000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with engines("prefill", "decode", "decode") as (prefill, *decodes):
        async with routed([prefill], decodes) as url, aiohttp.ClientSession() as http:
            async with aiohttp.ClientSession() as client, client.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readuntil(b"\n\n")  # the stream has started: then the client goes

            async def nothing_in_flight() -> bool:
                view = await backends(http, url)
                return all(b["inflight_requests"] == 0 for role in ("prefill", "decode") for b in view[role])

            await wait_until(nothing_in_flight, timeout=30, interval=0.05, message="every flow cancelled")

            async def engines_idle() -> bool:
                for engine in decodes:
                    async with http.get(f"{engine.url}/metrics") as resp:
                        if counter(await resp.text(), obs.VLLM_RUNNING) != 0:
                            return False
                return True

            await wait_until(engines_idle, timeout=30, interval=0.05, message="the engines aborted every flow")


async def test_a_prompts_choices_are_prefilled_from_its_first_choices_cache() -> None:
    prompt = "A long shared prompt for every choice. " * 40
    caching = ("--sim-time-scale", "0.1", "--enable-prefix-caching")  # prefills that take time
    async with cluster(prefill_args=caching) as c, aiohttp.ClientSession() as http:
        client = openai.AsyncOpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)

        async def prefix_hits() -> float:
            async with http.get(f"http://127.0.0.1:{c.prefill.config.port}/metrics") as resp:
                return counter(await resp.text(), obs.VLLM_PREFIX_HITS + "_total")

        before = await prefix_hits()
        answer = await client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=4)
        hits = await prefix_hits() - before
        await client.close()
    assert len(answer.choices) == 4 and answer.usage is not None
    # The three later choices find the prompt's whole blocks in prefill's cache.
    whole_blocks = answer.usage.prompt_tokens // 16 * 16
    assert hits >= 3 * whole_blocks - 3 * 16, f"{hits} prompt tokens hit prefill's cache"


async def test_a_flow_refused_by_slo_admission_refuses_the_request_with_retry_after() -> None:
    # As test_router_pd.py's admission test: a 2000-token prompt is admitted alone on the
    # prefill; the second prompt's flow, routed while the first's is queued, is not.
    admission = ("--admission-ttft-ms", "10", "--admission-reject-factor", "1", "--admission-prefill-rate", "1000")
    async with cluster(*admission, prefill_args=("--sim-time-scale", "1")) as c, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": ["x" * 8000, "y" * 8000], "max_tokens": 2}
        async with http.post(f"{c.url}/v1/completions", json=body) as resp:
            status, answer, retry_after = resp.status, await resp.json(), resp.headers.get("Retry-After")
    assert status == 429 and answer["error"]["type"] == "RateLimitError"
    assert "prompt 1, choice 0: predicted time to first token" in answer["error"]["message"]
    assert retry_after is not None and int(retry_after) >= 1
