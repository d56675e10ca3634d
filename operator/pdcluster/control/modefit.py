"""Would the observed traffic be served better by the other serving mode?

The answer is the crossover sweep's (`pdctl plan --compare-colocated`, docs/crossover.md):
goodput per GPU of the best colocated and the best disaggregated fleet by prompt length
and ITL target, for one latency profile. A sweep takes minutes, so the operator reads
the one shipped for the cluster's `autoscaling.profile` (pdcluster/data/crossover_<profile>.csv)
and interpolates it at the window's mean prompt (on a log scale, as the sweep's lengths
double) and the SLO's ITL target; a profile without a shipped sweep gets no advice.
"""

from __future__ import annotations

import csv
import math
from functools import cache

from pdcluster import perf
from pdcluster.api.v1alpha1 import ServingMode

TIE = 0.10  # goodputs this close are a tie (the sweep's bisection finds each to about 4%)
Table = dict[float, dict[int, float]]  # ITL target (ms) -> prompt tokens -> disaggregated / colocated


@cache
def table(profile: str) -> Table | None:
    source = perf.PROFILE_DATA / f"crossover_{profile}.csv"
    if not source.is_file():
        return None
    out: Table = {}
    with source.open() as f:
        for row in csv.DictReader(f):
            colocated = float(row["colocated_goodput_per_gpu"])
            disaggregated = float(row["disaggregated_goodput_per_gpu"])
            if colocated > 0 and disaggregated > 0:
                out.setdefault(float(row["itl_target_ms"]), {})[int(row["prompt_tokens"])] = (
                    disaggregated / colocated
                )
    return out


def _between(points: list[float], x: float) -> tuple[float, float, float]:
    """The two points around x and x's weight towards the second (clamped at the ends)."""
    if x <= points[0]:
        return points[0], points[0], 0.0
    if x >= points[-1]:
        return points[-1], points[-1], 0.0
    hi = next(i for i, p in enumerate(points) if p >= x)
    a, b = points[hi - 1], points[hi]
    return a, b, (x - a) / (b - a)


def ratio(t: Table, prompt_tokens: float, itl_target_ms: float) -> float:
    """Disaggregated over colocated goodput per GPU at this prompt and ITL target."""

    def at(itl: float) -> float:
        by_length = t[itl]
        lengths = sorted(by_length)
        logs = [math.log2(n) for n in lengths]
        a, b, w = _between(logs, math.log2(max(prompt_tokens, 1.0)))
        ra, rb = by_length[lengths[logs.index(a)]], by_length[lengths[logs.index(b)]]
        return math.exp((1 - w) * math.log(ra) + w * math.log(rb))

    a, b, w = _between(sorted(t), itl_target_ms)
    return math.exp((1 - w) * math.log(at(a)) + w * math.log(at(b)))


def mode_fit(
    mode: ServingMode, profile: str | None, prompt_tokens: float | None, itl_target_ms: float
) -> tuple[bool, str, str] | None:
    """(fits, reason, message) for the ModeFit condition; None without a sweep or traffic,
    and for a flexible pool, whose engines serve either way (router.prefillOnDecodeBelowTokens)."""
    t = table(profile) if profile else None
    if t is None or not prompt_tokens or mode == ServingMode.flexible:
        return None
    r = ratio(t, prompt_tokens, itl_target_ms)
    other = ServingMode.colocated if mode == ServingMode.disaggregated else ServingMode.disaggregated
    gain = r if other == ServingMode.disaggregated else 1.0 / r
    basis = (
        f"mean prompt {prompt_tokens:.0f} tokens, ITL target {itl_target_ms:.0f} ms; the crossover "
        f"sweep of profile {profile}, docs/crossover.md"
    )
    if gain > 1.0 + TIE:
        return (
            False,
            "OtherModeBetter",
            f"{other.value} would serve this traffic at {gain:.2f}x the goodput per GPU of {mode.value} "
            f"({basis}): consider spec.mode {other.value}",
        )
    if gain * (1.0 + TIE) < 1.0:
        why = f"{mode.value} serves this traffic at {1.0 / gain:.2f}x the goodput per GPU of {other.value}"
    else:
        why = f"both modes serve this traffic within {TIE:.0%} of each other per GPU"
    return True, "ModeFits", f"{why} ({basis})"
