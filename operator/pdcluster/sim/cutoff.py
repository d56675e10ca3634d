"""Stopping a run that can no longer attain what a search needs of it.

The static searches (sim/plan.py) only ask of most splits whether they beat a figure:
the split they climb from, or the attainment a fleet must match. A run can stop once
enough scored requests have missed the SLO that the rest could not make up the
difference, even if every one of them met it: a bound, not a guess, so a run that
completes is exactly the run without a cut-off, and a run that stops is known to fall
short. Requests count as missed when their first token came late, their mean ITL was
over the target, or their TTFT deadline passed with no first token at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A request counts as missed by its deadline only once the clock is this far past it, so
# float rounding between `arrival + target < now` and `first - arrival > target` never
# calls a request missed that the scoring would call met.
DEADLINE_MARGIN_S = 1e-6


@dataclass(frozen=True)
class Deadlines:
    """What a cut-off needs of a trace and SLO, built once per setup: the scored requests
    (from `first` on) in the order of their TTFT deadlines."""

    targets_s: list[float]
    itl_s: float
    first: int  # the first scored request (those before are warm-up)
    order: list[int]  # scored requests by arrival + target
    deadline_s: list[float]  # their deadlines, in that order

    @classmethod
    def of(cls, arrival_s: list[float], targets_s: list[float], itl_s: float, first: int) -> Deadlines:
        order = sorted(range(first, len(arrival_s)), key=lambda i: arrival_s[i] + targets_s[i])
        return cls(targets_s, itl_s, first, order, [arrival_s[i] + targets_s[i] for i in order])

    @property
    def scored(self) -> int:
        return len(self.order)


@dataclass
class Cutoff:
    """One run's count of scored requests known to miss; `hopeless` once fewer than
    `needed` could still meet the SLO."""

    deadlines: Deadlines
    needed: int
    missed: int = 0
    expired: int = 0  # deadlines passed so far (a prefix of deadlines.order)
    counted: set[int] = field(default_factory=set)  # missed by deadline, no token yet

    def first_token(self, i: int, ttft_s: float) -> None:
        if i >= self.deadlines.first and ttft_s > self.deadlines.targets_s[i] and i not in self.counted:
            self.missed += 1

    def finished(self, i: int, ttft_s: float, itl_s: float) -> None:
        d = self.deadlines
        if i >= d.first and ttft_s <= d.targets_s[i] and itl_s > d.itl_s:
            self.missed += 1

    def hopeless(self, now_s: float, first_token_s: list[float]) -> bool:
        d = self.deadlines
        while self.expired < d.scored and d.deadline_s[self.expired] < now_s - DEADLINE_MARGIN_S:
            i = d.order[self.expired]
            if math.isnan(first_token_s[i]):  # no token by its deadline: it cannot meet the SLO
                self.counted.add(i)
                self.missed += 1
            self.expired += 1
        return d.scored - self.missed < self.needed
