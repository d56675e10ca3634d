"""OpenAI request checks and error bodies shared by the router and the engine simulator.

Errors look like vLLM's (vllm/entrypoints/openai/engine/protocol.py ErrorResponse):
{"error": {"message", "type", "param", "code"}} with `code` the HTTP status.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson

_MAX_TOKEN_ID = 2**31 - 1
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    kind = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


def parse_json(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(body, None) or (None, why it is not a JSON object)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return None, f"invalid JSON body: {e}"
    if not isinstance(body, dict):
        return None, "the request body must be a JSON object"
    return body, None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(_is_int(t) and 0 <= t <= _MAX_TOKEN_ID for t in value)
    )


def _check_prompt(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, list) or not prompt:
        return "'prompt' must be a string, a list of strings, or a (list of) list of token ids"
    if all(isinstance(p, str) for p in prompt) or _token_ids(prompt):
        return None
    if all(_token_ids(p) for p in prompt):
        return None
    return "'prompt' must be a string, a list of strings, or a (list of) list of token ids"


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"'messages[{i}]' must be an object with a string 'role'"
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return f"'messages[{i}].content' must be a string, a list of parts or null"
        if isinstance(content, list) and not all(isinstance(part, dict) for part in content):
            return f"'messages[{i}].content' parts must be objects"
    return None


_INT_FIELDS = (("max_tokens", 1), ("max_completion_tokens", 1), ("min_tokens", 0), ("n", 1))
_BOOL_FIELDS = ("stream", "ignore_eos")


def check_request(body: dict[str, Any], chat: bool) -> tuple[str, str] | None:
    """None if the body is a well-formed request, else (message, param)."""
    if chat:
        if "messages" not in body:
            return "'messages' is required", "messages"
        why = _check_messages(body["messages"])
        if why:
            return why, "messages"
    else:
        if "prompt" not in body:
            return "'prompt' is required", "prompt"
        why = _check_prompt(body["prompt"])
        if why:
            return why, "prompt"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return "'model' must be a string", "model"
    for name, low in _INT_FIELDS:
        value = body.get(name)
        if value is not None and (not _is_int(value) or value < low):
            return f"'{name}' must be an integer >= {low}", name
    for name in _BOOL_FIELDS:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            return f"'{name}' must be a boolean", name
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            return "'stream_options' must be an object", "stream_options"
        if not body.get("stream"):
            # vLLM's check (completion/protocol.py, chat_completion/protocol.py)
            return "Stream options can only be defined when stream=True.", "stream_options"
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        return "'kv_transfer_params' must be an object", "kv_transfer_params"
    return None


def max_tokens_of(body: dict[str, Any], chat: bool) -> int | None:
    """The requested output length; None means up to the context limit. Completions
    default to 16 (vLLM CompletionRequest.max_tokens)."""
    if chat:
        return body.get("max_completion_tokens") or body.get("max_tokens")
    value = body.get("max_tokens")
    return 16 if value is None and "max_tokens" not in body else value


def prefill_compute_s(body: bytes) -> float | None:
    """The prompt's own prefill compute in an engine's answer, in seconds: vLLM's
    per-request `metrics.time_to_first_token_ms`, from the request's first scheduling to
    its first token (queue excluded; with --enable-per-request-metrics:
    entrypoints/generate/base/serving.py build_per_request_timing_metrics, 0.32), or None
    when the answer does not carry it."""
    if b'"time_to_first_token_ms"' not in body:
        return None
    try:
        value = orjson.loads(body)["metrics"]["time_to_first_token_ms"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    return value / 1000.0 if ok else None


def cached_tokens(body: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of an engine's answer (vLLM reports it
    with --enable-prompt-tokens-details: entrypoints/openai/completion/serving.py, 0.32),
    or None when the answer does not carry it."""
    if b'"cached_tokens"' not in body:
        return None
    try:
        value = orjson.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _with_cached(payload: dict[str, Any], cached: int) -> bool:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}), "cached_tokens": cached}
    return True


def report_cached_tokens(body: bytes, cached: int) -> bytes:
    """An answer whose usage reports `cached` prompt tokens as cached: in PD the prefill
    leg's figure (its prefix cache and store hits), not decode's, which counts the KV it
    was handed as cached too."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    return orjson.dumps(payload) if isinstance(payload, dict) and _with_cached(payload, cached) else body


def report_cached_tokens_in_events(chunk: bytes, cached: int) -> bytes:
    """The same for the usage event of a stream (the client asked for stream_options.include_usage)."""
    if b'"usage":{' not in chunk:
        return chunk
    out = []
    for event in chunk.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            event = b"data: " + report_cached_tokens(event[6:], cached)
        out.append(event)
    return b"\n\n".join(out)
