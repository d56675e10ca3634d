"""Disaggregated or colocated: which serves more requests within the SLO per GPU.

`pdctl plan --compare-colocated` answers it two ways, at a fixed GPU count and SLO:

- a sweep (no --trace): prompts of each length (1k to 128k tokens by default) and a fixed
  output length, Poisson arrivals at each load, no shared prefixes. Load is the share
  of the GPUs' time the prompts alone would take in isolation (1.0: every GPU
  prefilling all the time), so one axis serves every prompt length;
- a trace (--trace): the trace itself, at the rate where the best disaggregated split
  attains about 90% (as `pdctl plan` searches it), or at --rate-scale.

At each point both architectures get their best configuration in hindsight, so neither
starts from the other's answer: every prefill:decode split of the GPUs (sim/fleet.py)
against one colocated engine per GPU at each chunked-prefill token budget
(sim/colocated.py). Goodput is requests meeting both the TTFT and the ITL target per
second of trace; per GPU, divided by the GPU count.
"""

from __future__ import annotations

import csv
import itertools
import math
import random
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from pdcluster import perf
from pdcluster.control.models import MAX_BATCHED_TOKENS
from pdcluster.sim.colocated import ColocatedConfig, simulate_colocated
from pdcluster.sim.fleet import FleetConfig, simulate
from pdcluster.sim.policies import Static
from pdcluster.sim.scoring import SLO, score
from pdcluster.sim.trace import Trace

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
LOADS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
BUDGETS = (512, 2048, 8192)  # chunked-prefill token budgets the colocated fleet may use


@dataclass(frozen=True)
class Config:
    """One fleet to simulate: a prefill:decode split, or colocated at a token budget."""

    kind: str  # "disaggregated" | "colocated"
    value: int  # prefill engines | max_num_batched_tokens


@dataclass(frozen=True)
class Outcome:
    config: Config
    goodput_rps: float
    attainment: float


@dataclass(frozen=True)
class Point:
    """Both architectures' best at one prompt length (or trace) and load."""

    prompt_tokens: int  # 0: a trace
    load: float
    rate_rps: float
    gpus: int
    colocated: Outcome
    disaggregated: Outcome

    @property
    def ratio(self) -> float:
        """Disaggregated goodput over colocated (inf: colocated serves none in the SLO)."""
        c, d = self.colocated.goodput_rps, self.disaggregated.goodput_rps
        if c == 0:
            return math.inf if d > 0 else 1.0
        return d / c

    @property
    def winner(self) -> str:
        if self.colocated.goodput_rps == self.disaggregated.goodput_rps:
            return "tie"
        return "disaggregated" if self.ratio > 1 else "colocated"

    def row(self) -> dict[str, Any]:
        g = self.gpus
        return {
            "prompt_tokens": self.prompt_tokens,
            "load": self.load,
            "rate_rps": round(self.rate_rps, 4),
            "colocated_goodput_per_gpu": round(self.colocated.goodput_rps / g, 4),
            "colocated_attainment": round(self.colocated.attainment, 4),
            "colocated_token_budget": self.colocated.config.value,
            "disaggregated_goodput_per_gpu": round(self.disaggregated.goodput_rps / g, 4),
            "disaggregated_attainment": round(self.disaggregated.attainment, 4),
            "disaggregated_split": f"{self.disaggregated.config.value}:{g - self.disaggregated.config.value}",
            "winner": self.winner,
            "disaggregated_over_colocated": round(self.ratio, 3) if math.isfinite(self.ratio) else "inf",
        }


@dataclass(frozen=True)
class SweepConditions:
    profile: str
    gpus: int
    slo: SLO
    link_gbps: float = 200.0
    router: str = "prefix-aware"
    # The engine time of the fixed part of a step carrying prompt tokens, in both
    # models: "decode" (the profile's d0; the rest of its a is per-request latency) or
    # "prefill" (all of a). sim/colocated.py says why d0 is the default.
    step_fixed: str = "decode"


