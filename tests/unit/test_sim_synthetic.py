"""Generated stand-ins for the public traces (pdcluster.sim.synthetic) have the figures
they were fitted to."""

from __future__ import annotations

import numpy as np
import pytest

from pdcluster.sim import synthetic
from pdcluster.sim.trace import MOONCAKE_BLOCK_TOKENS

# benchmarks/trace_figures.py measures these on the real traces (docs in synthetic.py).
MOONCAKE_BLOCK_REUSE = 0.366


@pytest.mark.parametrize("shape", [synthetic.MOONCAKE_CONVERSATION, synthetic.AZURE_CONVERSATION])
def test_rate_and_length_quantiles_are_the_fitted_ones(shape):
    trace = synthetic.generate(shape, 7200.0, seed=3)
    assert len(trace) / 7200.0 == pytest.approx(shape.rate_rps, rel=0.05)
    for values, fitted in ((trace.input_tokens, shape.prompt), (trace.output_tokens, shape.answer)):
        x = np.asarray(values)
        assert np.median(x) == pytest.approx(fitted.median, rel=0.05)
        assert np.percentile(x, 90) == pytest.approx(fitted.p90, rel=0.08)
        assert x.min() >= fitted.low and x.max() <= fitted.high
    assert trace.arrival_s == sorted(trace.arrival_s)


def test_conversations_share_their_prefixes_as_the_trace_does():
    shape = synthetic.MOONCAKE_CONVERSATION
    trace = synthetic.generate(shape, 3600.0, seed=5)
    seen: set[int] = set()
    continuing, reused, total = 0, 0, 0
    for tokens, blocks in zip(trace.input_tokens, trace.blocks, strict=True):
        assert len(blocks) == -(-tokens // MOONCAKE_BLOCK_TOKENS)  # a block per 512 tokens
        assert blocks[0] == 0  # the shared system prompt
        run = 0
        while run < len(blocks) and blocks[run] in seen:
            run += 1
        continuing += run >= 2
        reused += sum(h in seen for h in blocks)
        total += len(blocks)
        seen.update(blocks)
    assert continuing / len(trace) == pytest.approx(shape.continue_share, abs=0.04)
    assert abs(reused / total - MOONCAKE_BLOCK_REUSE) < 0.12


def test_short_prompts_carry_no_prefix_data_and_seeds_repeat():
    a = synthetic.generate(synthetic.AZURE_CONVERSATION, 600.0, seed=1)
    assert all(b == () for b in a.blocks)
    b = synthetic.generate(synthetic.AZURE_CONVERSATION, 600.0, seed=1)
    assert (a.arrival_s, a.input_tokens) == (b.arrival_s, b.input_tokens)
