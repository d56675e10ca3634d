"""The fewest engines of each role that keep a target: the law's sizing, also what the
fleet planner sizes a load with before any observation."""

from __future__ import annotations

from pdcluster.control import models

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
