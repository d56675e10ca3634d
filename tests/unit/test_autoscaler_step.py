"""The autoscaler hook (autoscaler.py) on the in-memory apiserver and a Prometheus that
answers from memory: when it asks, what it does without answers, the pods it counts,
the profile it reads, and the events it hands to reconcile."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fakekube import FakeKube
from test_control_law import T0, metrics, spec

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import Condition, PDClusterSpec, PDClusterStatus, RoleStatus, StartupStatus
from pdcluster.autoscaler import PrometheusAutoscaler
from pdcluster.control import MetricsSnapshot, RoleMetrics
from pdcluster.io.prometheus import PrometheusUnavailable
from pdcluster.perf import PROFILE_KEY, load, to_json
from pdcluster.render import Owner

OWNER = Owner("c", "ns", "uid")


class FakePrometheus:
    def __init__(self, snapshot: Any = None, fail: bool = False):
        self.snapshot_value, self.fail, self.asked = snapshot, fail, 0

    async def snapshot(self, *args: Any) -> Any:
        self.asked += 1
        if self.fail:
            raise PrometheusUnavailable("connection refused")
        return self.snapshot_value

    async def router_p99_ms(self, *args: Any) -> tuple[int | None, int | None]:
        return 900, 20


def autoscaler(
    kube: FakeKube, prom: FakePrometheus | None, url: str | None = "http://prom:9090"
) -> PrometheusAutoscaler:
    a = PrometheusAutoscaler(kube, url)  # type: ignore[arg-type]
    a._prometheus = lambda _url, _creds: prom  # type: ignore[assignment,method-assign,return-value]
    return a


def status(prefill: int = 4, decode: int = 4) -> PDClusterStatus:
    return PDClusterStatus(
        prefill=RoleStatus(desired=prefill, replicas=prefill, ready=prefill),
        decode=RoleStatus(desired=decode, replicas=decode, ready=decode),
    )


def auto(s: PDClusterSpec) -> PDClusterSpec:
    return s.model_copy(update={"autoscaling": s.autoscaling.model_copy(update={"mode": "auto"})})


async def test_a_ttft_miss_scales_prefill_and_says_so_in_an_event() -> None:
    prom = FakePrometheus(metrics(rate=14.0, ttft=2400, wait=1800))
    result = await autoscaler(FakeKube(), prom).step(
        auto(spec(profile="h200-llama3.1-8b")), OWNER, status(), T0
    )
    assert result.state is not None and result.state.prefill > 4
    assert result.condition and result.condition[0] is True and result.condition[1] == "TTFTOverTarget"
    assert [e[:2] for e in result.events] == [("Normal", "Scaled")]
    assert result.latency_p99_ms == (900, 20)


async def test_between_intervals_it_asks_nobody() -> None:
    prom = FakePrometheus(metrics())
    a = autoscaler(FakeKube(), prom)
    first = await a.step(spec(), OWNER, status(), T0)
    held = status().model_copy(update={"autoscaling": first.state})
    again = await a.step(spec(), OWNER, held, T0 + timedelta(seconds=5))  # interval 30 s
    assert prom.asked == 1 and again.state == first.state and again.events == []


async def test_without_answers_it_holds_and_says_why() -> None:
    kube = FakeKube()
    for prom, url, reason in [
        (FakePrometheus(fail=True), "http://prom:9090", "MetricsUnavailable"),
        (FakePrometheus(None), "http://prom:9090", "NoMetrics"),
        (None, None, "NoPrometheus"),
    ]:
        result = await autoscaler(kube, prom, url).step(auto(spec()), OWNER, status(), T0)
        assert result.condition and result.condition[:2] == (False, reason), result.condition
        assert result.events == []
        assert result.state is not None and (result.state.prefill, result.state.decode) == (4, 4)


async def test_a_profile_from_a_config_map_or_a_clear_error() -> None:
    kube = FakeKube()
    s = spec(profileConfigMap="my-profile")
    result = await autoscaler(kube, FakePrometheus(metrics())).step(s, OWNER, status(), T0)
    assert result.condition and result.condition[1] == "UnknownProfile"
    assert "ns/my-profile not found" in result.condition[2]
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "my-profile", "namespace": "ns"}}
    kube.put({**cm, "data": {PROFILE_KEY: to_json(load("h200-llama3.1-8b"))}})
    result = await autoscaler(kube, FakePrometheus(metrics())).step(s, OWNER, status(), T0)
    assert result.condition and result.condition[1] != "UnknownProfile"


def unschedulable_pods(kube: FakeKube, role: str, count: int) -> None:
    for i in range(count):
        kube.put(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"c-{role}-{i}",
                    "namespace": "ns",
                    "labels": {C.LABEL_CLUSTER: "c", C.LABEL_ROLE: role},
                },
                "status": {
                    "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
                },
            }
        )


async def test_pods_the_scheduler_cannot_place_are_counted() -> None:
    kube = FakeKube()
    unschedulable_pods(kube, C.ROLE_DECODE, 2)
    a = autoscaler(kube, FakePrometheus(metrics()))
    observed = await a._observed(spec(), OWNER, status())
    assert (observed.decode.unschedulable, observed.prefill.unschedulable) == (2, 0)


async def test_a_colocated_pool_is_sized_on_its_own_pods_and_metrics() -> None:
    kube = FakeKube()
    unschedulable_pods(kube, C.ROLE_COLOCATED, 1)
    s = PDClusterSpec.model_validate(
        {
            "model": {"name": "m"},
            "mode": "colocated",
            "colocated": {"replicas": 2, "maxReplicas": 6},
            "autoscaling": {"enabled": True, "slo": {"ttftMs": 500, "itlMs": 25}},
        }
    )
    pool = RoleStatus(desired=2, replicas=2, ready=2)
    snapshot = MetricsSnapshot(
        window_s=120, request_rate=6.0, ttft_ms=1500.0, itl_ms=20.0, colocated=RoleMetrics(kv_usage=0.5)
    )
    result = await autoscaler(kube, FakePrometheus(snapshot)).step(
        s, OWNER, PDClusterStatus(colocated=pool), T0
    )
    observed = await autoscaler(kube, None)._observed(s, OWNER, PDClusterStatus(colocated=pool))
    assert (observed.colocated.ready, observed.colocated.unschedulable) == (2, 1)
    assert result.state is not None and result.state.colocated == 4
    assert (result.state.prefill, result.state.decode) == (None, None)
    assert result.condition == (True, "TTFTOverTarget", "colocated 2 -> 4: TTFT p90 1500 ms over 500 ms")
    assert [e[1] for e in result.events] == ["Scaled"]


async def test_mode_advice_is_a_condition_an_event_when_it_turns_and_stands_between_runs() -> None:
    s = auto(spec(profile="h200-llama3.1-8b", slo={"ttftMs": 20000, "itlMs": 100}))
    long_prompts = metrics(isl=65536.0, rate=0.5)
    a = autoscaler(FakeKube(), FakePrometheus(long_prompts))
    result = await a.step(s, OWNER, status(), T0)
    assert result.mode_fit is not None and result.mode_fit[:2] == (False, "OtherModeBetter")
    assert ("Normal", "ModeAdvice", result.mode_fit[2]) in result.events
    # Between runs, and on the next run with the same advice: the condition stands, no new event.
    before = status().model_copy(
        update={
            "autoscaling": result.state,
            "conditions": [
                Condition(
                    type="ModeFit",
                    status="False",
                    reason="OtherModeBetter",
                    message="m",
                    last_transition_time="2026-03-01T12:00:00Z",
                )
            ],
        }
    )
    between = await a.step(s, OWNER, before, T0 + timedelta(seconds=5))
    assert between.mode_fit == (False, "OtherModeBetter", "m") and not between.events
    again = await a.step(s, OWNER, before, T0 + timedelta(seconds=60))
    assert again.mode_fit is not None and not again.mode_fit[0]
    assert all(e[1] != "ModeAdvice" for e in again.events)


async def test_the_law_gets_the_measured_start_up_or_the_default() -> None:
    measured = StartupStatus(last_seconds=300, median_seconds=240, pods=[])
    observed = await autoscaler(FakeKube(), None)._observed(
        spec(), OWNER, PDClusterStatus(decode=RoleStatus(startup=measured))
    )
    assert observed.decode.startup_s == 240.0
    assert observed.prefill.startup_s is None  # nothing measured yet: the law assumes its default
