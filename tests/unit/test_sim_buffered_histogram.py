"""The fleet's buffered histograms snapshot exactly what plain ones do."""

from __future__ import annotations

import random

from pdcluster.observability import Histogram
from pdcluster.sim.fleet_state import BufferedHistogram


def test_a_buffered_histogram_snapshots_what_a_plain_one_does() -> None:
    rng = random.Random(3)
    bounds = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
    plain, buffered = Histogram(bounds), BufferedHistogram(bounds)
    for _ in range(5):
        values = [
            rng.choice([0.01, 5.0, 7.0]) if rng.random() < 0.2 else rng.expovariate(2.0) for _ in range(300)
        ]
        for v in values:
            plain.observe(v)
            buffered.observe(v)
        plain.observe_steps(0.02, 0.001, 40, 3, 2)
        buffered.observe_steps(0.02, 0.001, 40, 3, 2)
        assert buffered.snapshot() == plain.snapshot()  # counts on the bounds too, and the sum to the bit
    assert buffered.snapshot() == plain.snapshot()  # nothing new: nothing changes
