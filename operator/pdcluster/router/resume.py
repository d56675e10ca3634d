"""Resuming a completion stream on another decode engine after its first one died.

vLLM streams token ids next to the text when asked (`return_token_ids`, vLLM 0.32
entrypoints/openai/completion/protocol.py: the prompt's ids in the first chunk, each
chunk's new ids in `token_ids`). The router asks for them, takes them out of the events
before the client sees them (`null`, as vLLM writes the fields when not asked) and keeps
them. If decode dies mid-stream, the rest of the answer is one more completion whose
prompt is the prompt's ids plus the ids already sent: with greedy sampling it continues
exactly where the first stream stopped, and a prefix the Mooncake store holds is loaded
rather than computed.

Only whole events are relayed, so a death mid-event sends no half token. Not resumable:
chat streams (vLLM's chat chunking changes when ids are asked for), stop strings (vLLM
holds back text that may start one, so the ids run ahead of the text sent) and echo.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_IDS = re.compile(rb'"(prompt_)?token_ids":\[([0-9,\s]*)\]')


def resumable(body: dict[str, Any], chat: bool) -> bool:
    """Whether a stream of this request can be resumed exactly."""
    return (
        not chat
        and bool(body.get("stream"))
        and not body.get("stop")
        and not body.get("echo")
        and isinstance(body.get("prompt"), (str, list))
    )


class TokenTrail:
    """What a completion stream has delivered: the prompt's ids and the generated ids of
    every event relayed. `relay` turns the engine's bytes into the client's."""

    __slots__ = ("_partial", "client_wants_ids", "generated", "prompt")

    def __init__(self, client_wants_ids: bool):
        self.client_wants_ids = client_wants_ids
        self.prompt: list[int] | None = None
        self.generated: list[int] = []
        self._partial = b""

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
        return _IDS.sub(lambda m: self._take(m, continuation), events)

    def _take(self, match: re.Match[bytes], continuation: bool) -> bytes:
        ids = [int(t) for t in match[2].split(b",") if t.strip()]
        if match[1]:  # prompt_token_ids: the first event's
            if continuation:
                return b'"prompt_token_ids":null'  # the client saw its prompt's already
            self.prompt = ids
        else:
            self.generated += ids
        return match[0] if self.client_wants_ids else b'"%stoken_ids":null' % (match[1] or b"")

    def continuation(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The request for the rest of the answer, or None when too little is known."""
        if self.prompt is None:
            return None
        done = len(self.generated)
        out = dict(body)
        out["prompt"] = self.prompt + self.generated
        out["return_token_ids"] = True
        for key in ("max_tokens", "min_tokens"):
            if isinstance(out.get(key), int):
                out[key] = max(out[key] - done, 0)
        if out.get("max_tokens") == 0:
            return None  # it had ended: only [DONE] was lost
        out.pop("prompt_logprobs", None)
        return out


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
