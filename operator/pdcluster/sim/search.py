"""The simulations `pdctl plan` runs: policies side by side (in worker processes), the
best static split in hindsight, the smallest static fleet at an attainment, and the
rate scale at which static-best attains a target."""

from __future__ import annotations

import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context

from pdcluster.sim.fleet import Result, simulate
from pdcluster.sim.plansetup import Setup, make_policy, model_split
from pdcluster.sim.policies import Static
from pdcluster.sim.scoring import Score, band, score
from pdcluster.sim.trace import Trace


def _simulate(setup: Setup, start: tuple[int, int] | None, name: str) -> tuple[Score, Result]:
    policy = make_policy(name, setup, start)
    result = simulate(setup.trace, setup.profile, policy, setup.fleet)
    scored = score(result, setup.trace, setup.targets_s, setup.slo.itl_ms)
    if isinstance(policy, Static):
        scored = replace(scored, split=policy.split)
    return scored, result


# A pool worker's setup, given once by its initializer (forked, not pickled per task).
_WORKER_INPUTS: tuple[Setup, tuple[int, int] | None] | None = None


def _init_worker(setup: Setup, start: tuple[int, int] | None) -> None:
    global _WORKER_INPUTS
    _WORKER_INPUTS = (setup, start)


def _simulate_in_worker(name: str) -> tuple[Score, Result]:
    assert _WORKER_INPUTS is not None
    return _simulate(*_WORKER_INPUTS, name)


def run_many(
    setup: Setup, names: list[str], jobs: int, start: tuple[int, int] | None = None
) -> list[tuple[Score, Result]]:
    if jobs <= 1 or len(names) <= 1:  # a pool of none or one is only overhead (and none is an error)
        return [_simulate(setup, start, n) for n in names]
    with ProcessPoolExecutor(
        min(jobs, len(names)),
        mp_context=get_context("fork"),
        initializer=_init_worker,
        initargs=(setup, start),
    ) as pool:
        return list(pool.map(_simulate_in_worker, names))


def static_best(setup: Setup, jobs: int, exhaustive: bool) -> tuple[Score, Result, list[Score]]:
    """The best split in hindsight: every split, or a hill climb from the model's split."""
    n = setup.engines
    splits = [f"static:{p}:{n - p}" for p in range(1, n)]
    if exhaustive:
        runs = run_many(setup, splits, jobs)
    else:
        seen: dict[int, tuple[Score, Result]] = {}
        p = model_split(setup)[0]
        while True:
            todo = [q for q in (p - 1, p, p + 1) if 1 <= q < n and q not in seen]
            for q, run in zip(
                todo, run_many(setup, [f"static:{q}:{n - q}" for q in todo], jobs), strict=True
            ):
                seen[q] = run
            best = max(seen, key=lambda q: (seen[q][0].attainment, -abs(q - p)))
            if best == p:
                break
            p = best
        runs = [seen[q] for q in sorted(seen)]
    best_score, best_result = max(runs, key=lambda r: r[0].attainment)
    p, d = best_score.split
    named = replace(best_score, policy=f"static-best ({p}:{d})")
    return named, best_result, [r[0] for r in runs]


def smallest_static(
    setup: Setup, attainment: float, jobs: int, cache: dict[tuple[int, int], Score]
) -> Score | None:
    """The smallest static fleet (fewest engines, the best split of them, in hindsight)
    that attains at least `attainment`; None if the whole budget cannot. Attainment
    grows with engines, so the size is bisected; each size's split is hill-climbed
    from the capacity model's proportion. `cache` keeps every simulated split."""

    def run(splits: list[tuple[int, int]]) -> None:
        todo = [sp for sp in splits if sp not in cache]
        for sp, (sc, _) in zip(
            todo, run_many(setup, [f"static:{p}:{d}" for p, d in todo], jobs), strict=True
        ):
            cache[sp] = sc

    mp, md = model_split(setup)

    def best_of(total: int) -> Score:
        p = min(max(round(total * mp / (mp + md)), 1), total - 1)
        while True:
            around = [(q, total - q) for q in (p - 1, p, p + 1) if 1 <= q < total]
            run(around)
            q = max((sp[0] for sp in around), key=lambda q: (cache[(q, total - q)].attainment, -abs(q - p)))
            if q == p:
                return cache[(p, total - p)]
            p = q

    low, high = 2, setup.engines
    if best_of(high).attainment < attainment:
        return None
    while low < high:
        middle = (low + high) // 2
        if best_of(middle).attainment >= attainment:
            high = middle
        else:
            low = middle + 1
    return best_of(low)


def find_rate_scale(base: Trace, make_setup, jobs: int, log, target: float = 0.9) -> float:
    """A rate scale at which static-best attains about `target` (geometric bisection)."""
    low_band, high_band = band(target)
    setup = make_setup(1.0)
    tr, profile = setup.trace, setup.profile
    rate = len(tr) / max(tr.span_s, 1e-9)
    isl = sum(tr.input_tokens) / len(tr)
    osl = sum(tr.output_tokens) / len(tr)
    context = isl + osl / 2
    gpu_load = rate * isl / profile.prefill_tokens_per_s(int(isl)) + rate * osl / max(
        profile.decode_tokens_per_s(setup.slo.itl_ms, int(context)), 1.0
    )
    scale = 0.8 * setup.engines / gpu_load
    low, high = 0.0, math.inf
    for _ in range(12):
        attained = static_best(make_setup(scale), jobs, exhaustive=False)[0].attainment
        log(f"  rate scale {scale:.2f}: static-best attainment {attained:.3f}")
        if low_band <= attained <= high_band:
            return scale
        if attained > high_band:
            low = scale
        else:
            high = scale
        if low and math.isfinite(high):
            scale = math.sqrt(low * high)
        else:
            scale = scale * 1.6 if math.isfinite(scale) and not math.isfinite(high) else scale / 1.6
    return scale
