"""The bodies of generate responses, whole and streamed, as vLLM 0.32.0 writes them
(vllm/entrypoints/openai/{completion,chat_completion}/serving.py).

Generated text is filler drawn deterministically from the prompt and seed: one word
(about 4 characters, so about one token by the router's count) per token. Streamed
events are assembled from bytes fixed per request, as the relay path is hot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from pdcluster.enginesim.engine import Seq

FILLER_WORDS = (
    " the", " of", " and", " to", " in", " is", " for", " on", " with", " as", " at", " by",
    " data", " node", " cache", " token", " model", " layer", " batch", " queue", " load",
    " time", " rate", " path", " key", " value", " block", " page", " link", " fast",
)  # fmt: skip
FILLER_WORDS_JSON = tuple(orjson.dumps(w) for w in FILLER_WORDS)
DONE = b"data: [DONE]\n\n"
# The id of generated word w is GENERATED_ID + w, above every id of UTF-8 text (whose
# fourth bytes are never 0xFF), so a prompt ending in generated ids continues an answer.
GENERATED_ID = 2**31 - 64


class GenerateRequest:
    """What the server needs of one validated generate request."""

    __slots__ = ("chat", "created", "first_word", "id", "include_usage", "model", "prompt_ids", "seq")

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        seq: Seq,
        first_word: int,
        include_usage: bool,
        prompt_ids: list[int] | None = None,
    ):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.model = model
        self.seq = seq
        self.first_word = first_word
        self.include_usage = include_usage
        self.prompt_ids = prompt_ids  # set when the client asked for token ids

    def words(self, start: int, stop: int) -> list[int]:
        return [(self.first_word + i) % len(FILLER_WORDS) for i in range(start, stop)]

    def token_ids(self, start: int, stop: int) -> list[int]:
        return [GENERATED_ID + w for w in self.words(start, stop)]

    def usage(self, details: bool) -> dict[str, Any]:
        """As vLLM's: with --enable-prompt-tokens-details, the prompt tokens it did not
        compute (its prefix cache, or KV loaded through the connector) as cached."""
        prompt, completion = self.seq.prompt_tokens, self.seq.generated
        out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                               "completion_tokens": completion}  # fmt: skip
        if details:
            # vLLM 0.32's PromptTokenUsageInfo (entrypoints/serve/engine/protocol.py), all its fields
            out["prompt_tokens_details"] = {
                "cached_tokens": max(self.seq.stored, self.seq.cached),
                "created_cache_tokens": None,
                "multimodal_tokens": None,
            }
        return out


    def timing(self, streamed: bool = False) -> dict[str, Any]:
        """As vLLM's `metrics` with --enable-per-request-metrics (0.32,
        entrypoints/generate/base/serving.py build_per_request_timing_metrics): first
        scheduling to first token, queue, first to last token, in ms. A whole answer
        carries every field, a stream's usage event only those set (exclude_none)."""
        seq = self.seq
        decode_s = seq.last_token_at - seq.first_token_at
        inference_s = seq.last_token_at - seq.admitted_at
        out = {
            "time_to_first_token_ms": (seq.first_token_at - seq.admitted_at) * 1000.0,
            "generation_time_ms": decode_s * 1000.0,
            "queue_time_ms": (seq.admitted_at - seq.arrival) * 1000.0,
            "mean_itl_ms": decode_s / (seq.generated - 1) * 1000.0 if seq.generated > 1 else None,
            "tokens_per_second": seq.generated / inference_s if inference_s > 0 else None,
            "speculative_decoding": None,
        }
        return {k: v for k, v in out.items() if v is not None} if streamed else out


def completion_body(
    req: GenerateRequest, fingerprint: str, prompt_tokens_details: bool, timing: bool = False
) -> dict[str, Any]:
    """The whole response of a finished request."""
    seq = req.seq
    text = "".join(FILLER_WORDS[w] for w in req.words(0, seq.generated))
    end = {"logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": None}
    payload: dict[str, Any] = {"id": req.id, "created": req.created, "model": req.model}
    if req.chat:
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "reasoning": None}  # fmt: skip
        payload["object"] = "chat.completion"
        payload["choices"] = [{"index": 0, "message": message, **end}]
    else:
        payload["object"] = "text_completion"
        ids = req.prompt_ids is not None
        payload["choices"] = [
            {"index": 0, "text": text, **end, "token_ids": req.token_ids(0, seq.generated) if ids else None,
             "prompt_logprobs": None, "prompt_token_ids": req.prompt_ids}
        ]  # fmt: skip
    payload |= {
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": {"prompt_tokens_details": None} | req.usage(prompt_tokens_details),
    }
    if req.chat:
        payload["prompt_logprobs"] = None
    payload["kv_transfer_params"] = None
    if timing:
        payload["metrics"] = req.timing()
    return payload