@dataclass(frozen=True)
class Workload:
    """The sweep's requests: one output length, Poisson arrivals, no shared prefixes.
    A point has at least `requests` requests over at least `span_s`, so that queues
    reach their steady state even where the rate is high and the SLO's slack long."""

    output_tokens: int = 256
    requests: int = 600
    span_s: float = 60.0
    seed: int = 0

    def trace(self, prompt: int, rate: float) -> Trace:
        n = max(self.requests, math.ceil(rate * self.span_s))
        rng = random.Random(self.seed * 1_000_003 + prompt)
        t, arrival = 0.0, []
        for _ in range(n):
            t += rng.expovariate(rate)
            arrival.append(t)
        return Trace(
            f"{prompt}x{self.output_tokens}", arrival, [prompt] * n, [self.output_tokens] * n, [()] * n
        )


def configs(gpus: int, engine_gpus: int) -> list[Config]:
    engines = gpus // engine_gpus
    return [Config("disaggregated", p) for p in range(1, engines)] + [
        Config("colocated", budget) for budget in BUDGETS
    ]


def run_one(setting: SweepConditions, trace: Trace, config: Config) -> Outcome:
    profile = perf.load(setting.profile)
    engines = setting.gpus // profile.gpus
    fixed = profile.decode_coef[0] if setting.step_fixed == "decode" else None
    if config.kind == "disaggregated":
        fleet = FleetConfig(
            gpus=setting.gpus,
            link_gbps=setting.link_gbps,
            router=setting.router,
            gpus_per_engine=profile.gpus,
            prefill_fixed_ms=fixed,
        )
        result = simulate(trace, profile, Static(config.value, engines - config.value), fleet)
    else:
        colocated = ColocatedConfig(
            engines=engines,
            gpus_per_engine=profile.gpus,
            max_batched_tokens=config.value,
            prefill_fixed_ms=fixed,
            router=setting.router,
        )
        result = simulate_colocated(trace, profile, colocated)
    sc = score(result, trace, setting.slo.ttft_targets_s(trace, profile), setting.slo.itl_ms)
    return Outcome(config, sc.goodput_rps, sc.attainment)


def _run_job(job: tuple[SweepConditions, Trace, Config]) -> Outcome:
    return run_one(*job)


def _map(todo: list[tuple[SweepConditions, Trace, Config]], jobs: int) -> list[Outcome]:
    if jobs <= 1 or len(todo) <= 1:
        return [_run_job(job) for job in todo]
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_run_job, todo, chunksize=2))


def best(outcomes: Iterable[Outcome], kind: str) -> Outcome:
    # Ties (often all zero at overload) go to the higher attainment, then the first.
    return max((o for o in outcomes if o.config.kind == kind), key=lambda o: (o.goodput_rps, o.attainment))


def compare(
    setting: SweepConditions,
    cases: list[tuple[int, float, Trace]],
    jobs: int,
    say: Callable[[str], None] = lambda _msg: None,
) -> list[Point]:
    """Best of each architecture for every (prompt length, load, trace) case."""
    profile = perf.load(setting.profile)
    todo = [
        (setting, trace, config) for _, _, trace in cases for config in configs(setting.gpus, profile.gpus)
    ]
    say(f"simulating {len(todo)} fleets ({len(cases)} cases) on {jobs} process(es) ...")
    outcomes = _map(todo, jobs)
    per_case = len(todo) // max(len(cases), 1)
    points = []
    for k, (prompt, load, trace) in enumerate(cases):
        mine = outcomes[k * per_case : (k + 1) * per_case]
        rate = len(trace) / max(trace.span_s, 1e-9)
        points.append(
            Point(prompt, load, rate, setting.gpus, best(mine, "colocated"), best(mine, "disaggregated"))
        )
    return points


def prompt_seconds(profile: perf.Profile, prompt: int, budget: int = MAX_BATCHED_TOKENS) -> float:
    """GPU time of one prompt when prompts fill the token budget: load 1.0 is the rate
    at which prefill alone keeps every GPU busy."""
    a, b, c = profile.prefill_coef
    return (a * min(1.0, prompt / budget) + b * prompt + c * prompt * prompt) / 1000.0


