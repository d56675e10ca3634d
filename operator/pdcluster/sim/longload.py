"""Day-long request traces: a rate curve over hours or days, and lengths from a source.

The one-hour public traces hardly move, so a static fleet sized in hindsight is close to
optimal on them; real fleets live through days. Two public sources give the shape
(../shared/traces/README.md, "Long-horizon load"):

- ServeGen (Alibaba Bailian production, 14 days; Apache-2.0; Xiang et al., "ServeGen",
  arXiv 2505.09999): every client's request rate and inter-arrival pattern (Gamma or
  Weibull, with its coefficient of variation) per 600 s window, and each model's input and
  output length histograms (powers of two) per 6-hour window. `servegen_trace` draws
  each client's arrivals with its own pattern at its own rate times one factor, so the
  bursts of the big clients stay bursts, and lengths from the window's histograms.
- Any rate curve (CSV `t_s,rate_rps`, hourly or finer; e.g. the Azure 2024 code week's
  hourly shape, CC-BY-4.0, Stojkovic et al., "DynamoLLM", HPCA 2025) over a base trace:
  `curve_over_trace` plays the base trace round and round, keeping each request's lengths
  and prefix blocks and the base's within-minute burstiness, with as many copies of each
  stretch as the curve asks for at that hour.

Both write Mooncake JSONL (`write_mooncake`), which `pdctl plan --trace` and the demo read.
"""

from __future__ import annotations

import csv
import io
import json
import math
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdcluster.sim.trace import Trace, TraceError

SERVEGEN_WINDOW_S = 600.0  # one row of a ServeGen client file
SERVEGEN_LENGTH_WINDOW_S = 6 * 3600.0  # one histogram of servegen_length_hist_6h.csv
# Copies of one base request land this far apart at most: other users of the same
# minute, so a burst of the base trace stays a burst of the same minute.
COPY_JITTER_S = 5.0


@dataclass(frozen=True)
class RateCurve:
    """Requests per second, constant within each window [start_s[i], start_s[i + 1])."""

    start_s: tuple[float, ...]
    rate_rps: tuple[float, ...]
    end_s: float

    def __post_init__(self) -> None:
        if not self.start_s or len(self.start_s) != len(self.rate_rps):
            raise TraceError("a rate curve needs one rate per window, and one window at least")
        if any(b <= a for a, b in zip(self.start_s, (*self.start_s[1:], self.end_s), strict=True)):
            raise TraceError("a rate curve's times must increase")
        if any(not math.isfinite(r) or r < 0 for r in self.rate_rps):
            raise TraceError("a rate curve's rates must be finite and >= 0")

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s[0]

    @property
    def peak_rps(self) -> float:
        return max(self.rate_rps)

    @property
    def mean_rps(self) -> float:
        return self.expected_requests() / self.span_s

    def windows(self) -> Iterable[tuple[float, float, float]]:
        """(start, end, rate) of each window."""
        ends = (*self.start_s[1:], self.end_s)
        return zip(self.start_s, ends, self.rate_rps, strict=True)

    def expected_requests(self) -> float:
        return sum((end - start) * rate for start, end, rate in self.windows())

    def rates_at(self, t_s: np.ndarray) -> np.ndarray:
        """The rate at each time (0 outside the curve)."""
        i = np.searchsorted(self.start_s, t_s, side="right") - 1
        inside = (i >= 0) & (t_s < self.end_s)
        return np.where(inside, np.asarray(self.rate_rps)[np.clip(i, 0, None)], 0.0)

    def scaled(self, factor: float) -> RateCurve:
        return RateCurve(self.start_s, tuple(r * factor for r in self.rate_rps), self.end_s)

    def cut(self, start_s: float, duration_s: float) -> RateCurve:
        """The windows of [start, start + duration), re-based to start at 0."""
        end_s = start_s + duration_s
        kept = [(max(a, start_s), r) for a, b, r in self.windows() if b > start_s and a < end_s]
        if not kept:
            raise TraceError(f"the rate curve has no window in [{start_s:g}, {end_s:g}) s")
        end_s = min(end_s, self.end_s)
        return RateCurve(tuple(a - start_s for a, _ in kept), tuple(r for _, r in kept), end_s - start_s)


