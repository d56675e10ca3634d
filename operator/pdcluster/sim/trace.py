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
import re
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

    def window(self, start_s: float, end_s: float) -> Trace:
        """The requests arriving in [start, end), their times kept."""
        keep = [i for i, t in enumerate(self.arrival_s) if start_s <= t < end_s]
        return Trace(
            self.name,
            [self.arrival_s[i] for i in keep],
            [self.input_tokens[i] for i in keep],
            [self.output_tokens[i] for i in keep],
            [self.blocks[i] for i in keep],
            self.block_tokens,
        )

    def burst(self, start_s: float, duration_s: float, factor: float, seed: int = 0) -> Trace:
        """The same trace with `factor` times the load in [start, start + duration): the
        window's requests replicated (other users, their own prefixes)."""
        end_s = start_s + duration_s
        inside = self.window(start_s, end_s).replicated(factor, seed=seed, jitter_s=min(30.0, duration_s / 4))
        parts = (self.window(-math.inf, start_s), inside, self.window(end_s, math.inf))
        return Trace(
            f"{self.name}+burst",
            [t for p in parts for t in p.arrival_s],
            [n for p in parts for n in p.input_tokens],
            [n for p in parts for n in p.output_tokens],
            [b for p in parts for b in p.blocks],
            self.block_tokens,
        )


def phases(parts: list[Trace], name: str) -> Trace:
    """Traces played one after another, each from where the one before ended."""
    arrival, inputs, outputs, blocks, offset = [], [], [], [], 0.0
    for k, part in enumerate(parts):
        start = part.arrival_s[0] if part.arrival_s else 0.0
        for t, i, o, b in zip(
            part.arrival_s, part.input_tokens, part.output_tokens, part.blocks, strict=True
        ):
            arrival.append(offset + t - start)
            inputs.append(i)
            outputs.append(o)
            blocks.append(tuple(h + (k << 48) for h in b))  # phases share no prefixes
        offset += part.span_s + 1.0
    return Trace(name, arrival, inputs, outputs, blocks)


def detect_format(path: Path) -> str:
    return "azure" if path.suffix == ".csv" else "mooncake"


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


def load_trace(path: str | Path, fmt: str | None = None, *, seed: int = 0) -> Trace:
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt == "mooncake":
        trace = _mooncake(path, seed)
    elif fmt == "azure":
        trace = _azure(path)
    else:
        raise TraceError(f"unknown trace format {fmt!r} (mooncake or azure)")
    if trace.span_s <= 0:
        raise TraceError(f"{path}: requests at two different times at least are needed (a rate)")
    return trace


def _count(value: object, where: str, field: str, *, low: int) -> int:
    """A whole number >= low from JSON or CSV (bool is not one, a float with a fraction neither)."""
    if isinstance(value, str):
        value = value.strip()
        try:
            value = int(value) if re.fullmatch(r"[+-]?\d+", value) else float(value)
        except ValueError:
            raise TraceError(f"{where}: {field} {value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(f"{where}: {field} {value!r} is not a number")
    if value != int(value) or value < low:
        raise TraceError(f"{where}: {field} {value!r} is not a whole number >= {low}")
    return int(value)


def _quantum_ms(stamps: list[int]) -> float:
    """The spacing of quantised timestamps, or 0 when they are not quantised."""
    distinct = sorted(set(stamps))
    if len(distinct) < 2 or len(distinct) > len(stamps) // 4:
        return 0.0
    return float(statistics.median(b - a for a, b in itertools.pairwise(distinct)))


def _mooncake(path: Path, seed: int) -> Trace:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise TraceError(f"{where}: a JSON object is expected")
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in row]
        if missing:
            raise TraceError(f"{where}: missing {', '.join(missing)}")
        hashes = row.get("hash_ids") or []
        if not isinstance(hashes, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hashes
        ):
            raise TraceError(f"{where}: hash_ids must be a list of integers")
        rows.append(
            (
                _count(row["timestamp"], where, "timestamp", low=0),
                _count(row["input_length"], where, "input_length", low=0),
                _count(row["output_length"], where, "output_length", low=0),
                tuple(hashes),
            )
        )
    if not rows:
        raise TraceError(f"{path}: no requests")
    stamps = [r[0] for r in rows]
    quantum = _quantum_ms(stamps)
    rng = random.Random(seed)
    arrival = [(t + (rng.uniform(0.0, quantum) if quantum else 0.0)) / 1000.0 for t in stamps]
    order = sorted(range(len(rows)), key=arrival.__getitem__)
    return Trace(
        path.stem,
        [arrival[i] for i in order],
        [max(rows[i][1], 1) for i in order],
        [max(rows[i][2], 1) for i in order],
        [rows[i][3] for i in order],
    )


def _azure(path: Path) -> Trace:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise TraceError(f"{path}:1: header lacks {', '.join(sorted(missing))}")
        rows = []
        for number, r in enumerate(reader, 2):
            where = f"{path}:{number}"
            if None in r.values() or None in r:
                raise TraceError(f"{where}: {len(reader.fieldnames or ())} columns expected")
            try:
                # Seven fractional digits, which datetime does not parse: the 7th is cut.
                stamp = datetime.fromisoformat(r["TIMESTAMP"].strip()[:26])
            except ValueError:
                raise TraceError(f"{where}: TIMESTAMP {r['TIMESTAMP']!r} is not an ISO time") from None
            rows.append(
                (
                    stamp,
                    _count(r["ContextTokens"], where, "ContextTokens", low=0),
                    _count(r["GeneratedTokens"], where, "GeneratedTokens", low=0),
                )
            )
    if not rows:
        raise TraceError(f"{path}: no requests")
    if len({s.tzinfo is None for s, _, _ in rows}) > 1:
        raise TraceError(f"{path}: TIMESTAMPs mix times with and without a time zone")
    start = min(s for s, _, _ in rows)
    arrival = [(s - start).total_seconds() for s, _, _ in rows]
    order = sorted(range(len(rows)), key=arrival.__getitem__)
    return Trace(
        path.stem,
        [arrival[i] for i in order],
        [max(rows[i][1], 1) for i in order],
        [max(rows[i][2], 1) for i in order],
        [() for _ in order],
    )
