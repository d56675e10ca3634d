"""Resuming a stream on another decode engine after its first one died.

vLLM streams token ids next to the text when asked (`return_token_ids`, vLLM 0.32
entrypoints/openai/{completion,chat_completion}/protocol.py: the prompt's ids in the
first chunk, each chunk's new ids in `token_ids`). The router asks for them, takes them
out of the events before the client sees them (`null`, as vLLM writes the fields when
not asked) and keeps them. If decode dies mid-stream, the rest of the answer is one more
completion whose prompt is the prompt's ids (for chat: the rendered chat template's)
plus the ids already sent: with greedy sampling it continues exactly where the first
stream stopped, and a prefix the Mooncake store holds is loaded rather than computed.
For a chat stream the rest comes from /v1/completions and is written as chat chunks.

Asked for ids, vLLM's chat stream also sends an event for a token that adds no text yet
(chat_completion/serving.py: "we still need to send a chunk even if delta_message is
None"); those are dropped after their ids are kept, so the client sees what it would
have seen. Only whole events are relayed, so a death mid-event sends no half token.

Not resumable: stop strings (vLLM holds back text that may start one, so the ids run
ahead of the text sent), echo, logprobs, tools and structured output (their state lives
in the engine's parsers), and a stream whose ids the engine hid (a reasoning parser).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

# `token_ids` and `prompt_token_ids` alike. No optional group before the literal: with
# one, the scan of a 64-token chunk took five times as long.
_IDS = re.compile(rb'token_ids":\[([0-9,\s]*)\]')
_PROMPT = b'"prompt_'
_PROMPT_IDS = re.compile(rb'"prompt_token_ids":\[[0-9,\s]*\]')
# An event vLLM's chat stream adds only because ids were asked for: no text, no end.
_EMPTY_CHAT_EVENT = re.compile(rb'data: \{[^\n]*"delta":\{\},"logprobs":null,"finish_reason":null[^\n]*\n\n')
# Sampling parameters a chat request and its completion continuation share.
_SAMPLING = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
    "spaces_between_special_tokens", "stream_options", "include_stop_str_in_output",
)  # fmt: skip
_NOT_RESUMABLE = ("stop", "echo", "logprobs", "top_logprobs", "tools", "functions", "response_format",
                  "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")  # fmt: skip


def resumable(body: dict[str, Any], chat: bool) -> bool:
    """Whether a stream of this request can be resumed exactly."""
    if not body.get("stream") or any(body.get(key) for key in _NOT_RESUMABLE):
        return False
    return isinstance(body.get("messages" if chat else "prompt"), list if chat else (str, list))


class TokenTrail:
    """What a stream has delivered: the prompt's ids and the generated ids of every event
    relayed. `relay` turns the engine's bytes into the client's. The ids are kept as the
    engine wrote them and parsed only if the stream is resumed: parsing them per event
    was most of the relay's cost."""

    __slots__ = ("_generated", "_partial", "_prompt", "chat", "client_wants_ids", "hidden")

    def __init__(self, client_wants_ids: bool, chat: bool = False):
        self.client_wants_ids = client_wants_ids
        self.chat = chat
        self.hidden = False  # the engine sent a token event without its ids
        self._prompt: bytes | None = None
        self._generated: list[bytes] = []
        self._partial = b""

    @property
    def prompt(self) -> list[int] | None:
        return None if self._prompt is None else _ids(self._prompt)

    @property
    def generated(self) -> list[int]:
        return [i for raw in self._generated for i in _ids(raw)]

    def relay(self, chunk: bytes, continuation: bool = False) -> bytes:
        """The whole events of `chunk` (with what the last call held back), ids taken out;
        the rest is held until its event ends."""
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._partial = data
            return b""
        self._partial = data[end + 2 :]
        events = data[: end + 2]
        if b'"token_ids":null' in events:
            self.hidden = True
        prompt_seen = False
        for match in _IDS.finditer(events):
            start = match.start()
            if events[start - len(_PROMPT) : start] != _PROMPT:
                self._generated.append(match[1])
            elif not continuation:  # the first event's; a continuation's prompt is ours
                self._prompt, prompt_seen = match[1], True
            else:
                prompt_seen = True
        if not self.client_wants_ids:
            events = _IDS.sub(b'token_ids":null', events)  # "prompt_" before it stays
        elif continuation and prompt_seen:
            events = _PROMPT_IDS.sub(b'"prompt_token_ids":null', events)  # the client saw its prompt's
        if self.chat and not self.client_wants_ids and not continuation:
            events = _EMPTY_CHAT_EVENT.sub(b"", events)
        return events

    def continuation(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The completion request for the rest of the answer, or None when too little is
        known or the answer had ended."""
        if self.prompt is None or self.hidden:
            return None
        done = len(self.generated)
        if self.chat:
            out = {key: body[key] for key in _SAMPLING if key in body}
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
            if limit is not None:
                out["max_tokens"] = limit
            out["stream"] = True
        else:
            out = dict(body)
            out.pop("prompt_logprobs", None)
        out["prompt"] = self.prompt + self.generated
        out["return_token_ids"] = True
        for key in ("max_tokens", "min_tokens"):
            if isinstance(out.get(key), int):
                out[key] = max(out[key] - done, 0)
        if out.get("max_tokens") == 0:
            return None  # it had ended: only [DONE] was lost
        return out


def _ids(raw: bytes) -> list[int]:
    return [int(t) for t in raw.split(b",") if t.strip()]


def fix_usage(events: bytes, resumed_tokens: int) -> bytes:
    """A continuation's usage counts the tokens sent before it as prompt: count them as
    completion tokens again, as the client's one request did."""
    if b'"usage":{' not in events:
        return events
    out = []
    for event in events.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            payload = orjson.loads(event[6:])
            usage = payload["usage"]
            usage["prompt_tokens"] -= resumed_tokens
            usage["completion_tokens"] += resumed_tokens
            event = b"data: " + orjson.dumps(payload)
        out.append(event)
    return b"\n\n".join(out)


def as_chat(events: bytes) -> bytes:
    """A completion continuation's events written as the chat stream's: same request id,
    `delta.content` for `text`."""
    out = []
    for event in events.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            out.append(event)
            continue
        payload = orjson.loads(event[6:])
        chunk: dict[str, Any] = {
            "id": "chatcmpl-" + str(payload.get("id", "")).removeprefix("cmpl-"),
            "object": "chat.completion.chunk",
            "created": payload.get("created"),
            "model": payload.get("model"),
            "choices": [],
        }
        for choice in payload.get("choices") or []:
            text = choice.get("text") or ""
            converted: dict[str, Any] = {
                "index": choice.get("index", 0),
                "delta": {"content": text} if text else {},
                "logprobs": None,
                "finish_reason": choice.get("finish_reason"),
            }
            if choice.get("finish_reason") is not None:
                converted["stop_reason"] = choice.get("stop_reason")
            converted["token_ids"] = choice.get("token_ids")
            chunk["choices"].append(converted)
        if "usage" in payload:
            chunk["usage"] = payload["usage"]
        out.append(b"data: " + orjson.dumps(chunk))
    return b"\n\n".join(out)
