"""Coordinated rollouts (rollout.py), as trajectories: the operator's plan and a small
model of the StatefulSet controller and kubelet, step by step until the rollout is done,
checking at every step that some revision still has a ready prefill -> decode pair."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.render.engine import kv_revision
from pdcluster.rollout import Rollout, plan

Planner = Callable[[str, dict[str, dict[str, Any] | None], dict[str, int]], Rollout]


@dataclass
class Pod:
    revision: str
    ready_in: int  # steps until Ready; 0: Ready


@dataclass
class StatefulSet:
    """Parallel pod management, RollingUpdate: the highest ordinal at or above the
    partition that is not at the template's revision is replaced, one at a time, once
    every pod is Ready; a new pod takes `start_steps` to become Ready."""

    template: str
    replicas: int
    start_steps: int
    partition: int = 0
    generation: int = 1
    pods: list[Pod] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pods = [Pod(self.template, 0) for _ in range(self.replicas)]

    def body(self) -> dict[str, Any]:
        revisions = [p.revision for p in self.pods]
        update = self.template
        current = update if all(r == update for r in revisions) else next(r for r in revisions if r != update)
        return {
            "metadata": {"generation": self.generation},
            "spec": {
                "replicas": self.replicas,
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": self.partition}},
                "template": {"metadata": {"labels": {C.LABEL_KV_REVISION: self.template}}},
            },
            "status": {
                "observedGeneration": self.generation,
                "currentRevision": current,
                "updateRevision": update,
                "updatedReplicas": revisions.count(update),
                "readyReplicas": sum(p.ready_in == 0 for p in self.pods),
            },
        }

    def apply(self, template: str, partition: int) -> None:
        if (template, partition) != (self.template, self.partition):
            self.template, self.partition = template, partition
            self.generation += 1

    def step(self) -> None:
        for pod in self.pods:
            pod.ready_in = max(pod.ready_in - 1, 0)
        if any(p.ready_in for p in self.pods):
            return
        for ordinal in range(self.replicas - 1, self.partition - 1, -1):
            if self.pods[ordinal].revision != self.template:
                self.pods[ordinal] = Pod(self.template, self.start_steps)
                return

    def ready(self, revision: str) -> int:
        return sum(p.revision == revision and p.ready_in == 0 for p in self.pods)


class LeaderWorkerSet(StatefulSet):
    """The same rolling update over groups (a group is one "pod" here), reported as a
    LeaderWorkerSet does: partition under rolloutStrategy, the revision label on the
    group templates, no revisions in status."""

    def body(self) -> dict[str, Any]:
        sts = super().body()
        status = {k: v for k, v in sts["status"].items() if not k.endswith("Revision")}
        template = sts["spec"]["template"]
        return {
            "kind": "LeaderWorkerSet",
            "metadata": sts["metadata"],
            "spec": {
                "replicas": self.replicas,
                "rolloutStrategy": {"rollingUpdateConfiguration": {"partition": self.partition}},
                "leaderWorkerTemplate": {"leaderTemplate": template, "workerTemplate": template},
            },
            "status": status,
        }


def roll(
    planner: Planner, replicas: dict[str, int], start_steps: dict[str, int], groups: tuple[str, ...] = ()
) -> list[str]:
    """Steps of a rollout from revision "a" to "b"; returns the steps that had no ready
    pair of one revision. Roles in `groups` span nodes (LeaderWorkerSets)."""
    sets = {
        role: (LeaderWorkerSet if role in groups else StatefulSet)("a", replicas[role], start_steps[role])
        for role in C.ENGINE_ROLES
    }
    gaps = []
    for step in range(200):
        rollout = planner("b", {role: s.body() for role, s in sets.items()}, replicas)
        for role, s in sets.items():
            s.apply("b", rollout.partitions[role])
        for s in sets.values():
            s.step()
        prefill, decode = sets[C.ROLE_PREFILL], sets[C.ROLE_DECODE]
        if not any(prefill.ready(r) and decode.ready(r) for r in ("a", "b")):
            gaps.append(f"step {step}: " + ", ".join(f"{role} {s.pods}" for role, s in sets.items()))
        if all(p.revision == "b" and p.ready_in == 0 for s in sets.values() for p in s.pods):
            final = planner("b", {role: s.body() for role, s in sets.items()}, replicas)
            assert final.partitions == {C.ROLE_PREFILL: 0, C.ROLE_DECODE: 0} and final.progress is None
            return gaps
    raise AssertionError("the rollout never finished")


def independent(revision: str, live: dict[str, Any], replicas: dict[str, int]) -> Rollout:
    """What StatefulSets do on their own."""
    return Rollout(dict.fromkeys(C.ENGINE_ROLES, 0))


@pytest.mark.parametrize(
    ("replicas", "start_steps"),
    [
        ({"prefill": 3, "decode": 2}, {"prefill": 6, "decode": 1}),  # prefill slow to start
        ({"prefill": 2, "decode": 4}, {"prefill": 1, "decode": 5}),  # decode slow to start
        ({"prefill": 2, "decode": 2}, {"prefill": 3, "decode": 3}),
        ({"prefill": 5, "decode": 3}, {"prefill": 2, "decode": 7}),
    ],
)
def test_a_pair_of_one_revision_is_always_ready(
    replicas: dict[str, int], start_steps: dict[str, int]
) -> None:
    assert roll(plan, replicas, start_steps) == []


@pytest.mark.parametrize("groups", [(C.ROLE_PREFILL,), (C.ROLE_PREFILL, C.ROLE_DECODE)])
def test_roles_spanning_nodes_roll_by_groups_the_same_way(groups: tuple[str, ...]) -> None:
    assert roll(plan, {"prefill": 3, "decode": 2}, {"prefill": 6, "decode": 1}, groups) == []
    assert roll(independent, {"prefill": 3, "decode": 2}, {"prefill": 6, "decode": 1}, groups)


def test_without_coordination_the_roles_drift_apart() -> None:
    """The case the gate exists for: decode finishes its rollout while prefill's first
    new pod is still starting; no revision has a ready pair."""
    gaps = roll(independent, {"prefill": 3, "decode": 2}, {"prefill": 6, "decode": 1})
    assert gaps, "the trajectory above proves nothing if independent rolling never breaks"


def test_a_role_of_one_pod_is_as_good_as_it_gets() -> None:
    """With one pod in a role, its replacement is a gap no partition avoids (no surge
    for StatefulSets); the plan still finishes, and the other role waits for it."""
    assert roll(plan, {"prefill": 1, "decode": 3}, {"prefill": 4, "decode": 2})


def test_scale_up_during_a_rollout_comes_at_the_new_revision() -> None:
    sets = {role: StatefulSet("a", 2, 3) for role in C.ENGINE_ROLES}
    replicas = {role: 2 for role in C.ENGINE_ROLES}
    rollout = plan("b", {role: s.body() for role, s in sets.items()}, replicas)
    assert rollout.partitions == {C.ROLE_PREFILL: 1, C.ROLE_DECODE: 1}
    assert rollout.progress == "prefill 0/2, decode 0/2 at revision b"
    # Autoscaling adds a decode pod: its ordinal (2) is above the partition.
    replicas[C.ROLE_DECODE] = 3
    for role, s in sets.items():
        s.apply("b", rollout.partitions[role])
    assert plan("b", {role: s.body() for role, s in sets.items()}, replicas).partitions[C.ROLE_DECODE] == 2


def test_a_change_the_controller_has_not_seen_holds_the_partitions() -> None:
    sts = StatefulSet("b", 3, 1)
    body = sts.body()
    body["spec"]["updateStrategy"]["rollingUpdate"]["partition"] = 2
    body["metadata"]["generation"] = 5  # a replicas change, say, not yet observed
    live = {C.ROLE_PREFILL: body, C.ROLE_DECODE: StatefulSet("b", 2, 1).body()}
    assert plan("b", live, {C.ROLE_PREFILL: 4, C.ROLE_DECODE: 2}).partitions == {
        C.ROLE_PREFILL: 2,
        C.ROLE_DECODE: 0,
    }


def test_the_revision_covers_what_both_roles_must_share_and_nothing_else() -> None:
    base = {"model": {"name": "m"}}

    def revision(**changes: Any) -> str:
        spec: dict[str, Any] = {**base}
        for key, value in changes.items():
            spec[key] = value
        return kv_revision(PDClusterSpec.model_validate(spec))

    same = revision()
    assert revision(engine={"image": "vllm/vllm-openai:v0.33.1"}) != same
    assert revision(model={"name": "m2"}) != same
    assert revision(engine={"args": ["--block-size", "32"]}) != same
    assert revision(mooncake={"store": {"enabled": True}}) != same
    assert revision(prefill={"replicas": 3}) == same
    assert revision(decode={"resources": {"limits": {"cpu": "4"}}}) == same
    assert revision(router={"replicas": 2}) == same
