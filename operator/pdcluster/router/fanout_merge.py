"""A request with `n` > 1 or several prompts as one PD flow per prompt and choice, and
the flows' answers merged into the one answer the client asked for. Pure: no I/O.

One flow per choice, not one prefill per prompt feeding n decodes: vLLM's
MooncakeConnector hands a prefill's KV to one decode only. Its sender counts the pulls of
a transfer_id up to `need_send`, the TP ranks of the first decode that pulls it, then
drops the transfer and frees the prefill's blocks (vLLM 0.32
distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py,
`resolve_need_send` and the `sent == need_send` pop); a second decode pulling the same
transfer_id finds it gone. The flows of one prompt go to the same prefill under a
prefix-aware policy, whose prefix cache then holds the prompt for all but the first.

The merged answer is vLLM's for the same request (entrypoints/openai/completion/
serving.py): choice `j` of prompt `i` has index `i * n + j`; usage counts each prompt's
tokens once and every choice's completion tokens; one id. A choice's seed is the
request's plus `j`, as vLLM seeds the child requests of `n` > 1
(v1/engine/parallel_sampling.py, `get_child_sampling_params`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Flow:
    """One prompt and choice of the client's request: `index` in the merged answer."""

    index: int
    prompt: int
    choice: int
    body: dict[str, Any]

    @property
    def label(self) -> str:
        return f"prompt {self.prompt}, choice {self.choice}"


def prompts_of(body: dict[str, Any], chat: bool) -> list[Any]:
    """The request's prompts: a chat request has one; a completion's list of strings or
    of token-id lists is several, a string or one token-id list is one."""
    if chat:
        return [body["messages"]]
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def fan_out_size(body: dict[str, Any], chat: bool) -> int:
    """How many PD flows the request needs: 1 when it is served as it is."""
    return len(prompts_of(body, chat)) * (body.get("n") or 1)


def split(body: dict[str, Any], chat: bool) -> list[Flow]:
    """One request body of n = 1 and one prompt per flow, in the merged answer's order."""
    n = body.get("n") or 1
    seed = body.get("seed")
    flows = []
    for i, prompt in enumerate(prompts_of(body, chat)):
        for j in range(n):
            sub = {**body, "n": 1}
            if not chat:
                sub["prompt"] = prompt
            if isinstance(seed, int) and not isinstance(seed, bool):
                sub["seed"] = seed + j
            flows.append(Flow(i * n + j, i, j, sub))
    return flows


def _add_usage(total: dict[str, Any], usage: dict[str, Any], with_prompt: bool) -> None:
    completion = usage.get("completion_tokens") or 0
    total["completion_tokens"] += completion
    total["total_tokens"] += completion
    if not with_prompt:
        return
    prompt = usage.get("prompt_tokens") or 0
    total["prompt_tokens"] += prompt
    total["total_tokens"] += prompt
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        summed = total.setdefault("prompt_tokens_details", {"cached_tokens": 0})
        summed["cached_tokens"] += details["cached_tokens"]


def merged_usage(flows: list[Flow], usages: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The request's usage from its flows' (by flow position): a prompt's tokens once,
    from its first flow that reported usage; every flow's completion tokens."""
    total: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    counted: set[int] = set()
    for k, flow in enumerate(flows):
        usage = usages.get(k)
        if not isinstance(usage, dict):
            continue
        _add_usage(total, usage, flow.prompt not in counted)
        counted.add(flow.prompt)
    return total


def merge_bodies(flows: list[Flow], payloads: list[dict[str, Any]], response_id: str) -> dict[str, Any]:
    """The non-streamed answer from each flow's (in flow order)."""
    merged = {key: value for key, value in payloads[0].items() if key not in ("choices", "usage")}
    merged["id"] = response_id
    choices = []
    usages = {}
    for k, (flow, payload) in enumerate(zip(flows, payloads, strict=True)):
        for choice in payload.get("choices") or []:
            choices.append({**choice, "index": flow.index})
        if isinstance(payload.get("usage"), dict):
            usages[k] = payload["usage"]
    merged["choices"] = sorted(choices, key=lambda c: c["index"])
    if usages:
        merged["usage"] = merged_usage(flows, usages)
    if "kv_transfer_params" in merged:
        merged["kv_transfer_params"] = None  # the router's hand-off, not the client's
    return merged


def error_message(body: bytes) -> str:
    """The message of an OpenAI error body, or the body itself."""
    try:
        message = orjson.loads(body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500]
    return str(message)


@dataclass
class StreamMerge:
    """The flows' SSE events as the one stream the client asked for: every event gets
    the request's id and its flow's choice index; each flow's [DONE] and usage-only
    event are held back, and once all flows are done, one usage event (when asked for)
    and one [DONE] end the stream. A flow's bytes may split an event: the tail waits
    for the rest."""

    flows: list[Flow]
    response_id: str
    partial: dict[int, bytes] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    usages: dict[int, dict[str, Any]] = field(default_factory=dict)
    head: dict[str, Any] = field(default_factory=dict)  # object, created, model of the first event

    def feed(self, k: int, chunk: bytes) -> tuple[bytes, str | None]:
        """Flow k's bytes: (the events for the client, the error the flow ended with)."""
        data = self.partial.pop(k, b"") + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self.partial[k] = data
            return b"", None
        if end + 2 < len(data):
            self.partial[k] = data[end + 2 :]
        out = []
        for event in data[:end].split(b"\n\n"):
            line = event.strip()
            if not line.startswith(b"data: "):
                continue  # comments and blank keep-alives carry nothing for the client
            if line == b"data: [DONE]":
                self.done.add(k)
                continue
            rewritten, failure = self._event(k, line[6:])
            if failure is not None:
                return b"".join(out), failure
            if rewritten is not None:
                out.append(b"data: " + rewritten + b"\n\n")
        return b"".join(out), None

    def _event(self, k: int, raw: bytes) -> tuple[bytes | None, str | None]:
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None, f"{self.flows[k].label}: the engine sent an event that is not JSON"
        if not isinstance(payload, dict):
            return None, f"{self.flows[k].label}: the engine sent an event that is not an object"
        if "error" in payload:
            return None, f"{self.flows[k].label}: {error_message(raw)}"
        for key in ("object", "created", "model"):
            self.head.setdefault(key, payload.get(key))
        payload["id"] = self.response_id
        payload["created"] = self.head["created"]
        choices = payload.get("choices")
        if not choices and isinstance(payload.get("usage"), dict):
            self.usages[k] = payload["usage"]
            return None, None
        for choice in choices or []:
            choice["index"] = self.flows[k].index
        return orjson.dumps(payload), None

    @property
    def unfinished(self) -> list[Flow]:
        return [flow for k, flow in enumerate(self.flows) if k not in self.done]

    def end(self) -> bytes:
        """What ends the stream once every flow is done: the summed usage, then [DONE]."""
        if not self.usages:
            return DONE
        usage = {"id": self.response_id, **self.head, "choices": [], "usage": merged_usage(self.flows, self.usages)}
        return b"data: " + orjson.dumps(usage) + b"\n\n" + DONE
