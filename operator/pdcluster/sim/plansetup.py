"""What `pdctl plan` simulates: a trace on a fleet under an SLO (Setup), the PDCluster
a dynamic policy runs with, the split the capacity models give before any observation,
and the policies by name."""

from __future__ import annotations

import argparse
import bisect
import math
from dataclasses import dataclass

from pdcluster import observability as obs
from pdcluster import perf
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.control import sizing
from pdcluster.sim.dynamo import Dynamo, DynamoLoad
from pdcluster.sim.fleet import FleetConfig
from pdcluster.sim.llmd import LLMD
from pdcluster.sim.oracle import Oracle
from pdcluster.sim.policies import PDCluster, Static
from pdcluster.sim.scoring import SLO
from pdcluster.sim.trace import Trace


@dataclass(frozen=True)
class Setup:
    trace: Trace  # already scaled
    profile: perf.Profile
    slo: SLO
    fleet: FleetConfig
    args: argparse.Namespace

    @property
    def targets_s(self) -> list[float]:
        return self.slo.ttft_targets_s(self.trace, self.profile)

    @property
    def engines(self) -> int:
        """Engines the cluster's GPUs hold (an engine takes the profile's GPUs)."""
        return self.fleet.gpus // self.fleet.gpus_per_engine


def spec_for(setup: Setup, start: tuple[int, int], prior: bool = False) -> PDClusterSpec:
    a = setup.args
    n, gpus = setup.engines, setup.fleet.gpus_per_engine
    return PDClusterSpec.model_validate(
        {
            "model": {"name": "simulated"},
            "prefill": {"replicas": start[0], "minReplicas": 1, "maxReplicas": n - 1, "gpusPerPod": gpus},
            "decode": {"replicas": start[1], "minReplicas": 1, "maxReplicas": n - 1, "gpusPerPod": gpus},
            "autoscaling": {
                "enabled": True,
                "gpuBudget": n,
                **({"profile": setup.profile.name} if prior else {}),
                "slo": {
                    "ttftMs": round(setup.slo.ttft_ms),
                    "itlMs": round(setup.slo.itl_ms),
                    "quantile": "p90",
                },
                "ttftIncludesPrefill": not setup.slo.plus_prefill,
                "intervalSeconds": a.interval,
                "windowSeconds": a.window,
                "scaleUpStabilizationSeconds": a.scale_up_stabilization,
                "scaleDownStabilizationSeconds": a.scale_down_stabilization,
                "cooldownSeconds": a.cooldown,
                "maxStep": a.max_step,
                "tolerancePercent": a.tolerance,
            },
        }
    )


def size_for(
    profile: perf.Profile, slo: SLO, rate: float, lengths: list[int], outputs: list[int], engines: int
) -> tuple[int, int]:
    """The split the control law's sizing gives for a load (no observations), within `engines`."""
    # The prompt-length histogram vLLM would export of this load (the convex prefill cost).
    bounds = obs.vllm_request_token_buckets(1 << 20)
    counts = [0] * (len(bounds) + 1)
    for n in lengths:
        counts[bisect.bisect_left(bounds, n)] += 1
    histogram = tuple(zip((*map(float, bounds), math.inf), map(float, counts), strict=True))
    p, d = sizing.engines_for(
        profile,
        rate=rate,
        input_tokens=sum(lengths) / len(lengths),
        output_tokens=sum(outputs) / len(outputs),
        lengths=histogram,
        ttft_ms=slo.ttft_ms,
        itl_ms=slo.itl_ms,
        quantile=0.9,
        own_prefill=not slo.plus_prefill,
        limit=engines - 1,
    )
    if p + d > engines:
        p = min(max(round(engines * p / (p + d)), 1), engines - 1)
        d = engines - p
    return p, d


def model_split(setup: Setup) -> tuple[int, int]:
    """The split the capacity models give for the trace's mean load (no observations)."""
    tr = setup.trace
    rate = len(tr) / max(tr.span_s, 1e-9)
    return size_for(setup.profile, setup.slo, rate, tr.input_tokens, tr.output_tokens, setup.engines)


def make_policy(name: str, setup: Setup, start: tuple[int, int] | None = None):
    if name.startswith("static:"):
        _, p, d = name.split(":")
        return Static(int(p), int(d))
    start = start or model_split(setup)
    if name == "pdcluster":  # as deployed by default: no profile, capacity learned online
        return PDCluster(spec_for(setup, start), None)
    if name == "pdcluster-prior":  # given the simulated engines' own profile as the prior
        return PDCluster(spec_for(setup, start, prior=True), setup.profile, name)
    if name == "oracle":
        return Oracle(
            setup.trace,
            lambda rate, lengths, outputs: size_for(
                setup.profile, setup.slo, rate, lengths, outputs, setup.engines
            ),
            setup.engines,
            setup.fleet.startup_s,
            float(setup.args.interval),
        )
    # The baselines get the engines' true profile where they need one, and the SLO.
    given = {
        "ttft_ms": setup.slo.ttft_ms,
        "itl_ms": setup.slo.itl_ms,
        "gpu_budget": setup.fleet.gpus,
        "start": start,
    }
    dynamo_interval = setup.args.dynamo_interval
    if name == "dynamo-load":  # throughput + load-based, Dynamo's advice for bursty traffic
        return DynamoLoad(setup.profile, **given, interval_s=dynamo_interval)
    if name == "llmd":
        return LLMD(setup.profile, **given, gpus_per_engine=setup.fleet.gpus_per_engine)
    if name in ("dynamo", "dynamo-constant"):
        predictor = "constant" if name == "dynamo-constant" else "arima"
        return Dynamo(setup.profile, **given, interval_s=dynamo_interval, predictor=predictor)
    raise ValueError(f"unknown policy {name!r}")
