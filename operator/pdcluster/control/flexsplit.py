"""The split of a flexible pool (spec.mode flexible): the law sizes the pool as it sizes
two fixed roles (pods: damped by its windows, steps and cooldown), then splits it every
run in proportion to the engines each role wants before the GPU budget (its need, held
within its hysteresis band, plus one where its target is missed and the model did not
see why). A split moves by
flips (routing alone, seconds), so it is not damped; a band keeps a share that hovers
between two splits from flipping an engine back and forth."""

from __future__ import annotations

# A split moves when the needed share is this many engines away: past the rounding's 0.5,
# so a share that hovers at a half does not flip an engine back and forth.
SPLIT_BAND = 0.75


def prefill_share(total: int, decided: int, wanted: dict[str, int]) -> int:
    """Prefill engines of a pool of `total`: the wanted share of it, moved off the law's
    own split (`decided`) only when that share is more than SPLIT_BAND engines away; at
    least one engine of each role."""
    want_p, want_d = wanted.get("prefill", 0), wanted.get("decode", 0)
    if total < 2 or want_p + want_d == 0:
        return decided
    now = min(max(decided, 1), total - 1)
    share = total * want_p / (want_p + want_d)
    if abs(share - now) <= SPLIT_BAND:
        return now
    return min(max(round(share), 1), total - 1)