def read_rate_curve(path: str | Path) -> RateCurve:
    """A `t_s,rate_rps` CSV: each row's rate holds until the next row's time; the last row
    for as long as the spacing before it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None
    reader = csv.DictReader(io.StringIO(text))
    if not {"t_s", "rate_rps"} <= set(reader.fieldnames or ()):
        raise TraceError(f"{path}:1: the header must name t_s and rate_rps")
    times, rates = [], []
    for number, row in enumerate(reader, 2):
        try:
            times.append(float(row["t_s"]))
            rates.append(float(row["rate_rps"]))
        except (TypeError, ValueError):
            raise TraceError(f"{path}:{number}: t_s and rate_rps must be numbers") from None
    if len(times) < 2:
        raise TraceError(f"{path}: two rows at least are needed (the last window's length)")
    try:
        return RateCurve(tuple(times), tuple(rates), times[-1] + (times[-1] - times[-2]))
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None


def write_rate_curve(curve: RateCurve, out: io.TextIOBase) -> None:
    out.write("t_s,rate_rps\n")
    for start, _, rate in curve.windows():
        out.write(f"{start:g},{rate:.6g}\n")


def servegen_curve(rates_csv: str | Path, model: str) -> RateCurve:
    """A model's total rate per 600 s window from servegen_rates_10min.csv."""
    with Path(rates_csv).open(newline="") as f:
        rows = [(float(r["t_s"]), float(r["rate_rps"])) for r in csv.DictReader(f) if r["model"] == model]
    if not rows:
        raise TraceError(f"{rates_csv}: no rows for model {model!r}")
    rows.sort()
    return RateCurve(tuple(t for t, _ in rows), tuple(r for _, r in rows), rows[-1][0] + SERVEGEN_WINDOW_S)


def azure2024_curve(hourly_csv: str | Path) -> RateCurve:
    """The Azure 2024 week's hourly request rate (the digitized mid line), from t = 0."""
    with Path(hourly_csv).open(newline="") as f:
        rows = [(int(r["hour_index"]), float(r["req_per_min_mid"]) / 60.0) for r in csv.DictReader(f)]
    if not rows:
        raise TraceError(f"{hourly_csv}: no rows")
    rows.sort()
    return RateCurve(tuple(h * 3600.0 for h, _ in rows), tuple(r for _, r in rows), (rows[-1][0] + 1) * 3600.0)


# ---------------------------------------------------------------- lengths


@dataclass(frozen=True)
class LengthHistogram:
    """Token counts in bins [edges[i], edges[i + 1]) with weights; drawn log-uniform inside a bin."""

    edges: tuple[float, ...]
    weights: tuple[float, ...]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = np.asarray(self.weights, dtype=float)
        bins = rng.choice(len(p), size=n, p=p / p.sum())
        low = np.maximum(np.asarray(self.edges[:-1])[bins], 1.0)
        high = np.maximum(np.asarray(self.edges[1:])[bins], low + 1.0)
        return np.floor(np.exp(rng.uniform(np.log(low), np.log(high)))).astype(np.int64)

    def bin_of(self, tokens: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.edges, tokens, side="right") - 1


@dataclass(frozen=True)
class WindowLengths:
    start_s: float
    input: LengthHistogram
    output: LengthHistogram


def servegen_lengths(hist_csv: str | Path, model: str) -> list[WindowLengths]:
    """A model's input and output histograms per 6-hour window from servegen_length_hist_6h.csv.
    Bins are written `[low,high)`; the last one is open-ended in the source and drawn here
    up to twice its lower edge."""
    with Path(hist_csv).open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        edges = [float(h.strip("[)").split(",")[0]) for h in header[3:]]
        edges.append(2.0 * edges[-1])
        by_window: dict[float, dict[str, LengthHistogram]] = {}
        for row in reader:
            if row[0] != model:
                continue
            weights = tuple(float(w) for w in row[3:])
            by_window.setdefault(float(row[1]), {})[row[2]] = LengthHistogram(tuple(edges), weights)
    if not by_window:
        raise TraceError(f"{hist_csv}: no histograms for model {model!r}")
    return [
        WindowLengths(t, h["input_tokens"], h["output_tokens"])
        for t, h in sorted(by_window.items())
        if "input_tokens" in h and "output_tokens" in h
    ]


