"""The MooncakeConnector handshake: exact bodies, parameters and headers."""

from __future__ import annotations

import copy

import orjson
import pytest

from pdcluster.router.protocol import BootstrapError, MooncakeProtocol, PrefillEngine

ENGINE = PrefillEngine("0b5e-engine", 1, "http://127.1.0.7:8998")


def test_prefill_body_of_a_streamed_chat_request() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 300,
        "max_completion_tokens": 300,
        "temperature": 0.2,
    }
    original = copy.deepcopy(body)
    assert MooncakeProtocol.prefill_body(body, "xfer-1") == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "min_tokens": 1,
        "temperature": 0.2,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-1"},
    }
    assert body == original, "the client's body must not change"


def test_prefill_body_adds_no_max_completion_tokens_and_overrides_min_tokens() -> None:
    out = MooncakeProtocol.prefill_body({"prompt": "x", "min_tokens": 50, "ignore_eos": True}, "t")
    assert "max_completion_tokens" not in out
    assert out["max_tokens"] == 1 and out["min_tokens"] == 1 and out["stream"] is False
    assert out["ignore_eos"] is True


def test_decode_body_keeps_the_clients_stream_settings() -> None:
    body = {"prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 64}
    assert MooncakeProtocol.decode_body(body, "xfer-9", ENGINE) == {
        "prompt": [1, 2, 3],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 64,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "0b5e-engine",
            "remote_bootstrap_addr": "http://127.1.0.7:8998",
            "transfer_id": "xfer-9",
        },
    }
    assert "kv_transfer_params" not in body


def test_headers() -> None:
    assert MooncakeProtocol.prefill_headers("rid", ENGINE) == [
        ("Content-Type", "application/json"),
        ("X-Request-Id", "rid"),
        ("X-data-parallel-rank", "1"),
    ]
    assert MooncakeProtocol.decode_headers("rid") == [
        ("Content-Type", "application/json"),
        ("X-Request-Id", "rid"),
    ]


def test_parse_query_orders_dp_ranks() -> None:
    payload = {
        "1": {"engine_id": "e_dp1", "worker_addr": {"0": {"0": "tcp://a:2"}}},
        "0": {"engine_id": "e_dp0", "worker_addr": {"0": {"0": "tcp://a:1"}}},
    }
    assert MooncakeProtocol.parse_query(payload, "http://a:8998") == [
        PrefillEngine("e_dp0", 0, "http://a:8998"),
        PrefillEngine("e_dp1", 1, "http://a:8998"),
    ]


def test_parse_query_of_a_starting_engine_is_empty() -> None:
    assert MooncakeProtocol.parse_query({}, "http://a:8998") == []


@pytest.mark.parametrize(
    "payload",
    [[], "x", {"0": "e"}, {"0": {"worker_addr": {}}}, {"0": {"engine_id": 7}}, {"zero": {"engine_id": "e"}}],
)
def test_parse_query_rejects_malformed_answers(payload: object) -> None:
    with pytest.raises(BootstrapError):
        MooncakeProtocol.parse_query(payload, "http://a:8998")


def test_usage_reports_the_cached_tokens_it_is_given():
    from pdcluster.router import openai

    body = orjson.dumps({"id": "x", "usage": {"prompt_tokens": 64, "prompt_tokens_details": {"cached_tokens": 63}}})
    assert openai.cached_tokens(body) == 63
    assert openai.cached_tokens(b'{"usage": {"prompt_tokens": 5}}') is None
    assert openai.cached_tokens(b'{"usage": {"prompt_tokens_details": {"cached_tokens": true}}}') is None
    out = orjson.loads(openai.report_cached_tokens(body, 48))
    assert out["usage"] == {"prompt_tokens": 64, "prompt_tokens_details": {"cached_tokens": 48}}
    no_details = orjson.loads(openai.report_cached_tokens(b'{"usage": {"prompt_tokens": 5}}', 0))
    assert no_details["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert openai.report_cached_tokens(b"not json", 3) == b"not json"
    stream = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":64}}\n\ndata: [DONE]\n\n'
    events = openai.report_cached_tokens_in_events(stream, 16).split(b"\n\n")
    assert events[0] == b'data: {"choices":[{"text":"a"}]}' and events[2] == b"data: [DONE]"
    assert orjson.loads(events[1][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
