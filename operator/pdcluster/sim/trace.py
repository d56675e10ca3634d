"""Request traces for the fleet simulator.

Two public formats (see ../shared/traces/README.md):

- Mooncake JSONL: {"timestamp": ms, "input_length", "output_length", "hash_ids"}; hash_ids
  are prefix-block hashes of 512 tokens. The conversation trace's timestamps are
  quantised (about 3 s apart); replaying them as-is makes a burst every quantum, so
  arrivals are spread uniformly inside their quantum with a seeded generator.
- Azure LLM inference CSV: TIMESTAMP,ContextTokens,GeneratedTokens with 7 fractional
  digits, which Python's datetime does not parse: the 7th is cut.

Two ways to raise the load: `scaled` compresses time (2.0 replays the same requests in
half the time); `replicated` keeps the time axis and plays k independent copies of the
trace's users (each request copied, its arrival jittered, its prefix hashes made
private to its copy), so a load pattern over an hour stays an hour long.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Trace:
    name: str
    arrival_s: list[float]  # sorted
    input_tokens: list[int]
    output_tokens: list[int]
    blocks: list[tuple[int, ...]]  # prefix-block hashes per request; empty without prefix data
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def span_s(self) -> float:
        return self.arrival_s[-1] - self.arrival_s[0] if self.arrival_s else 0.0

    def scaled(self, rate_scale: float) -> Trace:
        start = self.arrival_s[0] if self.arrival_s else 0.0
        arrival = [(t - start) / rate_scale for t in self.arrival_s]
        return Trace(
            self.name, arrival, self.input_tokens, self.output_tokens, self.blocks, self.block_tokens
        )

    def replicated(self, factor: float, seed: int = 0, jitter_s: float = 30.0) -> Trace:
        """`factor` copies (a fractional copy keeps each request with that probability).

        A copy's arrival moves by up to `jitter_s` either way, enough that copies of one
        long prompt do not land together (they are other users), short enough to keep
        the load's pattern over minutes. A shift past either end of the trace is
        reflected back inside: clamping would pile those copies onto the first and last
        instant (thousands of requests at once at high factors) and a burst the trace
        never had.
        """
        rng = random.Random(seed)
        whole = math.floor(factor)
        start, end = (self.arrival_s[0], self.arrival_s[-1]) if self.arrival_s else (0.0, 0.0)
        rows = []
        for i, t in enumerate(self.arrival_s):
            copies = whole + (1 if rng.random() < factor - whole else 0)
            for c in range(copies):
                shifted = t + rng.uniform(-jitter_s, jitter_s) if c else t
                if shifted < start:
                    shifted = min(2 * start - shifted, end)
                elif shifted > end:
                    shifted = max(2 * end - shifted, start)
                blocks = self.blocks[i] if c == 0 else tuple(h + (c << 40) for h in self.blocks[i])
                rows.append((shifted, self.input_tokens[i], self.output_tokens[i], blocks))
        rows.sort(key=lambda r: r[0])
        return Trace(
            self.name,
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
            [r[3] for r in rows],
            self.block_tokens,
        )


def detect_format(path: Path) -> str:
    return "azure" if path.suffix == ".csv" else "mooncake"


def load_trace(path: str | Path, fmt: str | None = None, *, seed: int = 0) -> Trace:
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt == "mooncake":
        return _mooncake(path, seed)
    if fmt == "azure":
        return _azure(path)
    raise ValueError(f"unknown trace format {fmt!r} (mooncake or azure)")


def _quantum_ms(stamps: list[int]) -> float:
    """The spacing of quantised timestamps, or 0 when they are not quantised."""
    distinct = sorted(set(stamps))
    if len(distinct) < 2 or len(distinct) > len(stamps) // 4:
        return 0.0
    return float(statistics.median(b - a for a, b in itertools.pairwise(distinct)))


def _mooncake(path: Path, seed: int) -> Trace:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    stamps = [int(r["timestamp"]) for r in rows]
    quantum = _quantum_ms(stamps)
    rng = random.Random(seed)
    arrival = [(t + (rng.uniform(0.0, quantum) if quantum else 0.0)) / 1000.0 for t in stamps]
    order = sorted(range(len(rows)), key=arrival.__getitem__)
    return Trace(
        path.stem,
        [arrival[i] for i in order],
        [max(int(rows[i]["input_length"]), 1) for i in order],
        [max(int(rows[i]["output_length"]), 1) for i in order],
        [tuple(rows[i].get("hash_ids") or ()) for i in order],
    )


def _azure(path: Path) -> Trace:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    stamps = [datetime.fromisoformat(r["TIMESTAMP"].strip()[:26]) for r in rows]
    start = min(stamps)
    arrival = [(t - start).total_seconds() for t in stamps]
    order = sorted(range(len(rows)), key=arrival.__getitem__)
    return Trace(
        path.stem,
        [arrival[i] for i in order],
        [max(int(rows[i]["ContextTokens"]), 1) for i in order],
        [max(int(rows[i]["GeneratedTokens"]), 1) for i in order],
        [() for _ in order],
    )
