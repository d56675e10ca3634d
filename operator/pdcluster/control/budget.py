"""Keeping prefill + decode within the GPU budget.

Scale-downs wait out their stabilization, so the budget is checked as if they had not
happened. Growth first takes free GPUs. Beyond them a role that the model finds short
takes engines from the other role, down to that role's model floor, while the other
meets its own target; when both miss theirs, engines move only if that makes the worse
of the two shortfalls clearly smaller. Both the donor's headroom and the taker's
shortfall must last a metrics window (see stabilise.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdcluster.control.context import ROLES, Context, Role, other
from pdcluster.control.needs import Need
from pdcluster.control.notes import Note, NoteKind, note

Counts = dict[Role, int]


@dataclass(frozen=True)
class Fit:
    """The wants within the budget, and what fitting them did."""

    wants: Counts
    donor: Role | None = None  # the role that gives engines to the other
    budget_full: Role | None = None  # a role short with nothing to take from
    rebalanced: Role | None = None  # both roles miss: the role engines move to
    notes: tuple[Note, ...] = ()


def gpu_total(ctx: Context, counts: Counts) -> int:
    return sum(counts[r] * ctx.gpus(r) for r in ROLES)


def split_budget(ctx: Context, wants: Counts, budget: int) -> Counts:
    """Share a budget that cannot hold both wishes in proportion to them (mins kept)."""
    gp, gd = ctx.gpus(Role.prefill), ctx.gpus(Role.decode)
    (p_min, p_max), (d_min, d_max) = ctx.bounds(Role.prefill), ctx.bounds(Role.decode)
    total = wants[Role.prefill] * gp + wants[Role.decode] * gd
    share = math.floor(budget * wants[Role.prefill] * gp / total / gp) if total else p_min
    p = min(max(share, p_min), max(p_min, (budget - d_min * gd) // gp), p_max)
    d = min(max((budget - p * gp) // gd, d_min), d_max)
    return {Role.prefill: p, Role.decode: d}


def fit_budget(ctx: Context, current: Counts, wants: Counts, needs: dict[Role, Need]) -> Fit:
    """The wants cut to the GPU budget, and the role that gives engines, if one does."""
    budget = ctx.auto.gpu_budget
    planned = {r: max(wants[r], current[r]) for r in ROLES}
    if budget is None or gpu_total(ctx, planned) <= budget:
        return Fit(wants)
    out = {r: min(wants[r], current[r]) for r in ROLES}
    spare = budget - gpu_total(ctx, current)
    for role in sorted(ROLES, key=lambda r: -needs[r].pressure):
        extra = max(min(wants[role] - current[role], spare // ctx.gpus(role)), 0)
        out[role] = current[role] + extra if extra else out[role]
        spare -= extra * ctx.gpus(role)
    short = [r for r in ROLES if wants[r] > max(out[r], current[r])]
    if not short:
        return Fit(out)
    if all(needs[r].violated for r in ROLES):
        if gpu_total(ctx, current) < budget:
            return _share_free(ctx, current, wants, budget)
        return _rebalance(ctx, current, needs, budget)
    return _take(ctx, current, wants, needs, out, spare, max(short, key=lambda r: needs[r].pressure))


def _take(
    ctx: Context,
    current: Counts,
    wants: Counts,
    needs: dict[Role, Need],
    out: Counts,
    spare: int,
    taker: Role,
) -> Fit:
    """The short role takes engines from the other, down to that one's model floor, while
    the other meets its own target."""
    budget, donor = ctx.auto.gpu_budget, other(taker)
    have = max(out[taker], current[taker])
    if needs[donor].violated:
        missed = note(NoteKind.donor_misses, donor, budget=budget)
        return Fit({**out, taker: have}, budget_full=taker, notes=(missed,))
    low, _ = ctx.bounds(donor)
    floor = max(low, needs[donor].up)
    g, gd = ctx.gpus(taker), ctx.gpus(donor)
    missing = (wants[taker] - have) * g - spare
    give = max(min(current[donor] - floor, -(-missing // gd)), 0)
    if not give:
        kept = note(NoteKind.donor_needs, donor, budget=budget, engines=current[donor])
        return Fit({**out, taker: have}, budget_full=taker, notes=(kept,))
    out = {**out, donor: current[donor] - give}
    spare += give * gd
    out[taker] = have + min(wants[taker] - have, spare // g)
    return Fit(out, donor=donor)


def _share_free(ctx: Context, current: Counts, wants: Counts, budget: int) -> Fit:
    """Free GPUs go to both roles in proportion to what each wants; neither shrinks."""
    split = split_budget(ctx, wants, budget)
    p = max(split[Role.prefill], current[Role.prefill])
    d = max(split[Role.decode], current[Role.decode])
    gp, gd = ctx.gpus(Role.prefill), ctx.gpus(Role.decode)
    if p * gp + d * gd > budget:
        d = max(current[Role.decode], (budget - p * gp) // gd)
        p = min(p, (budget - d * gd) // gp)
    shared = note(NoteKind.free_shared, prefill=p, decode=d)
    return Fit({Role.prefill: p, Role.decode: d}, notes=(shared,))


def _rebalance(ctx: Context, current: Counts, needs: dict[Role, Need], budget: int) -> Fit:
    """Both roles miss their targets: move up to max_step engines from one role to the
    other when that lowers the worse need/engines ratio by more than the tolerance."""

    def shortfall(split: Counts) -> float:
        return max(needs[r].up / split[r] for r in ROLES)

    best, best_score = current, shortfall(current)
    for taker in ROLES:
        donor = other(taker)
        (_, high), (low, _) = ctx.bounds(taker), ctx.bounds(donor)
        for k in range(1, ctx.auto.max_step + 1):
            freed = -(-k * ctx.gpus(taker) // ctx.gpus(donor))
            split = {taker: current[taker] + k, donor: current[donor] - freed}
            if split[taker] > high or split[donor] < low or gpu_total(ctx, split) > budget:
                break
            if shortfall(split) < best_score:
                best, best_score = split, shortfall(split)
    model = {"need_prefill": needs[Role.prefill].up, "need_decode": needs[Role.decode].up}
    if best is current or best_score > shortfall(current) * (1.0 - ctx.tol):
        return Fit(dict(current), notes=(note(NoteKind.rebalance_futile, **model),))
    moved = note(NoteKind.rebalancing, prefill=best[Role.prefill], decode=best[Role.decode], **model)
    return Fit(
        dict(best),
        donor=next(r for r in ROLES if best[r] < current[r]),
        rebalanced=next(r for r in ROLES if best[r] > current[r]),
        notes=(moved,),
    )
