"""A flexible pool under the law: the size by pods, the split by flips (the routers'
ConfigMap alone), each engine's acting role for Prometheus, and what the law sees of the
two roles of one pool."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

from pdcluster import constants as C
from pdcluster import flexible, perf
from pdcluster.api.v1alpha1 import AutoscalingState, PDClusterSpec, PDClusterStatus, RoleStatus
from pdcluster.autoscaler import _scaling_events, flexible_observed
from pdcluster.control import Observed, RoleObserved, decide_outcome
from pdcluster.control.cause import Cause
from pdcluster.control.context import Role
from pdcluster.control.flexsplit import DONOR_SETTLE_S, LONE_BUSY, LONE_STAY, lone_wants, prefill_share
from pdcluster.control.needs import Need
from pdcluster.control.types import assemble
from pdcluster.flexible_labels import label_acting_roles
from pdcluster.io.kube import ApiError
from pdcluster.render import Owner, Replicas, render_all

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pdcluster-flexible.yaml"
NOW = datetime(2026, 12, 1, tzinfo=UTC)


def _spec(**autoscaling) -> PDClusterSpec:
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text())["spec"])  # prefill 1, decode 3
    doc["autoscaling"] = {"enabled": True, "gpuBudget": 8, **autoscaling}
    return PDClusterSpec.model_validate(doc)


def _pod(n: int, ready: bool = True, acting: str | None = None, role: str = C.ROLE_FLEXIBLE) -> dict:
    labels = {C.LABEL_ROLE: role} | ({C.LABEL_ACTING_ROLE: acting} if acting else {})
    return {
        "metadata": {"name": f"agile-flexible-{n}", "labels": labels},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_the_laws_split_goes_to_the_routers_configmap_and_its_size_to_the_statefulset() -> None:
    spec, state = _spec(), AutoscalingState(prefill=3, decode=2)
    replicas = Replicas.choose(spec, state)
    assert (replicas.flexible, replicas.flexible_prefill) == (5, 3)
    objs = render_all(spec, Owner("agile", "ns", "uid"), replicas)
    pool = next(o for o in objs if o["kind"] == "StatefulSet")
    assert pool["spec"]["replicas"] == 5
    roles = next(o for o in objs if o["metadata"]["name"] == "agile-router-roles")
    assert roles["data"] == {C.KEY_PREFILL_ENGINES: "3"}
    # The routers' flag stays the spec's: a flip must not roll them.
    router = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "agile-router")
    assert "--prefill-engines=1" in router["spec"]["template"]["spec"]["containers"][0]["args"]
    # In recommend mode the law only records: the spec's split and size run.
    recommend = Replicas.choose(_spec(mode="recommend"), state)
    assert (recommend.flexible, recommend.flexible_prefill) == (4, 1)
    # A lone engine (1:0): one pod, which the routers make serve requests whole; only
    # where decode's minReplicas is 0, else the pool's floor is one engine of each role.
    floor_one = spec.model_copy(update={"decode": spec.decode.model_copy(update={"min_replicas": 0})})
    lone = Replicas.choose(floor_one, AutoscalingState(prefill=1, decode=0))
    assert (lone.flexible, lone.flexible_prefill) == (1, 1)
    objs = render_all(floor_one, Owner("agile", "ns", "uid"), lone)
    assert next(o for o in objs if o["kind"] == "StatefulSet")["spec"]["replicas"] == 1
    assert Replicas.choose(spec, AutoscalingState(prefill=1, decode=0)).flexible == 2


def test_each_ready_engine_is_labelled_with_the_role_the_routers_make_it_act_as() -> None:
    pods = [
        _pod(2),
        _pod(0, acting="decode"),
        _pod(1, acting="prefill"),
        _pod(3, ready=False, acting="decode"),
    ]
    assert flexible.acting_roles(pods, 2) == {
        "agile-flexible-0": "prefill",
        "agile-flexible-1": "prefill",
        "agile-flexible-2": "decode",
        "agile-flexible-3": None,  # not ready: no role, its series under none
    }
    # Only what differs is patched; None removes the label.
    assert flexible.relabels(pods, 2) == {
        "agile-flexible-0": "prefill",
        "agile-flexible-2": "decode",
        "agile-flexible-3": None,
    }
    # Alone it serves requests whole, filed as prefill: it computes every prompt.
    assert flexible.relabels([_pod(0, acting="decode")], 1) == {"agile-flexible-0": "prefill"}
    assert flexible.relabels([_pod(0, role=C.ROLE_ROUTER)], 1) == {}  # not the pool's


def test_the_law_sees_the_engines_each_role_acts_as() -> None:
    spec = _spec()
    status = PDClusterStatus(
        flexible=RoleStatus(desired=5, replicas=5, ready=4),
        autoscaling=AutoscalingState(prefill=3, decode=2),
    )
    stuck = {"metadata": {"name": "agile-flexible-4"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}}  # fmt: skip
    seen = flexible_observed(spec, status, [stuck])
    assert seen.prefill == RoleObserved(desired=3, replicas=3, ready=3, unschedulable=0)
    assert seen.decode == RoleObserved(desired=2, replicas=2, ready=1, unschedulable=1)


def test_a_lone_engine_is_seen_and_shown_as_prefill() -> None:
    """A pool the law shrank to one engine (1:0): the engine serves requests whole and
    computes every prompt, so the law sees one prefill engine and no decode engine, and
    status shows the split 1:0."""
    from pdcluster.status import _ratio

    spec = _spec()
    lone = AutoscalingState(prefill=1, decode=0)
    status = PDClusterStatus(flexible=RoleStatus(desired=1, replicas=1, ready=1), autoscaling=lone)
    seen = flexible_observed(spec, status, [])
    assert seen.prefill == RoleObserved(desired=1, replicas=1, ready=1, unschedulable=0)
    assert seen.decode == RoleObserved(desired=0, replicas=0, ready=0, unschedulable=0)
    assert _ratio(spec, lone, RoleStatus(), RoleStatus(), None, status.flexible) == "1:0"


EASY = {"prefill": True, "decode": True}


def test_a_role_short_of_engines_takes_what_the_other_spares() -> None:
    assert prefill_share(6, 2, {"prefill": 4, "decode": 2}, EASY) == 4
    assert prefill_share(6, 2, {"prefill": 4, "decode": 3}, EASY) == 3  # decode spares one
    assert prefill_share(6, 2, {}, EASY) == 2  # no needs known: the law's own split
    assert prefill_share(3, 1, {"prefill": 9, "decode": 1}, EASY) == 2  # one decode engine is kept
    # Near its own target a role spares nothing, whatever its model says it needs.
    assert prefill_share(6, 2, {"prefill": 4, "decode": 2}, {"prefill": True, "decode": False}) == 2


def test_engines_no_role_asks_for_stay_where_they_are() -> None:
    # After a burst: prefill holds 7 of 8 engines it no longer needs, decode wants none
    # more. The split stays for the next burst; the pool's size lets them go.
    assert prefill_share(8, 7, {"prefill": 1, "decode": 1}, EASY) == 7
    assert prefill_share(8, 7, {"prefill": 1, "decode": 3}, EASY) == 5  # decode short by 2


def test_both_roles_short_share_the_pool_in_proportion_past_a_band() -> None:
    assert prefill_share(6, 2, {"prefill": 5, "decode": 7}, EASY) == 2  # share 2.5: within the band
    assert prefill_share(8, 6, {"prefill": 7, "decode": 7}, EASY) == 4


def _quiet(busy: float = LONE_BUSY / 2, pressure: float = 0.3, **need) -> dict[Role, Need]:
    """Both roles content with one engine, with headroom; prefill busy `busy` of the time."""
    calm = {"up": 1, "down": 1, "pressure": pressure, "headroom": True}
    return {Role.prefill: Need(load_engines=busy, **calm | need), Role.decode: Need(**calm | need)}


ONE_EACH = {Role.prefill: 1, Role.decode: 1}
LONE = {Role.prefill: 1, Role.decode: 0}


def test_a_quiet_pool_goes_to_one_engine_and_a_busier_one_comes_back() -> None:
    assert lone_wants(ONE_EACH, _quiet(), ONE_EACH) == LONE
    # Going alone needs light prompts and both quantiles well within their targets ...
    heavier = LONE_BUSY * (1 + LONE_STAY) / 2  # enough to stay alone, not to go there
    assert lone_wants(ONE_EACH, _quiet(busy=heavier), ONE_EACH) == ONE_EACH
    assert lone_wants(ONE_EACH, _quiet(pressure=0.7), ONE_EACH) == ONE_EACH
    assert lone_wants(ONE_EACH, _quiet(headroom=False), ONE_EACH) == ONE_EACH
    # ... staying alone, targets kept and prompts up to LONE_STAY times as heavy.
    assert lone_wants(LONE, _quiet(busy=heavier, pressure=0.9, headroom=False), ONE_EACH) == LONE
    assert lone_wants(LONE, _quiet(busy=LONE_BUSY * LONE_STAY * 1.2), ONE_EACH) == ONE_EACH
    assert lone_wants(LONE, _quiet(violated=True), ONE_EACH) == ONE_EACH
    assert lone_wants(LONE, _quiet(up=2), {Role.prefill: 2, Role.decode: 1}) == {
        Role.prefill: 2,
        Role.decode: 1,
    }


def test_a_lone_engine_missing_its_target_gets_a_decode_engine_not_a_reactive_prefill() -> None:
    # Its misses are prompts and streams sharing one engine: the reactive +1 prefill the
    # law adds where the model sees no reason is dropped; what the model asks for is kept.
    missed = _quiet(violated=True, reactive=True)
    assert lone_wants(LONE, missed, {Role.prefill: 2, Role.decode: 1}) == ONE_EACH
    short = {Role.prefill: Need(up=3, down=3, violated=True), Role.decode: Need(up=1, down=1)}
    assert lone_wants(LONE, short, {Role.prefill: 3, Role.decode: 1}) == {Role.prefill: 3, Role.decode: 1}
    # Without the prompts' load known, the pool does not go alone.
    assert lone_wants(ONE_EACH, _quiet(busy=None), ONE_EACH) == ONE_EACH


def _window(prompt_tokens: float, output_tokens: float) -> object:
    rps = 20.0
    return assemble(
        window_s=120,
        prompt_tokens_rate=rps * prompt_tokens,
        prefilled_tokens_rate=rps * prompt_tokens,
        prefilled_rate=rps,
        finished_rate=rps,
        generated_tokens_rate=rps * output_tokens,
        prefill_time_ms=prompt_tokens / 20.0,
        prefill_steps_rate=rps,
        prefill_ready=2.0,
        prefix_queries_rate=rps * prompt_tokens,
        prefix_hits_rate=0.0,
        decode_running=rps * output_tokens * 0.02,
        decode_tokens_rate=rps * output_tokens,
        decode_kv_usage=0.3,
        decode_ready=2.0,
        ttft_ms=2500.0,
        itl_ms=15.0,
        prefill_ttft_ms=2500.0,
        queue_time_ms=1500.0,
        queue_time_q_ms=2000.0,
    )


def test_long_prompts_flip_decode_engines_to_prefill_within_the_pool() -> None:
    """Long prompts, short answers, TTFT missed at 2:2 of a budget of 4. Decode has
    headroom; once it has wanted fewer engines for DONOR_SETTLE_S the flexible law flips
    engines to prefill (cause SplitFlipped), and the pool stays at 4 pods; the fixed-role
    law still waits out its window before it takes a GPU from decode (a pod to stop, one
    to start)."""
    spec = _spec(gpuBudget=4)
    observed = Observed(RoleObserved(2, 2, 2), RoleObserved(2, 2, 2))
    state = AutoscalingState(prefill=2, decode=2)
    first = decide_outcome(spec, _window(8000, 20), state, observed, NOW, profile=perf.load())
    assert (first.decision.prefill, first.decision.decode) == (2, 2), first.decision.reason
    assert "decode scale-down to 1 wanted for 0/" in first.decision.reason
    later = NOW + timedelta(seconds=DONOR_SETTLE_S)
    flex = decide_outcome(spec, _window(8000, 20), first.state, observed, later, profile=perf.load())
    assert flex.decision.cause == Cause.split_flipped.value, flex.decision.reason
    assert flex.decision.prefill > 2 and flex.decision.prefill + flex.decision.decode == 4
    assert flex.decision.action == "scale"
    events = _scaling_events(spec, first.state, flex.state, flex.decision)
    assert events == []  # a flip alone: reconcile reports it as RolesFlipped, not Scaled
    fixed = spec.model_copy(update={"mode": "disaggregated"})
    waited = decide_outcome(fixed, _window(8000, 20), state, observed, NOW, profile=perf.load())
    held = decide_outcome(fixed, _window(8000, 20), waited.state, observed, later, profile=perf.load())
    assert (held.decision.prefill, held.decision.decode) == (2, 2), held.decision.reason


class _Kube:
    """Answers merge patches as an apiserver would: done, the pod gone, or forbidden."""

    def __init__(self, answers: dict[str, int]) -> None:
        self.answers, self.patched = answers, {}

    async def merge_patch(self, api_version, kind, name, namespace, patch):
        status = self.answers.get(name, 200)
        if status != 200:
            raise ApiError(
                status, "Forbidden" if status == 403 else "NotFound", f"pods {name!r} said {status}"
            )
        self.patched[name] = patch["metadata"]["labels"][C.LABEL_ACTING_ROLE]
        return {}


async def test_labels_are_patched_and_a_refusal_is_a_warning_not_a_failed_reconcile() -> None:
    pods = [_pod(0), _pod(1), _pod(2, acting="decode")]
    kube = _Kube({"agile-flexible-1": 404})  # deleted since the cache saw it
    assert await label_acting_roles(kube, "ns", pods, 1) == []
    assert kube.patched == {"agile-flexible-0": "prefill"}
    refused = await label_acting_roles(_Kube({"agile-flexible-0": 403}), "ns", pods, 1)
    assert [(p.reason, p.blocks) for p in refused] == [("ActingRoleLabelFailed", False)]
    assert "patch on pods" in refused[0].message
