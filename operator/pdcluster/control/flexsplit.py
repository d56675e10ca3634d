"""The split of a flexible pool (spec.mode flexible): the law sizes the pool as it sizes
two fixed roles (pods: damped by its windows, steps and cooldown), then splits it every
run by what each role wants before the GPU budget (its need, held within its hysteresis
band, plus one where its target is missed and the model did not see why). A split moves
by flips (routing alone, seconds), so it is not damped, but only toward a role that
wants more engines than it has, and only from one that has had headroom under its
target for a minute. A role with engines to spare keeps them until the pool's size lets
them go, so the next burst finds them where the last one needed them. Splitting in
proportion to the wants instead moved them to a role that asked for nothing: on the
Azure code day at peak 8 that cost 1.3 points and 12% more GPU-hours.

Where decode's minReplicas is 0, a quiet pool goes down to one engine, which serves every
request whole (flexible.py): where a fixed-role pool's floor is one engine of each role,
a flexible pool's is one engine (`lone_wants`)."""

from __future__ import annotations

from pdcluster.control.context import Context, Role
from pdcluster.control.needs import Need

# When both roles want more than they have, the pool is shared in proportion to their
# wants, and that share moves the split only when it is this many engines away: past the
# rounding's 0.5, so a share that hovers at a half does not flip an engine back and forth.
SPLIT_BAND = 0.75

# A role gives engines away only once it has wanted fewer for this long: one window's
# headroom is no promise that it lasts. On the burst hour (docs/benchmarks.md) flips on a
# single window's headroom left prefill one engine short when the burst came: 70.5% of
# requests in their SLO at 90%, against 85.0% at 60 s, the fixed-role law's figure.
DONOR_SETTLE_S = 60.0


def prefill_share(total: int, decided: int, wanted: dict[str, int], easy: dict[str, bool]) -> int:
    """Prefill engines of a pool of `total`, from the law's own split (`decided`): a role
    that wants more than it has takes engines the other has to spare (wants fewer than it
    has, and is `easy`: has had the law's headroom under its target, wanting fewer, for
    DONOR_SETTLE_S); both short, the pool is shared in proportion to their wants (past
    SPLIT_BAND); at least one of each role."""
    want_p, want_d = wanted.get("prefill", 0), wanted.get("decode", 0)
    if total < 2 or want_p + want_d == 0:
        return decided
    now = min(max(decided, 1), total - 1)
    short_p, short_d = want_p - now, want_d - (total - now)
    if short_p > 0 and short_d > 0:
        share = total * want_p / (want_p + want_d)
        if abs(share - now) <= SPLIT_BAND:
            return now
        return min(max(round(share), 1), total - 1)
    if short_p > 0 and easy.get("decode", False):
        now += min(short_p, max(-short_d, 0))
    elif short_d > 0 and easy.get("prefill", False):
        now -= min(short_d, max(-short_p, 0))
    return min(max(now, 1), total - 1)


# One engine computes prompts beside its streams, which wait for each prompt (a short
# answer behind a long prompt misses its ITL target): the pool goes down to it only while
# prompts would keep it busy at most LONE_BUSY of the time at the load a window ahead, and
# both quantiles sit at most LONE_PRESSURE of what their targets allow. It stays alone
# while its own quantiles keep their targets and prompts keep it busy at most LONE_STAY
# times that share. Measured on the Azure code day at peak 4 (docs/benchmarks.md, "One
# engine at night"): each tenth of a point of attainment given up buys about 2 GPU-hours.
LONE_BUSY = 0.08
LONE_STAY = 1.5
LONE_PRESSURE = 0.5


def lone_allowed(ctx: Context) -> bool:
    """Whether the pool's floor is one engine: decode's minReplicas 0, prefill's at most 1."""
    return ctx.bounds(Role.decode)[0] == 0 and ctx.bounds(Role.prefill)[0] <= 1


def lone_wants(current: dict[Role, int], needs: dict[Role, Need], wants: dict[Role, int]) -> dict[Role, int]:
    """A flexible pool's wants where its floor is one engine (`lone_allowed`): one engine
    serving whole while it fits (`lone_fits`), else at least one of each role. The pool
    goes there and back as it scales: down after the scale-down stabilization, up at once."""
    lone = current[Role.decode] == 0
    if wants[Role.prefill] <= 1 and lone_fits(needs, lone):
        return {Role.prefill: 1, Role.decode: 0}
    if lone:
        # A lone engine's misses are its sharing: a decode engine ends that, and more
        # prefill only where the model asks for it.
        wants = {**wants, Role.prefill: min(wants[Role.prefill], needs[Role.prefill].up)}
    return {role: max(want, 1) for role, want in wants.items()}


def lone_fits(needs: dict[Role, Need], lone: bool) -> bool:
    """Whether one engine serves the load whole: each role needs one engine at most, none
    misses its target, and the prefill work is light; to go alone both roles also have
    headroom at LONE_PRESSURE (`lone`: the pool is one engine already)."""
    prefill, decode = needs[Role.prefill], needs[Role.decode]
    if max(prefill.up, decode.up) > 1 or prefill.violated or decode.violated:
        return False
    busy = prefill.load_engines
    if busy is None or busy > LONE_BUSY * (LONE_STAY if lone else 1.0):
        return False
    if lone:
        return True
    return prefill.headroom and decode.headroom and max(prefill.pressure, decode.pressure) <= LONE_PRESSURE