def _lengths_at(windows: list[WindowLengths], t_s: float) -> WindowLengths:
    """The histogram window holding t, repeating the source's span (14 days of 6-hour windows)."""
    span = windows[-1].start_s + SERVEGEN_LENGTH_WINDOW_S - windows[0].start_s
    t = windows[0].start_s + (t_s - windows[0].start_s) % span
    i = int(np.searchsorted([w.start_s for w in windows], t, side="right")) - 1
    return windows[max(i, 0)]


# ---------------------------------------------------------------- ServeGen arrivals


@dataclass(frozen=True)
class ClientRates:
    """Every client's rate and inter-arrival pattern per 600 s window: arrays (clients, windows)."""

    rate_rps: np.ndarray
    weibull: np.ndarray  # bool: Weibull, else Gamma
    shape: np.ndarray
    scale: np.ndarray

    @property
    def total_rps(self) -> np.ndarray:
        return self.rate_rps.sum(axis=0)


def read_servegen_clients(tar_path: str | Path, model: str) -> ClientRates:
    """The clients of one model from servegen_client_rate_traces.tar.xz (rows
    `t_s,rate_rps,cv,pattern,p1,p2`, one per 600 s window from t = 0)."""
    columns: list[list[tuple[float, bool, float, float]]] = []
    with tarfile.open(tar_path, "r:xz") as tar:
        for member in tar:
            if not member.isfile() or f"/{model}/" not in member.name:
                continue
            text = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
            columns.append([_client_window(line) for line in text.splitlines() if line.strip()])
    if not columns:
        raise TraceError(f"{tar_path}: no clients of model {model!r}")
    windows = min(len(c) for c in columns)
    table = np.array([[w for w in c[:windows]] for c in columns], dtype=float)
    return ClientRates(table[..., 0], table[..., 1].astype(bool), table[..., 2], table[..., 3])


def _client_window(line: str) -> tuple[float, bool, float, float]:
    _t, rate, _cv, pattern, p1, p2 = line.split(",")
    if not pattern or float(rate) <= 0:
        return (0.0, False, 1.0, 1.0)
    if float(p1) <= 0 or float(p2) <= 0:  # no fit for the window: Poisson gaps
        return (float(rate), False, 1.0, 1.0)
    return (float(rate), pattern == "Weibull", float(p1), float(p2))


def _mean_gap(weibull: bool, shape: float, scale: float) -> float:
    return scale * math.gamma(1 + 1 / shape) if weibull else shape * scale


def _client_arrivals(
    rng: np.random.Generator, rate: float, weibull: bool, shape: float, scale: float, first: float | None
) -> tuple[np.ndarray, float]:
    """One window of a renewal process with the client's gap distribution rescaled to its
    rate (the pattern keeps the burstiness, its CV; the rate the level), and the time of
    the arrival after the window. `first` is that time carried from the window before;
    None for a client that was silent (it starts inside a gap, not on an arrival)."""
    unit = 1.0 / (rate * _mean_gap(weibull, shape, scale))
    n = int(rate * SERVEGEN_WINDOW_S + 6 * math.sqrt(rate * SERVEGEN_WINDOW_S + 1) + 8)

    def gaps() -> np.ndarray:
        return (scale * rng.weibull(shape, n) if weibull else rng.gamma(shape, scale, n)) * unit

    g = gaps()
    if first is None:
        first = g[0] * rng.uniform()
    times = first + np.concatenate([[0.0], np.cumsum(g[1:])])
    while times[-1] < SERVEGEN_WINDOW_S:  # a very bursty client can need more gaps than the mean says
        times = np.concatenate([times, times[-1] + np.cumsum(gaps())])
    beyond = int(np.searchsorted(times, SERVEGEN_WINDOW_S))
    return times[:beyond], float(times[beyond] - SERVEGEN_WINDOW_S)


