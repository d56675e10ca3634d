"""Request traces drawn from distributions fitted to the public traces, for a demo or a
test that must run without the trace files (they stay outside the repository).

The figures are measured on the files described in ../shared/traces/README.md by
`benchmarks/trace_figures.py`, which prints them:

- Mooncake's conversation trace (Kimi, one hour; kvcache-ai/Mooncake, Apache-2.0):
  3.40 requests/s with exponential-like gaps (CV 1.01); prompts log-normal with median
  6,909 and p90 27,367 tokens (max 126,195); answers median 350, p90 597 (max 2,000).
  Every prompt starts with the same 512-token block (a system prompt); 38.7% continue an
  earlier conversation, reusing on average 71% of their blocks (median 80%), and block
  reuse over the hour is 36.6%.
- Azure's 2023 conversation trace (AzurePublicDataset, CC-BY-4.0; Splitwise, ISCA'24):
  5.53 requests/s (gap CV 1.09); prompts median 1,020, p90 2,735 (max 14,050); answers
  median 129, p90 424 (max 1,000); no prefix data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdcluster.sim.trace import MOONCAKE_BLOCK_TOKENS, Trace

Z90 = 1.2816  # the standard normal's 90th percentile


@dataclass(frozen=True)
class LogNormal:
    median: float
    p90: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        sigma = math.log(self.p90 / self.median) / Z90
        drawn = rng.lognormal(math.log(self.median), sigma, n)
        return np.clip(np.rint(drawn), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class TraceShape:
    name: str
    rate_rps: float
    prompt: LogNormal
    answer: LogNormal
    continue_share: float = 0.0  # requests that continue an earlier conversation
    reused_share_mean: float = 0.0  # of a continuing prompt's blocks, those of the earlier one
    shared_first_block: bool = False  # one system prompt in front of every prompt


MOONCAKE_CONVERSATION = TraceShape(
    "conversation",
    rate_rps=3.40,
    prompt=LogNormal(median=6_909, p90=27_367, low=1, high=126_195),
    answer=LogNormal(median=350, p90=597, low=1, high=2_000),
    continue_share=0.387,
    reused_share_mean=0.71,
    shared_first_block=True,
)
AZURE_CONVERSATION = TraceShape(
    "azure-conversation",
    rate_rps=5.53,
    prompt=LogNormal(median=1_020, p90=2_735, low=1, high=14_050),
    answer=LogNormal(median=129, p90=424, low=1, high=1_000),
)
# A conversation continues one of this many recent ones: Kimi's users come back within
# minutes, not to a conversation of an hour ago.
RECENT_CONVERSATIONS = 200
CANDIDATES = 8


def generate(shape: TraceShape, duration_s: float, *, seed: int = 0) -> Trace:
    """Poisson arrivals at the shape's rate over `duration_s`, lengths and prefixes drawn."""
    rng = np.random.default_rng(seed)
    n = int(rng.poisson(shape.rate_rps * duration_s))
    arrival = np.sort(rng.uniform(0.0, duration_s, n))
    prompts, answers = shape.prompt.sample(rng, n), shape.answer.sample(rng, n)
    blocks: list[tuple[int, ...]] = []
    conversations: list[tuple[int, ...]] = []  # the latest prompt's blocks of each recent one
    fresh = iter(range(1, 1 << 62))  # block 0 is the shared system prompt
    for i in range(n):
        if shape.continue_share and conversations and rng.uniform() < shape.continue_share:
            # This prompt's length is drawn as any other's, its reused share around the mean;
            # of a few recent conversations, it continues the shortest that holds that share
            # (a follow-up carries its conversation's history), else the longest.
            share = rng.beta(4 * shape.reused_share_mean, 4 * (1 - shape.reused_share_mean))
            want = max(1, round(share * _blocks(prompts[i])))
            picks = [int(c) for c in rng.integers(len(conversations), size=CANDIDATES)]
            long_enough = [c for c in picks if len(conversations[c]) >= want]
            k = min(long_enough, key=lambda c: len(conversations[c])) if long_enough else max(
                picks, key=lambda c: len(conversations[c]))
            reused = min(len(conversations[k]), want)
            chain = conversations[k][:reused] + tuple(next(fresh) for _ in range(_blocks(prompts[i]) - reused))
            conversations[k] = chain
        else:
            head = (0,) if shape.shared_first_block else ()
            chain = head + tuple(next(fresh) for _ in range(_blocks(prompts[i]) - len(head)))
            if shape.continue_share:
                conversations = [*conversations[-(RECENT_CONVERSATIONS - 1):], chain]
        blocks.append(chain if shape.continue_share or shape.shared_first_block else ())
    return Trace(shape.name, arrival.tolist(), prompts.tolist(), answers.tolist(), blocks)


def _blocks(tokens: int) -> int:
    return max(1, math.ceil(tokens / MOONCAKE_BLOCK_TOKENS))
