"""Resuming a stream: what the router keeps of a completion stream, what it hides from the
client, and the request for the rest (router/resume.py). vLLM's event shapes are those
of vllm==0.32.0 completion/serving.py with `return_token_ids`."""

from __future__ import annotations

import orjson
import pytest

from pdcluster.router.membership import COOLDOWN_MAX_S, COOLDOWN_S, OPEN_AFTER_FAILURES, Upstream
from pdcluster.router.resume import TokenTrail, as_chat, fix_usage, resumable


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
        ({"messages": [], "stream": True}, True, True),
        ({"messages": [], "stream": True, "tools": [{"type": "function"}]}, True, False),
        ({"messages": [], "stream": True, "logprobs": True}, True, False),
        ({"messages": [], "stream": True, "response_format": {"type": "json_object"}}, True, False),
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


def chat_event(content: str | None, ids: list[int] | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    choice: dict[str, object] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = ids
    payload = {
        "id": "chatcmpl-r1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def role_event(prompt: list[int] | None) -> bytes:
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    payload = {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [choice], "prompt_token_ids": prompt, "prompt_text": None}  # fmt: skip
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def test_a_chat_stream_hides_ids_and_the_events_only_ids_caused() -> None:
    """vLLM sends an empty-delta event for a token with no text yet when ids are asked
    for; without ids it would not have: the client sees the stream it would have seen."""
    trail = TokenTrail(client_wants_ids=False, chat=True)
    out = trail.relay(role_event([1, 2, 3]) + chat_event(None, [200]) + chat_event(" ab", [201]))
    assert out == role_event(None) + chat_event(" ab", None)
    assert trail.prompt == [1, 2, 3] and trail.generated == [200, 201]
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "n": 1}  # fmt: skip
    assert trail.continuation(body) == {
        "temperature": 0, "stream_options": {"include_usage": True}, "max_tokens": 8, "stream": True,
        "prompt": [1, 2, 3, 200, 201], "return_token_ids": True,
    }  # fmt: skip


def test_ids_the_engine_hid_make_a_stream_not_resumable() -> None:
    trail = TokenTrail(client_wants_ids=False, chat=True)
    trail.relay(role_event([1]) + chat_event(" a", None))
    assert trail.continuation({"messages": [], "stream": True}) is None


def test_a_completion_continuation_is_written_as_chat() -> None:
    completion = event(" c", None, finish="length")
    chat = as_chat(completion)
    assert orjson.loads(chat.removeprefix(b"data: ")) == {
        "id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": " c"}, "logprobs": None, "finish_reason": "length",
                     "stop_reason": None, "token_ids": None}],
    }  # fmt: skip
    assert as_chat(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
