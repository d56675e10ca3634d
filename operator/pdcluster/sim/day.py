"""Day-long benchmark scenarios: a day of traffic after a warm-up, its load sized so the
peak hour needs a given number of engines, and what a day's run looks like hour by hour.

Two sources (../shared/traces/README.md, "Long-horizon load"; sim/longload.py):

- `servegen-day`: ServeGen's m-large (Alibaba Bailian production; Apache-2.0; Xiang et
  al., arXiv 2505.09999), the day from t = 1,036,800 s (day 13 of 14, 00:00 local), every
  client's rate and inter-arrival pattern, lengths from the 6-hour histograms.
- `azure-code-weekday`: the Azure 2024 code trace's hourly shape on Tuesday 2024-05-14
  (hours 96-120 of the week; CC-BY-4.0; Stojkovic et al., "DynamoLLM", HPCA 2025) over
  the Azure 2023 code trace's requests (their lengths and within-minute burstiness).

Every scenario starts `WARMUP_S` before its day: the policies run through it from the
neutral split, and no policy is scored on it (sim/scoring.py `from_s`). With `prior_day`
the warm-up is a whole day longer: the day before, drawn on its own, so the seasonal
forecast (control/forecast.py) has a yesterday. The scored day and the two hours before
it are the same requests either way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdcluster import perf
from pdcluster.sim import longload
from pdcluster.sim.fleet import Result
from pdcluster.sim.plan import Setup, fleet_config, size_for, static_best
from pdcluster.sim.plan_config import PlanConfig, PolicyKnobs
from pdcluster.sim.scoring import SLO
from pdcluster.sim.trace import Trace, load_trace

DAY_S = 24 * 3600.0
WARMUP_S = 2 * 3600.0
SERVEGEN_DAY_START_S = 1_036_800.0
AZURE_WEEKDAY_START_H = 96  # Tuesday 2024-05-14 00:00 UTC; hour 0 is Friday 2024-05-10
SIZING_SAMPLE = 20_000  # lengths drawn to size the peak hour
DAY_SCENARIOS = ("servegen-day", "azure-code-weekday")
# The day before is a draw of its own: another seed, and the Azure base trace played from
# half its span on, so yesterday's bursts do not fall on today's minutes (the base trace
# is one hour played round and round: in phase, the forecast would remember bursts that
# real traffic does not repeat at the same minute of the next day).
PRIOR_SEED = 1_000
PRIOR_TAG = 1 << 80  # the day before's prefix blocks are other users' (no cache hits across)
BRACKET_TRIES = 12  # a level by simulation looks 1.5^12 (130x) either side of the models' factor


@dataclass(frozen=True)
class DaySource:
    """A day's trace at a rate factor, and the peak hour's load per unit of factor."""

    name: str
    peak_rps: float  # the peak hour's mean rate at factor 1 (the scored day only)
    peak_inputs: list[int]  # prompt and output lengths of that hour, for sizing
    peak_outputs: list[int]
    make: Callable[[float], Trace]
    make_peak: Callable[[float], Trace]  # the peak hour alone, to set a level by simulation
    warmup_s: float = WARMUP_S  # unscored time before the day


def after_prior(prior: Trace, day: Trace) -> Trace:
    """`day` (which starts WARMUP_S before the scored day) after `prior` (the DAY_S before
    it): one trace, the scored day from DAY_S + WARMUP_S on."""
    if prior.arrival_s and prior.arrival_s[-1] >= DAY_S:
        raise ValueError(f"{prior.name}: the day before must end within {DAY_S:g} s")
    return Trace(
        day.name,
        [*prior.arrival_s, *(t + DAY_S for t in day.arrival_s)],
        [*prior.input_tokens, *day.input_tokens],
        [*prior.output_tokens, *day.output_tokens],
        [*(tuple(b + PRIOR_TAG for b in blocks) for blocks in prior.blocks), *day.blocks],
        day.block_tokens,
    )


def rotated(trace: Trace, by_s: float) -> Trace:
    """The trace played from `by_s` after its start, round to its start again."""
    start, span = trace.arrival_s[0], trace.span_s
    order = sorted(range(len(trace)), key=lambda i: (trace.arrival_s[i] - start - by_s) % span)
    return Trace(
        trace.name,
        [start + (trace.arrival_s[i] - start - by_s) % span for i in order],
        [trace.input_tokens[i] for i in order],
        [trace.output_tokens[i] for i in order],
        [trace.blocks[i] for i in order],
        trace.block_tokens,
    )


def servegen_day(root: Path, seed: int = 0, prior_day: bool = False) -> DaySource:
    folder = root / "servegen"
    clients = longload.read_servegen_clients(folder / "servegen_client_rate_traces.tar.xz", "m-large")
    lengths = longload.servegen_lengths(folder / "servegen_length_hist_6h.csv", "m-large")
    start = SERVEGEN_DAY_START_S
    first = int(start // longload.SERVEGEN_WINDOW_S)
    per_hour = int(3600 // longload.SERVEGEN_WINDOW_S)
    total = clients.total_rps[first : first + int(DAY_S // longload.SERVEGEN_WINDOW_S)]
    hourly = total.reshape(-1, per_hour).mean(axis=1)
    peak = int(np.argmax(hourly))
    window = longload._lengths_at(lengths, start + peak * 3600.0)
    rng = np.random.default_rng(seed)

    def make(factor: float) -> Trace:
        day = longload.servegen_trace(
            clients,
            lengths,
            start_s=start - WARMUP_S,
            duration_s=WARMUP_S + DAY_S,
            rate_factor=factor,
            seed=seed,
            name="servegen-day",
        )
        if not prior_day:
            return day
        prior = longload.servegen_trace(
            clients,
            lengths,
            start_s=start - WARMUP_S - DAY_S,
            duration_s=DAY_S,
            rate_factor=factor,
            seed=seed + PRIOR_SEED,
            name="servegen-day, the day before",
        )
        return after_prior(prior, day)

    def make_peak(factor: float) -> Trace:
        return longload.servegen_trace(
            clients,
            lengths,
            start_s=start + peak * 3600.0,
            duration_s=3600.0,
            rate_factor=factor,
            seed=seed,
            name="servegen-day peak hour",
        )

    return DaySource(
        "servegen-day",
        float(hourly[peak]),
        window.input.sample(rng, SIZING_SAMPLE).tolist(),
        window.output.sample(rng, SIZING_SAMPLE).tolist(),
        make,
        make_peak,
        _warmup(prior_day),
    )


def _warmup(prior_day: bool) -> float:
    return WARMUP_S + DAY_S if prior_day else WARMUP_S


def azure_code_weekday(root: Path, seed: int = 0, prior_day: bool = False) -> DaySource:
    base = load_trace(root / "AzureLLMInferenceTrace_code_2023.csv")
    week = longload.azure2024_curve(root / "azure2024" / "azure2024_code_hourly_digitized.csv")
    starts = AZURE_WEEKDAY_START_H * 3600.0 - WARMUP_S
    curve = week.cut(starts, WARMUP_S + DAY_S)
    day = curve.cut(WARMUP_S, DAY_S)
    before = week.cut(starts - DAY_S, DAY_S) if prior_day else None
    shifted = rotated(base, base.span_s / 2.0) if prior_day else None

    def make(factor: float) -> Trace:
        today = longload.curve_over_trace(base, curve.scaled(factor), seed=seed, name="azure-code-weekday")
        if before is None or shifted is None:
            return today
        prior = longload.curve_over_trace(
            shifted, before.scaled(factor), seed=seed + PRIOR_SEED, name="azure-code-weekday, the day before"
        )
        return after_prior(prior, today)

    peak_at = max(day.windows(), key=lambda w: w[2])[0]
    peak_hour = day.cut(peak_at, 3600.0)

    def make_peak(factor: float) -> Trace:
        return longload.curve_over_trace(
            base, peak_hour.scaled(factor), seed=seed, name="azure-code-weekday peak hour"
        )

    return DaySource(
        "azure-code-weekday",
        day.peak_rps,
        base.input_tokens,
        base.output_tokens,
        make,
        make_peak,
        _warmup(prior_day),
    )


def day_source(name: str, root: Path, seed: int = 0, prior_day: bool = False) -> DaySource:
    """A day scenario; `prior_day` adds the day before to its warm-up (module docstring)."""
    if name == "servegen-day":
        return servegen_day(root, seed, prior_day)
    if name == "azure-code-weekday":
        return azure_code_weekday(root, seed, prior_day)
    raise ValueError(f"unknown day scenario {name!r} (one of {', '.join(DAY_SCENARIOS)})")


def peak_split(source: DaySource, profile: perf.Profile, slo: SLO, factor: float) -> tuple[int, int]:
    """The split the capacity models give for the peak hour at `factor`: the static fleet
    sized for the peak, as users run one today."""
    return size_for(profile, slo, source.peak_rps * factor, source.peak_inputs, source.peak_outputs, 10_000)


def factor_for_peak(source: DaySource, profile: perf.Profile, slo: SLO, engines: int) -> float:
    """The smallest rate factor at which the peak hour needs `engines` engines (bisected:
    the need grows with the rate)."""

    def need(factor: float) -> int:
        return sum(peak_split(source, profile, slo, factor))

    low, high = 1e-4, 1.0
    while need(high) < engines:
        low, high = high, high * 2.0
    for _ in range(40):
        middle = (low * high) ** 0.5
        if need(middle) >= engines:
            high = middle
        else:
            low = middle
    return high


@dataclass(frozen=True)
class SimulatedLevel:
    """A load level set by simulation: the rate factor, and the static split that attains
    the target on the peak hour at it."""

    factor: float
    split: tuple[int, int]
    attainment: float
    simulated: int  # peak hours simulated to find it (each a hill climb of static splits)


def level_by_simulation(
    source: DaySource,
    profile: perf.Profile,
    slo: SLO,
    engines: int,
    attains: float = 0.99,
    jobs: int = 1,
    precision: float = 1.03,
    start: float | None = None,
) -> SimulatedLevel:
    """The largest rate factor (to within `precision`) at which the best static split of
    `engines` engines attains `attains` of the peak hour's requests, each hour simulated
    from an empty fleet. The capacity models size for mean rates; bursts within the
    minute need more, so a level the models set can overload every fleet it compares.
    The bracket starts at `start`, or else at the models' factor (on bursty traffic up
    to ten times the level: a known level scaled is a closer start)."""
    fleet = fleet_config(PlanConfig(gpus=engines * profile.gpus, slo=slo), profile)
    simulated = 0

    def best(factor: float) -> tuple[float, tuple[int, int]]:
        nonlocal simulated
        simulated += 1
        setup = Setup(source.make_peak(factor), profile, slo, fleet, PolicyKnobs())
        top = static_best(setup, jobs, exhaustive=False)[0]
        return top.attainment, top.split

    factor = start or factor_for_peak(source, profile, slo, engines)
    found = best(factor)
    low: tuple[float, tuple[float, tuple[int, int]]] | None = (factor, found) if found[0] >= attains else None
    high = None if low else factor
    while low is None or high is None:  # bracket: a factor that attains, one that does not
        if simulated > BRACKET_TRIES:
            raise ValueError(
                f"{source.name}: no rate factor within 1.5^{BRACKET_TRIES} of the models' {found[0]:.1%} "
                f"attainment brackets {attains:.0%} on {engines} engines"
            )
        factor = factor * 1.5 if high is None else factor / 1.5
        found = best(factor)
        if found[0] >= attains:
            low = (factor, found)
        else:
            high = factor
    while high / low[0] > precision:
        middle = (low[0] * high) ** 0.5
        found = best(middle)
        if found[0] >= attains:
            low = (middle, found)
        else:
            high = middle
    factor, (attainment, split) = low
    return SimulatedLevel(factor, split, attainment, simulated)


def hourly(
    result: Result, trace: Trace, targets_s: list[float], itl_s: float, from_s: float, hours: int
) -> list[float | None]:
    """Attainment per hour of the scored day (None for an hour with no requests)."""
    good = np.zeros(hours)
    seen = np.zeros(hours)
    for i, t in enumerate(trace.arrival_s):
        h = int((t - from_s) // 3600.0)
        if 0 <= h < hours:
            seen[h] += 1
            if result.finished[i] and result.ttft_s[i] <= targets_s[i] and result.itl_s[i] <= itl_s:
                good[h] += 1
    return [float(g / n) if n else None for g, n in zip(good, seen, strict=True)]


def plot(
    path: Path,
    title: str,
    trace: Trace,
    results: dict[str, Result],
    by_hour: dict[str, list[float | None]],
    from_s: float,
) -> None:
    """Requests/s, each policy's prefill and decode engines, and attainment per hour, over
    the day (the warm-up shaded); a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load, engines, hours) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    arrivals = (np.asarray(trace.arrival_s) - from_s) / 3600.0
    day_h = float(np.ceil(arrivals[-1]))  # requests still queued after it are not drawn
    edges = np.arange(-from_s / 3600.0, arrivals[-1] + 1 / 6, 1 / 6)  # 10-minute bins
    counts, _ = np.histogram(arrivals, edges)
    load.step(edges[:-1], counts / 600.0, where="post", color="black", linewidth=0.8)
    load.set_ylabel("requests/s")
    for name, result in results.items():
        at, prefill, decode = engines_over_time(result, from_s)
        line = engines.plot(at, prefill, linewidth=0.9, label=name)[0]
        engines.plot(at, decode, linewidth=0.9, linestyle="--", color=line.get_color())
        values = by_hour.get(name)
        if values:
            hours.plot(
                [h + 0.5 for h in range(len(values))], values, marker=".", color=line.get_color(), label=name
            )
    engines.set_ylabel("engines, 30-min mean\n(prefill —, decode --)")
    engines.legend(fontsize=7, ncol=3)
    hours.set_ylabel("attainment per hour")
    hours.set_xlabel("hour of the day (warm-up shaded)")
    for ax in (load, engines, hours):
        ax.axvspan(-from_s / 3600.0, 0, color="0.9")
        ax.set_xlim(-from_s / 3600.0, day_h)
    load.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def engines_over_time(
    result: Result, from_s: float, width_s: float = 1800.0
) -> tuple[list[float], list[float], list[float]]:
    """Ready prefill and decode engines, time-weighted means per `width_s`: bin centres in
    hours from `from_s` (a policy that moves every interval is unreadable step by step)."""
    bins = int(np.ceil(result.end_s / width_s))
    held = np.zeros((2, bins))
    marks = [*result.timeline, (result.end_s, 0, 0)]
    for (t, p, d, *_), (after, *_) in itertools.pairwise(marks):
        while t < after:
            k = int(t // width_s)
            step = min(after, (k + 1) * width_s) - t
            held[0, k] += p * step
            held[1, k] += d * step
            t += step
    centres = [((k + 0.5) * width_s - from_s) / 3600.0 for k in range(bins)]
    return centres, (held[0] / width_s).tolist(), (held[1] / width_s).tolist()
