"""Resuming a stream: what the router keeps of a completion stream, what it hides from the
client, and the request for the rest (router/resume.py). vLLM's event shapes are those
of vllm==0.32.0 completion/serving.py with `return_token_ids`."""

from __future__ import annotations

import orjson
import pytest

from pdcluster.router.membership import COOLDOWN_MAX_S, COOLDOWN_S, OPEN_AFTER_FAILURES, Upstream
from pdcluster.router.resume import TokenTrail, fix_usage, resumable


def event(text: str, ids: list[int], prompt: list[int] | None = None, finish: str | None = None) -> bytes:
    choice = {
        "index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
        "prompt_token_ids": prompt, "token_ids": ids,
    }  # fmt: skip
    payload = {"id": "cmpl-r1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def plain(text: str, finish: str | None = None) -> bytes:
    """The same event as vLLM writes it when ids were not asked for."""
    return event(text, None, None, finish)  # type: ignore[arg-type]


def test_ids_are_kept_and_the_client_sees_the_stream_it_asked_for() -> None:
    trail = TokenTrail(client_wants_ids=False)
    out = trail.relay(event(" a", [7], prompt=[1, 2, 3]) + event(" b", [8]))
    assert out == plain(" a") + plain(" b")
    assert trail.prompt == [1, 2, 3] and trail.generated == [7, 8]


def test_a_client_that_asked_for_ids_gets_them() -> None:
    trail = TokenTrail(client_wants_ids=True)
    chunk = event(" a", [7], prompt=[1, 2])
    assert trail.relay(chunk) == chunk and trail.generated == [7]


@pytest.mark.parametrize("cut", [1, 10, 40, 97])
def test_a_split_event_is_held_until_it_ends(cut: int) -> None:
    """An engine that dies mid-event sends no half token: only whole events go out."""
    trail = TokenTrail(client_wants_ids=False)
    whole = event(" a", [7], prompt=[1]) + event(" bc", [8, 9])
    first = trail.relay(whole[:cut])
    second = trail.relay(whole[cut:])
    assert first + second == plain(" a") + plain(" bc")
    assert first in (b"", plain(" a"))
    assert trail.generated == [7, 8, 9]


def test_the_continuation_asks_for_the_rest_from_prompt_and_tokens_sent() -> None:
    trail = TokenTrail(client_wants_ids=False)
    trail.relay(event(" a", [7], prompt=[1, 2]) + event(" b", [8]))
    body = {"prompt": "x", "max_tokens": 5, "min_tokens": 3, "stream": True, "prompt_logprobs": 1}
    rest = trail.continuation(body)
    assert rest == {
        "prompt": [1, 2, 7, 8],
        "max_tokens": 3,
        "min_tokens": 1,
        "stream": True,
        "return_token_ids": True,
    }
    assert body["prompt"] == "x", "the client's body is not changed"


def test_no_continuation_before_the_prompt_ids_or_after_the_last_token() -> None:
    assert TokenTrail(False).continuation({"prompt": "x", "max_tokens": 2}) is None
    trail = TokenTrail(False)
    trail.relay(event(" a", [7], prompt=[1]) + event(" b", [8]))
    assert trail.continuation({"prompt": "x", "max_tokens": 2}) is None  # only [DONE] was missing
    assert trail.continuation({"prompt": "x"})["prompt"] == [1, 7, 8]  # type: ignore[index]


def test_a_continuation_hides_its_own_prompt_ids() -> None:
    trail = TokenTrail(client_wants_ids=True)
    trail.relay(event(" a", [7], prompt=[1]))
    out = trail.relay(event(" b", [8], prompt=[1, 7]), continuation=True)
    assert b'"prompt_token_ids":null' in out and b'"token_ids":[8]' in out
    assert trail.prompt == [1] and trail.generated == [7, 8]


def test_usage_counts_resumed_tokens_as_completion_again() -> None:
    usage = {"prompt_tokens": 12, "total_tokens": 20, "completion_tokens": 8, "prompt_tokens_details": None}
    chunk = plain(" z") + b"data: " + orjson.dumps({"id": "cmpl-r1", "choices": [], "usage": usage}) + b"\n\n"
    fixed = fix_usage(chunk + b"data: [DONE]\n\n", 5)
    events = fixed.split(b"\n\n")
    assert events[0] + b"\n\n" == plain(" z") and events[2] == b"data: [DONE]"
    assert orjson.loads(events[1][6:])["usage"] == {**usage, "prompt_tokens": 7, "completion_tokens": 13}


@pytest.mark.parametrize(
    ("body", "chat", "expected"),
    [
        ({"prompt": "x", "stream": True}, False, True),
        ({"prompt": [1, 2], "stream": True}, False, True),
        ({"prompt": "x"}, False, False),
        ({"messages": [], "stream": True}, True, False),
        ({"prompt": "x", "stream": True, "stop": ["\n"]}, False, False),
        ({"prompt": "x", "stream": True, "stop": []}, False, True),
        ({"prompt": "x", "stream": True, "echo": True}, False, False),
    ],
)
def test_what_is_resumable(body: dict[str, object], chat: bool, expected: bool) -> None:
    assert resumable(body, chat) is expected


def test_the_breaker_backs_off_and_closes_on_success() -> None:
    engine = Upstream(id="d0", role="decode", url="http://127.0.0.1:1")
    opened = [engine.failed(100.0) for _ in range(OPEN_AFTER_FAILURES + 3)]
    assert opened == [n == OPEN_AFTER_FAILURES for n in range(1, OPEN_AFTER_FAILURES + 4)]
    assert engine.cooldown_until == 100.0 + COOLDOWN_MAX_S
    engine.succeeded()
    engine.failed(200.0)
    assert engine.cooldown_until == 200.0 + COOLDOWN_S
