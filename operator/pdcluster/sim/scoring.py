"""Scoring a simulated run against an SLO: attainment, goodput, GPU-hours.

`pdctl plan` and `pdctl crossover` both score with this module.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from pdcluster import perf
from pdcluster.sim.fleet import Result
from pdcluster.sim.trace import Trace


def band(target: float) -> tuple[float, float]:
    """The static-best attainments the rate search accepts for a target: +-5 points at
    90%, +-0.5 at 99% (half the distance to 100%)."""
    half = (1.0 - target) / 2.0
    return target - half, min(target + half, 1.0)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    itl_ms: float
    plus_prefill: bool  # a request's TTFT target adds its own isolated prefill time

    def ttft_targets_s(self, trace: Trace, profile: perf.Profile) -> list[float]:
        if not self.plus_prefill:
            return [self.ttft_ms / 1000.0] * len(trace)
        return [(self.ttft_ms + profile.prefill_one_ms(n)) / 1000.0 for n in trace.input_tokens]


@dataclass(frozen=True)
class Score:
    policy: str
    attainment: float
    goodput_rps: float
    gpu_hours: float
    ttft_p90_ms: float
    itl_p90_ms: float
    decisions: int
    unfinished: int
    good: int  # requests within the SLO
    split: tuple[int, int] | None = None  # prefill:decode engines, where the policy is static
    requests: int = 0  # requests scored (those after the warm-up)
    cut: bool = False  # a cut-off stopped the run: attainment is a bound it fell below

    @property
    def goodput_per_gpu_hour(self) -> float:
        """Requests within the SLO per GPU-hour."""
        return self.good / self.gpu_hours if self.gpu_hours else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "attainment": round(self.attainment, 4),
            "goodput_rps": round(self.goodput_rps, 3),
            "gpu_hours": round(self.gpu_hours, 3),
            "goodput_per_gpu_hour": round(self.goodput_per_gpu_hour, 1),
            "ttft_p90_ms": round(self.ttft_p90_ms, 1),
            "itl_p90_ms": round(self.itl_p90_ms, 2),
            "decisions": self.decisions,
            "unfinished": self.unfinished,
        }


def gpu_seconds_before(result: Result, t_s: float) -> float:
    """The GPU-seconds the fleet held before `t_s` (the timeline marks every change)."""
    held, since, total = 0, 0.0, 0.0
    for mark in result.timeline:
        if mark[0] >= t_s:
            break
        total += held * (mark[0] - since)
        held, since = mark[5], mark[0]
    return total + held * (min(t_s, result.end_s) - since) if t_s > since else total


def score(
    result: Result, trace: Trace, ttft_targets_s: list[float], itl_ms: float, from_s: float = 0.0
) -> Score:
    """The run scored on the requests that arrive from `from_s` on, and the GPU-hours held
    from then on: what comes before is warm-up, the same for every policy."""
    itl_s = itl_ms / 1000.0
    first = bisect_left(trace.arrival_s, from_s) if from_s > 0 else 0
    good = 0
    ttfts, itls = [], []
    for i in range(first, len(trace)):
        if not result.finished[i]:
            continue
        ttfts.append(result.ttft_s[i])
        if trace.output_tokens[i] > 1:
            itls.append(result.itl_s[i])
        if result.ttft_s[i] <= ttft_targets_s[i] and result.itl_s[i] <= itl_s:
            good += 1
    scored = len(trace) - first
    if first:
        span = trace.arrival_s[-1] - from_s
        gpu_seconds = result.gpu_seconds - gpu_seconds_before(result, from_s)
    else:
        span, gpu_seconds = trace.span_s, result.gpu_seconds
    return Score(
        result.policy,
        good / max(scored, 1),
        good / max(span, 1e-9),
        gpu_seconds / 3600.0,
        perf.percentile(ttfts, 90) * 1000.0,
        perf.percentile(itls, 90) * 1000.0 if itls else 0.0,
        sum(1 for t, _, _, _ in result.decisions if t >= from_s),
        scored - sum(result.finished[first:]),
        good,
        requests=scored,
    )
