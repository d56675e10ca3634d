"""What the router is told at start-up, apart from its engines and policies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    model: str | None = None
    request_timeout_s: float = 600.0
    api_key: str | None = None
    engine_api_key: str | None = None  # sent to engines started with --api-key
    max_attempts: int = 3  # per request, across prefill and decode engines
    prefill_timeout_s: float = 120.0
    resume_streams: bool = True
    hash_seed: str | None = None  # the engines' PYTHONHASHSEED, which seeds vLLM's block hashes
    exact_timeout_s: float = 0.1  # what hashing a prompt as the engines do may add to a request
    prefill_on_decode_below: int = 0  # shorter prompts are prefilled by their decode engine; 0: none
    max_fan_out: int = 16  # PD flows one request may fan out into (n times its prompts)
