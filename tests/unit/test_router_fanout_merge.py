"""The router's fan-out of `n` > 1 and batched prompts, as pure functions: the split into
flows and the merge of their answers and streams."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.render import Owner
from pdcluster.render import router as router_render
from pdcluster.router.fanout_merge import (
    StreamMerge,
    error_message,
    fan_out_size,
    merge_bodies,
    merged_usage,
    split,
)
from pdcluster.router.flags import parser


@pytest.mark.parametrize(
    ("prompt", "n", "size"),
    [
        ("one", None, 1),
        ("one", 3, 3),
        (["one"], 2, 2),
        ([1, 2, 3], 2, 2),  # one prompt of token ids
        ([[1, 2], [3, 4], [5]], None, 3),
        (["a", "b"], 4, 8),
    ],
)
def test_fan_out_size_counts_prompts_times_choices(prompt: Any, n: int | None, size: int) -> None:
    assert fan_out_size({"prompt": prompt, "n": n}, chat=False) == size


def test_split_completions_indexes_prompt_major_and_seeds_each_choice() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 7, "max_tokens": 5}
    flows = split(body, chat=False)
    assert [(f.index, f.prompt, f.choice) for f in flows] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert [f.body["prompt"] for f in flows] == ["a", "a", "b", "b"]
    assert [f.body["seed"] for f in flows] == [7, 8, 7, 8]
    assert all(f.body["n"] == 1 and f.body["max_tokens"] == 5 for f in flows)
    assert body["prompt"] == ["a", "b"] and body["n"] == 2  # the client's body is left as it was


def test_split_token_id_prompts_and_chat() -> None:
    flows = split({"prompt": [[1, 2], [3]], "n": 1}, chat=False)
    assert [f.body["prompt"] for f in flows] == [[1, 2], [3]]
    assert all("seed" not in f.body for f in flows)
    messages = [{"role": "user", "content": "hi"}]
    chat = split({"messages": messages, "n": 3}, chat=True)
    assert [f.index for f in chat] == [0, 1, 2]
    assert all(f.body["messages"] == messages and f.body["n"] == 1 for f in chat)


def _answer(text: str, prompt_tokens: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {
        "id": f"cmpl-{text}",
        "object": "text_completion",
        "created": 100,
        "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": usage,
        "kv_transfer_params": {"remote_engine_id": "x"},
    }


def test_merge_bodies_reindexes_and_counts_each_prompt_once() -> None:
    flows = split({"prompt": ["a", "b"], "n": 2}, chat=False)
    payloads = [_answer("a0", 10, 3, 8), _answer("a1", 10, 4, 10), _answer("b0", 20, 5, 0), _answer("b1", 20, 6)]
    merged = merge_bodies(flows, payloads, "cmpl-req")
    assert merged["id"] == "cmpl-req"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    # vLLM's usage for the same request: each prompt once, every choice's tokens.
    assert merged["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": 18,
        "total_tokens": 48,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    assert merged["kv_transfer_params"] is None


def test_merged_usage_counts_a_prompt_from_its_first_reporting_flow() -> None:
    flows = split({"prompt": ["a"], "n": 2}, chat=False)
    usage = merged_usage(flows, {1: {"prompt_tokens": 4, "completion_tokens": 2}})
    assert usage == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _chunk(text: str, finish: str | None = None, rid: str = "cmpl-x", created: int = 5) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return _event({"id": rid, "object": "text_completion", "created": created, "model": "m", "choices": [choice]})


def _events(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


def test_stream_merge_rewrites_ids_indexes_and_waits_for_split_events() -> None:
    merge = StreamMerge(split({"prompt": ["a", "b"], "n": 1}, chat=False), "cmpl-req")
    whole = _chunk("b-first", rid="cmpl-other", created=9)
    out, failure = merge.feed(1, whole[:20])
    assert (out, failure) == (b"", None)  # half an event: nothing yet
    out, _ = merge.feed(1, whole[20:] + _chunk("b-more")[:10])
    assert [(e["id"], e["choices"][0]["index"], e["choices"][0]["text"]) for e in _events(out)] == [
        ("cmpl-req", 1, "b-first")
    ]
    out, _ = merge.feed(0, _chunk("a", "stop") + b"data: [DONE]\n\n")
    events = _events(out)
    assert events[0]["choices"][0]["index"] == 0 and events[0]["created"] == 9  # the first event's
    assert b"[DONE]" not in out  # one flow's end is not the stream's
    assert [f.index for f in merge.unfinished] == [1]
    out, _ = merge.feed(1, _chunk("b-more")[10:] + b"data: [DONE]\n\n")
    assert _events(out)[0]["choices"][0]["text"] == "b-more"
    assert merge.unfinished == []
    assert merge.end() == b"data: [DONE]\n\n"


def test_stream_merge_sums_usage_events_into_one_before_done() -> None:
    merge = StreamMerge(split({"prompt": "a", "n": 2}, chat=False), "cmpl-req")
    for k, completion in ((0, 3), (1, 5)):
        usage = {"prompt_tokens": 7, "completion_tokens": completion, "total_tokens": 7 + completion}
        usage_event = _event({"id": "x", "object": "text_completion", "created": 1, "model": "m", "choices": [],
                              "usage": usage})  # fmt: skip
        out, _ = merge.feed(k, _chunk("t") + usage_event + b"data: [DONE]\n\n")
        assert len(_events(out)) == 1  # the usage event is held back
    end = merge.end()
    assert end.endswith(b"data: [DONE]\n\n") and end.count(b"[DONE]") == 1
    (usage_event,) = _events(end)
    assert usage_event["id"] == "cmpl-req" and usage_event["choices"] == []
    assert usage_event["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}


def test_stream_merge_stops_at_an_error_event_naming_the_flow() -> None:
    merge = StreamMerge(split({"prompt": "a", "n": 2}, chat=False), "cmpl-req")
    err = b'data: {"error":{"message":"every attempt failed (3): decode d1: boom","code":502}}\n\n'
    out, failure = merge.feed(1, _chunk("ok") + err + b"data: [DONE]\n\n")
    assert len(_events(out)) == 1
    assert failure == "prompt 0, choice 1: every attempt failed (3): decode d1: boom"
    _, failure = merge.feed(0, b"data: not json\n\n")
    assert failure == "prompt 0, choice 0: the engine sent an event that is not JSON"


def test_error_message_of_an_error_body_or_raw_text() -> None:
    assert error_message(b'{"error":{"message":"too long","code":400}}') == "too long"
    assert error_message(b"plain failure") == "plain failure"


def test_router_max_fan_out_reaches_the_router_flag() -> None:
    owner = Owner("pd", "serving", "uid-1")
    plain = router_render.router_args(PDClusterSpec.model_validate({"model": {"name": "m"}}), owner)
    assert not any(a.startswith("--max-fan-out") for a in plain)
    default = parser().parse_args(["--decode", "http://127.0.0.1:1"]).max_fan_out
    assert default == PDClusterSpec.model_validate({"model": {"name": "m"}}).router.max_fan_out == 16
    spec = PDClusterSpec.model_validate({"model": {"name": "m"}, "router": {"maxFanOut": 4}})
    args = router_render.router_args(spec, owner)
    assert "--max-fan-out=4" in args
    assert parser().parse_args(["--decode", "http://127.0.0.1:1", "--max-fan-out=4"]).max_fan_out == 4
    with pytest.raises(ValueError, match=r"maxFanOut|max_fan_out"):
        PDClusterSpec.model_validate({"model": {"name": "m"}, "router": {"maxFanOut": 0}})
