"""The fewest engines of each role that keep a target: the law's sizing, also what the
fleet planner sizes a load with before any observation."""

from __future__ import annotations

from pdcluster.control import models
from pdcluster.perf import Profile

# Without a reachable TTFT target (prompts whose own prefill exceeds it) prefill is
# sized so that queueing adds at most this share of the target.
QUEUEING_SHARE = 0.2


def prefill_bound(fixed_ms: float, target_ms: float, margin: float = 0.0) -> float:
    """The TTFT prefill is sized for: the target x (1 + margin), where queueing still
    gets its share of it when the rest alone nearly fills it (long prompts). Engines only
    shorten the queueing part."""
    return fixed_ms + max(target_ms * (1 + margin) - fixed_ms, QUEUEING_SHARE * target_ms * (1 + margin))


def fewest_prefill(
    model: models.PrefillModel, target_ms: float, limit: int, margin: float = 0.0
) -> int | None:
    """The fewest prefill engines (up to `limit`) within the target x (1 + margin) that
    are busy at most PREFILL_MAX_BUSY (less a negative margin); None if `limit` is not
    enough."""
    busy = models.PREFILL_MAX_BUSY * min(1.0, 1.0 + margin)
    bound = prefill_bound(model.fixed_ms, target_ms, margin)
    return models.fewest_engines(model.ttft_ms, bound, limit, lambda n: model.load() <= busy * n)


def fewest_decode(model: models.DecodeModel, target_ms: float, limit: int, margin: float = 0.0) -> int | None:
    """The fewest decode engines (up to `limit`) within the ITL target x (1 + margin) whose
    KV cache stays under its limit (less a negative margin); None if `limit` is not enough."""
    kv = models.KV_LIMIT * min(1.0, 1.0 + margin)
    return models.fewest_engines(
        model.itl_ms, target_ms * (1.0 + margin), limit, lambda n: model.kv_usage(n) <= kv
    )


def engines_for(
    profile: Profile,
    *,
    rate: float,
    input_tokens: float,
    output_tokens: float,
    lengths: tuple[tuple[float, float], ...],
    ttft_ms: float,
    itl_ms: float,
    quantile: float,
    own_prefill: bool,
    limit: int,
) -> tuple[int, int]:
    """The fewest prefill and decode engines (each up to `limit`) for a load not observed
    yet: the capacity models on the profile alone. `lengths` is the prompt-length
    histogram as vLLM exports it (the prefill cost is convex in the length)."""
    prefill = models.calibrate_prefill(
        profile,
        rate=rate,
        input_tokens=input_tokens,
        hit_ratio=0.0,
        quantile=quantile,
        engines=0,
        observed_ttft_ms=None,
        observed_wait_ms=None,
        lengths=lengths,
        own_prefill=own_prefill,
    )
    decode = models.calibrate_decode(
        profile,
        rate=rate,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        engines=0,
        observed_itl_ms=None,
    )
    p = fewest_prefill(prefill, ttft_ms, limit) or limit
    return p, fewest_decode(decode, itl_ms, limit) or limit
