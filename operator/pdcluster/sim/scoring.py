"""Scoring a simulated run against an SLO: attainment, goodput, GPU-hours.

`pdctl plan` and `pdctl crossover` both score with this module.
"""

from __future__ import annotations

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


def score(result: Result, trace: Trace, ttft_targets_s: list[float], itl_ms: float) -> Score:
    itl_s = itl_ms / 1000.0
    good = 0
    ttfts, itls = [], []
    for i, done in enumerate(result.finished):
        if not done:
            continue
        ttfts.append(result.ttft_s[i])
        if trace.output_tokens[i] > 1:
            itls.append(result.itl_s[i])
        if result.ttft_s[i] <= ttft_targets_s[i] and result.itl_s[i] <= itl_s:
            good += 1
    span = max(trace.span_s, 1e-9)
    return Score(
        result.policy,
        good / len(trace),
        good / span,
        result.gpu_seconds / 3600.0,
        perf.percentile(ttfts, 90) * 1000.0,
        perf.percentile(itls, 90) * 1000.0 if itls else 0.0,
        len(result.decisions),
        len(trace) - sum(result.finished),
        good,
    )