def rate_at(profile: perf.Profile, engines: int, prompt: int, load: float) -> float:
    return load * engines / prompt_seconds(profile, prompt)


def sweep_cases(
    setting: SweepConditions, lengths: Iterable[int], loads: Iterable[float], workload: Workload
) -> list[tuple[int, float, Trace]]:
    profile = perf.load(setting.profile)
    engines = setting.gpus // profile.gpus
    return [
        (prompt, load, workload.trace(prompt, rate_at(profile, engines, prompt, load)))
        for prompt in lengths
        for load in loads
    ]


def capacities(
    setting: SweepConditions,
    lengths: Iterable[int],
    workload: Workload,
    jobs: int,
    attains: float = 0.9,
    steps: int = 7,
) -> dict[int, dict[str, float]]:
    """For each prompt length and architecture, the highest load its best configuration
    serves with at least `attains` of the requests in the SLO (DistServe's goodput),
    as requests/s per GPU; geometric bisection between loads 1/64 and 4 (to about 4%)."""
    profile = perf.load(setting.profile)
    engines = setting.gpus // profile.gpus
    kinds = ("colocated", "disaggregated")
    bounds = {(n, k): [1 / 64, 4.0] for n in lengths for k in kinds}
    served: set[tuple[int, str]] = set()  # held the SLO at some load
    for _ in range(steps):
        todo, owners = [], []
        for (prompt, kind), (low, high) in bounds.items():
            load = math.sqrt(low * high)
            trace = workload.trace(prompt, rate_at(profile, engines, prompt, load))
            for config in configs(setting.gpus, profile.gpus):
                if config.kind == kind:
                    todo.append((setting, trace, config))
                    owners.append((prompt, kind, load))
        held: dict[tuple[int, str, float], bool] = {}
        for owner, outcome in zip(owners, _map(todo, jobs), strict=True):
            held[owner] = held.get(owner, False) or outcome.attainment >= attains
        for (prompt, kind, load), ok in held.items():
            bounds[(prompt, kind)][0 if ok else 1] = load
            if ok:
                served.add((prompt, kind))
    out: dict[int, dict[str, float]] = {}
    for (prompt, kind), (low, _) in bounds.items():
        rate = rate_at(profile, engines, prompt, low) if (prompt, kind) in served else 0.0
        out.setdefault(prompt, {})[kind] = round(rate / setting.gpus, 4)
    return out


Capacities = dict[int, dict[str, float]]  # prompt length -> architecture -> goodput per GPU
TIE = 0.10  # goodputs this close are a tie: the bisection finds each to about 4%


def recommend(point: Point) -> str:
    """The mode to run a trace's traffic in, and why, in one line."""
    c, d = point.colocated.goodput_rps, point.disaggregated.goodput_rps
    if max(c, d) <= min(c, d) * (1 + TIE):
        return f"either (goodput per GPU within {TIE:.0%}: colocated {c / point.gpus:.3g}, disaggregated {d / point.gpus:.3g} req/s)"
    mode, more = (
        ("disaggregated", d / c if c else math.inf) if d > c else ("colocated", c / d if d else math.inf)
    )
    times = "only it holds the SLO" if math.isinf(more) else f"{more:.2f}x the goodput per GPU"
    return f"{mode} ({times})"


def length_crossovers(caps: Capacities) -> list[tuple[int, int, str]]:
    """Where the architecture that serves more per GPU changes along the prompt length:
    (shorter length, longer length, the winner from the longer one on). Lengths where
    the two are within TIE of each other name no winner."""
    winners = []
    for n, c in sorted(caps.items()):
        low, high = sorted((c["colocated"], c["disaggregated"]))
        if high > low * (1 + TIE):
            winners.append((n, "disaggregated" if c["disaggregated"] == high else "colocated"))
    return [(a, b, w2) for (a, w1), (b, w2) in itertools.pairwise(winners) if w1 != w2]


