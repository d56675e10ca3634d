"""Token approximation, prefix-block hashes and request checks."""

from __future__ import annotations

import pytest

from pdcluster.router import openai
from pdcluster.router.prompt import BLOCK_TOKENS, block_hashes, chat_text, count_tokens, prompt_of


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ("", 0),
        ("abcd", 1),
        ("abcde", 2),
        ("héllo", 2),  # 6 UTF-8 bytes
        ("日本語", 3),  # 9 bytes
        ([5, 6, 7], 3),  # token ids count exactly
    ],
)
def test_count_tokens(prompt: str | list[int], tokens: int) -> None:
    assert count_tokens(prompt) == tokens


def test_prompt_of_completion_and_chat() -> None:
    assert prompt_of({"prompt": "hi"}, chat=False) == "hi"
    assert prompt_of({"prompt": ["only one"]}, chat=False) == "only one"
    assert prompt_of({"prompt": [[1, 2]]}, chat=False) == [1, 2]
    assert prompt_of({"prompt": [1, 2]}, chat=False) == [1, 2]
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
        },
        {"role": "assistant", "content": None},
    ]
    assert chat_text(messages) == "system\nbe brief\nuser\nab\nassistant\n\n"
    assert prompt_of({"messages": messages}, chat=True) == chat_text(messages)


def test_block_hashes_are_chained() -> None:
    block = "x" * (4 * BLOCK_TOKENS)
    a = block_hashes(block * 3 + "tail")
    b = block_hashes(block * 3 + "other tail")
    c = block_hashes("y" + block * 3)
    assert len(a) == 4  # three full blocks and a partial one
    assert a[:3] == b[:3] and a[3] != b[3]
    assert not set(a) & set(c), "a different first block changes every later hash"
    assert block_hashes("") == []
    assert block_hashes(block) == block_hashes(block)  # deterministic across calls


def test_block_hashes_of_token_ids() -> None:
    ids = list(range(3 * BLOCK_TOKENS))
    assert len(block_hashes(ids)) == 3
    assert block_hashes(ids)[:2] == block_hashes([*ids[: 2 * BLOCK_TOKENS], 9, 9])[:2]


# ------------------------------------------------------------------------ request checks
VALID = [
    ({"prompt": "hi"}, False),
    ({"prompt": ["a", "b"], "n": 1}, False),
    (
        {"prompt": [1, 2, 3], "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}},
        False,
    ),
    ({"prompt": [[1], [2, 3]], "model": "m", "min_tokens": 0, "ignore_eos": False}, False),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}, True),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, True),
    ({"messages": [{"role": "assistant", "content": None}], "kv_transfer_params": None}, True),
]
INVALID = [
    ({}, False, "prompt"),
    ({"prompt": 7}, False, "prompt"),
    ({"prompt": []}, False, "prompt"),
    ({"prompt": [1, "a"]}, False, "prompt"),
    ({"prompt": [-1]}, False, "prompt"),
    ({"prompt": [2**40]}, False, "prompt"),
    ({"prompt": [True]}, False, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, False, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, False, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, False, "max_tokens"),
    ({"prompt": "x", "n": 0}, False, "n"),
    ({"prompt": "x", "stream": "yes"}, False, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, False, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": []}, False, "stream_options"),
    ({"prompt": "x", "model": 3}, False, "model"),
    ({"prompt": "x", "kv_transfer_params": "p"}, False, "kv_transfer_params"),
    ({"messages": []}, True, "messages"),
    ({"messages": "hi"}, True, "messages"),
    ({"messages": [{"content": "hi"}]}, True, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, True, "messages"),
    ({"messages": [{"role": "user", "content": ["text"]}]}, True, "messages"),
    ({"prompt": "x"}, True, "messages"),
]


@pytest.mark.parametrize(("body", "chat"), VALID)
def test_valid_requests(body: dict, chat: bool) -> None:
    assert openai.check_request(body, chat) is None


@pytest.mark.parametrize(("body", "chat", "param"), INVALID)
def test_invalid_requests_name_the_field(body: dict, chat: bool, param: str) -> None:
    problem = openai.check_request(body, chat)
    assert problem is not None and problem[1] == param


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b'"s"', b"null", b"\xff\xfe{}", b'{"a": "\xed\xa0\x80"}'])
def test_parse_json_rejects_non_objects_and_bad_utf8(raw: bytes) -> None:
    body, why = openai.parse_json(raw)
    assert body is None and why


def test_error_body_shape() -> None:
    import orjson

    assert orjson.loads(openai.error_body(429, "slow down")) == {
        "error": {"message": "slow down", "type": "RateLimitError", "param": None, "code": 429}
    }


@pytest.mark.parametrize(
    ("body", "chat", "expected"),
    [
        ({"prompt": "x"}, False, 16),  # vLLM's completion default
        ({"prompt": "x", "max_tokens": None}, False, None),
        ({"prompt": "x", "max_tokens": 9}, False, 9),
        ({"messages": []}, True, None),
        ({"messages": [], "max_tokens": 7}, True, 7),
        ({"messages": [], "max_tokens": 7, "max_completion_tokens": 3}, True, 3),
    ],
)
def test_max_tokens_of(body: dict, chat: bool, expected: int | None) -> None:
    assert openai.max_tokens_of(body, chat) == expected
