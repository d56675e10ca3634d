"""Client traffic for the chaos runs (tests/e2e/test_chaos.py, benchmarks/chaos.py):
streamed and whole completions through the router, each answer compared with the answer
the same prompt got before any fault, so that a token lost or sent twice shows. Plain
code, no pytest."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# The router's answer when no engine of a role is ready (router/server.py _NO_BACKEND).
NO_BACKEND = "no ready prefill and decode backends"
# The router and the pod runner see pods a little after the apiserver: a 503 counts as "no
# engine of a role" when a role had none this close to the request.
NO_ENGINE_SLACK_S = 3.0
# Connection errors before any answer began, which clients behind a Service retry (the
# OpenAI SDK retries connection errors by default): a router pod that goes away can close a
# kept-alive connection just as the client sends on it, and nothing of the request was read.
RETRYABLE = ("ClientConnectorError", "ServerDisconnectedError", "ClientOSError")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def prompts(count: int, seed: int = 1) -> list[str]:
    """Distinct prompts of about 200 words."""
    rng = random.Random(seed)
    return [f"question {i}: " + " ".join(rng.choice(WORDS) for _ in range(200)) for i in range(count)]


@dataclass
class Answer:
    request_id: str
    stream: bool
    prompt: int  # index into the prompts
    sent: float  # time.monotonic()
    ended: float
    status: int
    text: str = ""
    error: str = ""  # empty when the answer arrived whole (200, [DONE] for a stream)
    retried: str = ""  # the connection error of a first try that got no answer, retried once


async def ask(
    http: aiohttp.ClientSession, url: str, request_id: str, prompt: str, max_tokens: int, stream: bool
) -> tuple[int, str, str]:
    """(status, text, error) of one completion; greedy, so that the same prompt gets the
    same answer from any engine."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}) as r:
            status = r.status
            try:
                raw = await r.read()
            except (aiohttp.ClientError, TimeoutError) as e:  # cut after the answer began: lost
                return status, "", f"{type(e).__name__} after the answer began: {e}"[:200]
    except (aiohttp.ClientError, TimeoutError) as e:
        return 0, "", f"{type(e).__name__}: {e}"[:200]
    if status != 200:
        return status, "", raw[:200].decode(errors="replace")
    try:
        if not stream:
            return status, json.loads(raw)["choices"][0]["text"], ""
        events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
        if not events or events[-1] != b"[DONE]":
            return status, "", "stream cut off before [DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
    except (ValueError, KeyError, IndexError):
        return status, "", f"malformed: {raw[:200]!r}"
    if errors := [c for c in chunks if "error" in c]:
        return status, "", json.dumps(errors[0])[:200]
    return status, "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), ""


@dataclass
class Verdicts:
    """What became of the requests, by kind of outcome."""

    sent: int = 0
    streamed: int = 0  # of those sent, streamed ones
    whole: int = 0
    no_engine: int = 0  # 503 while a role had no engine at all: not counted as lost
    retried: int = 0  # sent again after a connection error with no answer begun, as clients do
    duplicated: int = 0  # more tokens than asked, or a token repeated
    tokens_lost: int = 0  # tokens missing from the answers that came back short or not at all
    failed: Counter[str] = field(default_factory=Counter)  # why, for each lost request

    @property
    def lost(self) -> int:
        return sum(self.failed.values())

    def line(self) -> str:
        why = ", ".join(f"{n} {reason}" for reason, n in self.failed.most_common()) or "none"
        return (
            f"{self.sent} sent ({self.streamed} streamed), {self.whole} whole, {self.lost} lost ({why}), {self.duplicated} duplicated, "
            f"{self.tokens_lost} tokens lost, {self.no_engine} answered 503 while a role had no engine, "
            f"{self.retried} retried after a connection error before any answer"
        )


def judge(
    answers: list[Answer], references: list[str], no_engine_at: list[float], max_tokens: int
) -> Verdicts:
    """Each answer against its prompt's reference answer. `no_engine_at`: the times at
    which some role had no ready engine."""
    v = Verdicts(
        sent=len(answers),
        streamed=sum(a.stream for a in answers),
        retried=sum(bool(a.retried) for a in answers),
    )
    for a in answers:
        words, reference = a.text.split(), references[a.prompt].split()
        if not a.error and a.status == 200 and words == reference:
            v.whole += 1
        elif not a.error and a.status == 200 and len(words) > len(reference):
            v.duplicated += 1
        elif a.status == 503 and NO_BACKEND in a.error and _near(no_engine_at, a.sent, a.ended):
            v.no_engine += 1
        else:
            v.failed[_reason(a, words, reference)] += 1
            v.tokens_lost += max_tokens - len(_common_prefix(words, reference))
    return v


def _near(times: list[float], start: float, end: float) -> bool:
    return any(start - NO_ENGINE_SLACK_S <= t <= end + NO_ENGINE_SLACK_S for t in times)


def _common_prefix(a: list[str], b: list[str]) -> list[str]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _reason(a: Answer, words: list[str], reference: list[str]) -> str:
    if a.error:
        return f"{a.status or 'no answer'}: {a.error[:80]}"
    if len(_common_prefix(words, reference)) == len(words):
        return "answer cut short"
    return "answer differs from the reference"


class MixedLoad:
    """`streams` clients sending streamed completions and `wholes` sending whole ones, back
    to back, each with a prompt drawn from `prompt_texts`, until stop()."""

    def __init__(
        self, url: str, prompt_texts: list[str], max_tokens: int, streams: int, wholes: int, seed: int
    ):
        self.url = url
        self.prompts = prompt_texts
        self.max_tokens = max_tokens
        self.answers: list[Answer] = []
        self._kinds = [True] * streams + [False] * wholes
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = 0
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> MixedLoad:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        self._tasks = [asyncio.create_task(self._client(stream)) for stream in self._kinds]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _client(self, stream: bool) -> None:
        assert self._http is not None
        while not self._stop.is_set():
            self._seq += 1
            request_id = f"{'s' if stream else 'w'}-{self._seq}"
            index = self._rng.randrange(len(self.prompts))
            sent = time.monotonic()
            status, text, error = await ask(
                self._http, self.url, request_id, self.prompts[index], self.max_tokens, stream
            )
            retried = ""
            if status == 0 and error.startswith(RETRYABLE):
                retried = error
                status, text, error = await ask(
                    self._http, self.url, f"{request_id}-retry", self.prompts[index], self.max_tokens, stream
                )
            self.answers.append(
                Answer(request_id, stream, index, sent, time.monotonic(), status, text, error, retried)
            )

    async def stop(self) -> list[Answer]:
        """Stop sending and wait for the requests in flight."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        if self._http is not None:
            await self._http.close()
            self._http = None
        return self.answers


async def references(url: str, prompt_texts: list[str], max_tokens: int) -> list[str]:
    """The answer of each prompt on the healthy cluster."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for i, prompt in enumerate(prompt_texts):
            status, text, error = await ask(http, url, f"reference-{i}", prompt, max_tokens, stream=False)
            assert status == 200 and not error and len(text.split()) == max_tokens, (status, error, text)
            out.append(text)
    return out