# --------------------------------------------------------------------------- output
def write_csv(path: str, points: list[Point], by_itl: dict[float, Capacities] | None) -> list[Path]:
    """The plotted goodput at 90% per ITL target and prompt length to `path` (the
    sweep), and every point at a fixed load to `<path stem>-loads.csv` (a trace's one
    point to `path`)."""
    target = Path(path)
    out = []
    if by_itl is not None:
        rows = [
            {"itl_target_ms": itl, "prompt_tokens": n, **{f"{k}_goodput_per_gpu": v for k, v in c.items()}}
            for itl, caps in sorted(by_itl.items())
            for n, c in sorted(caps.items())
        ]
        _write_rows(target, rows)
        out.append(target)
        target = target.with_name(f"{target.stem}-loads{target.suffix or '.csv'}")
    _write_rows(target, [p.row() for p in points])
    return [*out, target]


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def print_table(points: list[Point], out=sys.stdout) -> None:
    print(
        f"{'prompt':>7} {'load':>5} {'req/s':>8}  {'colocated/GPU':>13} {'budget':>6}  "
        f"{'disagg/GPU':>10} {'split':>5}  winner",
        file=out,
    )
    for p in points:
        r = p.row()
        print(
            f"{p.prompt_tokens or 'trace':>7} {p.load:>5.2f} {p.rate_rps:>8.3f}  "
            f"{r['colocated_goodput_per_gpu']:>13.4f} {r['colocated_token_budget']:>6}  "
            f"{r['disaggregated_goodput_per_gpu']:>10.4f} {r['disaggregated_split']:>5}  "
            f"{p.winner} x{r['disaggregated_over_colocated']}",
            file=out,
        )


def print_capacities(caps: dict[int, dict[str, float]], out=sys.stdout) -> None:
    print("\ngoodput per GPU with 90% of requests in the SLO (req/s):", file=out)
    print(f"{'prompt':>7} {'colocated':>10} {'disaggregated':>13}", file=out)
    for prompt, c in sorted(caps.items()):
        print(f"{prompt:>7} {c['colocated']:>10.4f} {c['disaggregated']:>13.4f}", file=out)
    for shorter, longer, winner in length_crossovers(caps):
        print(f"crossover between {shorter} and {longer} prompt tokens: {winner} from there on", file=out)


def plot(path: str, by_itl: dict[float, Capacities], main_itl: float, title: str) -> int:
    """Left: both architectures' goodput per GPU at the main ITL target. Right: their
    ratio along the prompt length, one line per ITL target swept."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install 'pdcluster-operator[plot]')", file=sys.stderr)
        return 2
    caps = by_itl[main_itl]
    lengths = sorted(caps)
    xs = [math.log2(n) for n in lengths]
    ticks = (xs, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, style in (("colocated", "o-"), ("disaggregated", "s-")):
        left.plot(xs, [caps[n][kind] for n in lengths], style, label=kind)
    left.set_yscale("log")
    left.set_ylabel("requests/s per GPU with 90% in the SLO")
    left.set_title(f"goodput per GPU (DistServe's definition), mean ITL within {main_itl:g} ms", fontsize=10)
    left.legend()
    right.axhspan(1 / (1 + TIE), 1 + TIE, color="grey", alpha=0.2, label=f"within {TIE:.0%}: a tie")
    right.axhline(1.0, color="grey")
    for itl, found in sorted(by_itl.items()):
        ratio = [
            found[n]["disaggregated"] / found[n]["colocated"] if found[n]["colocated"] else math.nan
            for n in lengths
        ]
        right.plot(xs, ratio, ".-", linewidth=2.5 if itl == main_itl else 1.2, label=f"mean ITL {itl:g} ms")
    right.set_yscale("log", base=2)
    right.minorticks_off()
    marks = [0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0]
    right.set_yticks(marks, [f"{m:g}" for m in marks])
    right.set_ylabel("disaggregated / colocated goodput per GPU")
    right.set_title("above 1: disaggregated serves more; a line crossing 1: a crossover", fontsize=10)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xticks(*ticks)
        ax.set_xlabel("prompt tokens")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=110)
    return 0