def servegen_trace(
    clients: ClientRates,
    lengths: list[WindowLengths],
    *,
    start_s: float,
    duration_s: float,
    rate_factor: float,
    seed: int = 0,
    name: str = "servegen",
) -> Trace:
    """Requests from `start_s` for `duration_s` (times re-based to 0), every client at
    `rate_factor` times its rate with its own inter-arrival pattern. Each client's process
    runs on across windows, and from the window before `start_s`, so the run does not begin
    with every client starting at once."""
    rng = np.random.default_rng(seed)
    first = int(start_s // SERVEGEN_WINDOW_S)
    windows = clients.rate_rps.shape[1]
    carry: list[float | None] = [None] * clients.rate_rps.shape[0]
    arrivals: list[np.ndarray] = []
    for k in range(-1, math.ceil(duration_s / SERVEGEN_WINDOW_S)):
        w = (first + k) % windows
        for c in range(len(carry)):
            if clients.rate_rps[c, w] <= 0:
                carry[c] = None
                continue
            times, carry[c] = _client_arrivals(
                rng,
                clients.rate_rps[c, w] * rate_factor,
                bool(clients.weibull[c, w]),
                float(clients.shape[c, w]),
                float(clients.scale[c, w]),
                carry[c],
            )
            if k >= 0:
                arrivals.append(times + k * SERVEGEN_WINDOW_S)
    t = np.sort(np.concatenate(arrivals)) if arrivals else np.zeros(0)
    t = t[t < duration_s]
    inputs, outputs = _draw_lengths(rng, lengths, start_s, t)
    return Trace(name, t.tolist(), inputs.tolist(), outputs.tolist(), [() for _ in range(len(t))])


def _draw_lengths(
    rng: np.random.Generator, lengths: list[WindowLengths], start_s: float, t: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    inputs = np.empty(len(t), dtype=np.int64)
    outputs = np.empty(len(t), dtype=np.int64)
    window = ((t + start_s) // SERVEGEN_LENGTH_WINDOW_S).astype(np.int64)
    for w in np.unique(window):
        at = window == w
        hist = _lengths_at(lengths, float(w) * SERVEGEN_LENGTH_WINDOW_S)
        inputs[at] = hist.input.sample(rng, int(at.sum()))
        outputs[at] = hist.output.sample(rng, int(at.sum()))
    return inputs, outputs


# ---------------------------------------------------------------- a curve over a base trace


def curve_over_trace(base: Trace, curve: RateCurve, *, seed: int = 0, name: str | None = None) -> Trace:
    """The curve's rate, the base trace's requests: the base is played round and round, and
    each request is kept `curve rate / base mean rate` times (a fraction as a chance), the
    copies within `COPY_JITTER_S` of it and with prefix blocks of their own."""
    if len(base) < 2 or base.span_s <= 0:
        raise TraceError(f"{base.name}: a base trace needs requests at two times at least")
    rng = np.random.default_rng(seed)
    offsets = np.asarray(base.arrival_s) - base.arrival_s[0]
    base_rate = len(base) / base.span_s
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    for lap in range(math.ceil(curve.span_s / base.span_s)):
        t = offsets + lap * base.span_s
        factor = curve.rates_at(t) / base_rate
        copies = np.floor(factor).astype(np.int64) + (rng.uniform(size=len(t)) < factor % 1.0)
        for i in np.flatnonzero(copies):
            for c in range(int(copies[i])):
                at = t[i] + (rng.uniform(-COPY_JITTER_S, COPY_JITTER_S) if c else 0.0)
                if 0 <= at < curve.span_s:
                    tag = (lap << 24 | c) << 40  # copies and laps are other users: no shared prefix
                    blocks = tuple(h + tag for h in base.blocks[i]) if tag else base.blocks[i]
                    rows.append((at, base.input_tokens[i], base.output_tokens[i], blocks))
    rows.sort(key=lambda r: r[0])
    return Trace(
        name or f"{base.name}@curve",
        [r[0] for r in rows],
        [r[1] for r in rows],
        [r[2] for r in rows],
        [r[3] for r in rows],
        base.block_tokens,
    )


def write_mooncake(trace: Trace, out: io.TextIOBase) -> int:
    """The trace as Mooncake JSONL (times in whole ms from 0); returns the requests written."""
    start = trace.arrival_s[0] if trace.arrival_s else 0.0
    for t, i, o, b in zip(trace.arrival_s, trace.input_tokens, trace.output_tokens, trace.blocks, strict=True):
        row = {"timestamp": round((t - start) * 1000), "input_length": i, "output_length": o, "hash_ids": list(b)}
        out.write(json.dumps(row, separators=(",", ":")) + "\n")
    return len(trace)
