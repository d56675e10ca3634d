"""What `pdctl plan` is asked to do, as typed values: the command line's flags become
these (sim/plan_cli.py), and the planner (sim/plan.py) reads nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdcluster import perf
from pdcluster.sim import crossover
from pdcluster.sim.plan_policies import DEFAULT_POLICIES, PolicyChoice
from pdcluster.sim.scoring import SLO

# The split the dynamic policies start from: the minimum of each role ("neutral"), the
# capacity model's for the mean load ("model"), static-best's ("best"), or a given one.
Start = Literal["neutral", "model", "best"] | tuple[int, int]


@dataclass(frozen=True)
class PolicyKnobs:
    """The dynamic policies' settings beyond the SLO and the GPU budget."""

    interval_s: int = 30  # pdcluster's autoscaling.intervalSeconds, and the oracle's period
    window_s: int = 120
    scale_up_stabilization_s: int = 0
    scale_down_stabilization_s: int = 300
    cooldown_s: int = 60
    max_step: int = 2
    tolerance_percent: int = 10
    dynamo_interval_s: float = 180.0  # Dynamo's adjustment_interval


@dataclass(frozen=True)
class StoreSweep:
    """A Mooncake store of each DRAM size, on one static split (`--store-gib`)."""

    dram_gib: tuple[float, ...]
    ssd_gib: float = 0.0
    ssd_gbps: float = 25.0
    max_computed_tokens: int = 512


@dataclass(frozen=True)
class PlanConfig:
    gpus: int  # the cluster's GPU budget
    slo: SLO
    trace: str | None = None  # a trace file; only the colocated sweep runs without one
    trace_format: str | None = None  # None: from the file's suffix
    profile: str = perf.DEFAULT_PROFILE
    rate_scale: float | None = None  # None: searched
    rate_mode: Literal["compress", "replicate"] = "compress"
    rate_curve: str | None = None  # a t_s,rate_rps CSV: the load over time
    startup_s: float = 60.0
    link_gbps: float = 200.0
    router: str = "prefix-aware"
    policies: tuple[PolicyChoice, ...] = DEFAULT_POLICIES
    start: Start = "neutral"
    static_attains: float = 0.9  # the searched rate scale: where static-best attains this
    equal_attainment: bool = False
    knobs: PolicyKnobs = PolicyKnobs()
    store: StoreSweep | None = None
    seed: int = 0
    jobs: int = 1
    warmup_s: float = 0.0  # requests arriving before this are served but scored by no policy


@dataclass(frozen=True)
class ColocatedSweep:
    """`--compare-colocated`: the sweep run without a trace (prompt lengths by loads, at
    each mean-ITL target), and the engine time of a prompt step's fixed part in both."""

    lengths: tuple[int, ...] = crossover.LENGTHS
    loads: tuple[float, ...] = crossover.LOADS
    itl_targets: tuple[float, ...] = ()  # more mean-ITL targets to search the goodput at
    output_tokens: int = 256
    requests: int = 600
    span_s: float = 60.0
    step_fixed: Literal["decode", "prefill"] = "decode"
