"""Policies the fleet simulator compares: a fixed split, and ours through the control law."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from pdcluster.api.v1alpha1 import AutoscalingState, PDClusterSpec, ServingMode
from pdcluster.control import Observed, RoleObserved, decide
from pdcluster.perf import Profile
from pdcluster.sim import scrapes
from pdcluster.sim.engines import PENDING
from pdcluster.sim.fleet import Fleet
from pdcluster.sim.plan_policies import PolicyChoice

# Simulated time 0 on the wall clock the control law reads.
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


class Static:
    interval_s = math.inf

    def __init__(self, prefill: int, decode: int) -> None:
        self.split = (prefill, decode)
        self.name = PolicyChoice.static(prefill, decode).name

    def initial(self) -> tuple[int, int]:
        return self.split

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None:
        return None


def observed(fleet: Fleet) -> Observed:
    roles = {}
    for index, role in enumerate(("prefill", "decode")):
        engines = fleet.active(role)
        roles[role] = RoleObserved(
            desired=fleet.targets[index],
            replicas=len(engines),
            ready=len(fleet.ready[role]) if role == "prefill" else fleet.decode_engines(),
            unschedulable=sum(1 for e in engines if e.state == PENDING),
            startup_s=fleet.cfg.startup_s,  # what the operator measures from its pods
        )
    return Observed(**roles)


class PDCluster:
    """pdcluster.control.decide, fed with what Prometheus would show of the fleet."""

    def __init__(self, spec: PDClusterSpec, profile: Profile | None, name: str = "pdcluster") -> None:
        self.spec = spec
        self.profile = profile  # the prior; None: learned from the metrics alone
        self.name = name
        self.interval_s = float(spec.autoscaling.interval_seconds)
        self.state: AutoscalingState | None = None
        self.last_reason = ""

    def initial(self) -> tuple[int, int]:
        return self.spec.prefill.replicas, self.spec.decode.replicas

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None:
        auto = self.spec.autoscaling
        snap = scrapes.snapshot(fleet.scrapes, now_s, auto.window_seconds, auto.slo.quantile.fraction)
        now = EPOCH + timedelta(seconds=now_s)
        self.state, decision = decide(self.spec, snap, self.state, observed(fleet), now, profile=self.profile)
        self.last_reason = decision.reason
        return decision.prefill, decision.decode


class FlexiblePDCluster(PDCluster):
    """The law on flexible engines (spec.mode flexible, control/flexsplit.py): the size
    as the law decides it, down to one engine serving whole, the split every interval by
    flips."""

    def __init__(self, spec: PDClusterSpec, profile: Profile | None, name: str = "pdcluster-flex") -> None:
        # decode.minReplicas 0: a quiet pool goes down to one engine serving whole.
        lone = spec.decode.model_copy(update={"min_replicas": 0})
        super().__init__(
            spec.model_copy(update={"mode": ServingMode.flexible, "decode": lone}), profile, name
        )