@dataclass(frozen=True, slots=True)
class StreamFrames:
    """The fixed bytes of one request's streamed events, built once."""

    kind: str
    head: bytes  # the event's JSON object up to its choices, without the closing brace
    open_: bytes  # a token event up to its text
    close: bytes  # what closes the chat's delta after the text
    tail: bytes  # a token event's end: finish_reason, stop_reason, token ids, extra fields
    with_ids: bool  # vLLM sends the prompt's ids with the first event, each token's with it
    prompt_ids: bytes
    fingerprint: bytes  # vLLM names itself in the last event before [DONE]
    not_final: bytes  # the stop_reason of a completion event before the last
    no_ids: tuple[bytes, ...]


def stream_frames(req: GenerateRequest, fingerprint: str) -> StreamFrames:
    """Chat events carry the token in a delta; completion events carry the ids in fields."""
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    head = orjson.dumps({"id": req.id, "object": kind, "created": req.created, "model": req.model})[:-1]
    if req.chat:
        open_, close = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":', b"}"
        tail = b',"logprobs":null,"finish_reason":%s%s%s}]%s}\n\n'
    else:
        open_, close = b"data: " + head + b',"choices":[{"index":0,"text":', b""
        tail = b',"logprobs":null,"finish_reason":%s%s,"prompt_token_ids":%s,"token_ids":%s}]%s}\n\n'
    with_ids = req.prompt_ids is not None
    return StreamFrames(
        kind=kind,
        head=head,
        open_=open_,
        close=close,
        tail=tail,
        with_ids=with_ids,
        prompt_ids=orjson.dumps(req.prompt_ids) if with_ids else b"null",
        fingerprint=b',"system_fingerprint":' + orjson.dumps(fingerprint),
        not_final=b',"stop_reason":null' if not req.chat else b"",
        no_ids=(b"",) if req.chat else (b"null", b"null"),
    )


def token_events(
    req: GenerateRequest, frames: StreamFrames, sent: int, generated: int, finished: bool, stamp_tokens: bool
) -> list[bytes]:
    """One event per token generated since `sent`, the chat's role event before the first."""
    f = frames
    out = []
    if req.chat and sent == 0 and generated > 0:
        out.append(b"data: " + f.head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                   b'"logprobs":null,"finish_reason":null}]'
                   + (b',"prompt_token_ids":' + f.prompt_ids if f.with_ids else b"") + b"}\n\n")  # fmt: skip
    # Relay-latency probe for benchmarks: when this batch of tokens left the engine.
    stamp = b',"sim_sent_at":%.6f' % time.monotonic() if stamp_tokens else b""
    running = f.tail % (b"null", f.not_final, *f.no_ids, stamp)
    words = req.words(sent, generated)
    for i, word in enumerate(words):
        last = finished and i == len(words) - 1
        ids = f.no_ids
        if f.with_ids and req.chat:
            ids = (b',"token_ids":[%d]' % (GENERATED_ID + word),)
        elif f.with_ids:
            ids = (f.prompt_ids if sent + i == 0 else b"null", b"[%d]" % (GENERATED_ID + word))
        if last:
            reason = orjson.dumps(req.seq.finish_reason)
            end = f.tail % (
                reason,
                b',"stop_reason":null',
                *ids,
                stamp + (b"" if req.include_usage else f.fingerprint),
            )
        elif f.with_ids:
            end = f.tail % (b"null", f.not_final, *ids, stamp)
        else:
            end = running
        out.append(f.open_ + FILLER_WORDS_JSON[word] + f.close + end)
    return out


def closing_events(
    req: GenerateRequest, frames: StreamFrames, fingerprint: str, prompt_tokens_details: bool,
    timing: bool = False,
) -> list[bytes]:
    """What follows a finished request's last token: its usage when asked for (with the
    request's timing, as vLLM's), then [DONE]."""
    out = []
    if req.include_usage:
        usage = {"id": req.id, "object": frames.kind, "created": req.created, "model": req.model,
                 "choices": [], "usage": req.usage(prompt_tokens_details), "system_fingerprint": fingerprint}  # fmt: skip
        if timing:
            usage["metrics"] = req.timing(streamed=True)
        out.append(b"data: " + orjson.dumps(usage) + b"\n\n")
    out.append(DONE)
    return out
