"""Policies the fleet simulator compares: a fixed split, and ours through the control law."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from pdcluster.api.v1alpha1 import AutoscalingState, PDClusterSpec
from pdcluster.control import Observed, RoleObserved, decide, decide_outcome
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
            ready=len(fleet.ready[role]),
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


# A split moves when the needed share is this many engines away: past the rounding's 0.5,
# so a share that hovers at a half does not flip an engine back and forth.
SPLIT_BAND = 0.75


class FlexiblePDCluster(PDCluster):
    """The law on flexible engines, on two time scales: the fleet's size as the law
    decides it (pods: damped by its windows, steps and cooldown), its split every
    interval in proportion to the engines the capacity models need per role (flips:
    seconds, so not damped). The state keeps the split applied, so the law sees no
    scale-up pending where an engine was flipped instead."""

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None:
        auto = self.spec.autoscaling
        snap = scrapes.snapshot(fleet.scrapes, now_s, auto.window_seconds, auto.slo.quantile.fraction)
        now = EPOCH + timedelta(seconds=now_s)
        outcome = decide_outcome(self.spec, snap, self.state, observed(fleet), now, profile=self.profile)
        decision = outcome.decision
        self.last_reason = decision.reason
        total = decision.prefill + decision.decode
        prefill = self._split(total, decision.prefill, outcome.figures.needed)
        self.state = outcome.state.model_copy(update={"prefill": prefill, "decode": total - prefill})
        return prefill, total - prefill

    def _split(self, total: int, decided: int, needed: dict[str, int]) -> int:
        """Prefill engines of `total`: the needed share of it, moved only when that share
        is more than SPLIT_BAND engines away from the split now (no flapping on a ratio
        that hovers between two splits)."""
        want_p, want_d = needed.get("prefill", 0), needed.get("decode", 0)
        if total < 2 or want_p + want_d == 0:
            return decided
        now = min(max(decided, 1), total - 1)
        share = total * want_p / (want_p + want_d)
        if abs(share - now) <= SPLIT_BAND:
            return now
        return min(max(round(share), 1), total - 1)
