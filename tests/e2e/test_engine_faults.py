"""Engines going away under load, against the local control plane with the operator,
the router and engine simulators as real pods: a decode pod deleted, and decode scaled
down while streams are in flight. Every client request must complete."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import aiohttp
import harness
import pytest
from harness import OperatorProcess, StreamLoad, converged, is_ready
from prometheus_client.parser import text_string_to_metric_families

from pdcluster import constants as C
from pdcluster.io.kube import Kube

pytestmark = pytest.mark.cluster

# ~6.3 ms per decode step with the H200 profile the demo spec uses: ~10 s per stream,
# longer than the engines' 5 s preStop sleep, so streams are in flight at SIGTERM.
LONG_STREAM_TOKENS = 1500


def spec_with(sim_cluster: Any, name: str, decode: int) -> dict[str, Any]:
    doc = sim_cluster(name, decode={"replicas": decode, "minReplicas": 1, "maxReplicas": 6})
    # Keep each engine's request log so the test can tell which engine served whom.
    doc["spec"]["engine"]["args"] = [*doc["spec"]["engine"]["args"], "--sim-record=100000"]
    return doc


async def decode_pods(kube: Kube, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    pods = await kube.list(
        "v1", "Pod", namespace, label_selector=f"{C.LABEL_CLUSTER}={name},{C.LABEL_ROLE}={C.ROLE_DECODE}"
    )
    return {p["metadata"]["name"]: p for p in pods}


async def records(http: aiohttp.ClientSession, pod_ip: str) -> list[dict[str, Any]]:
    """The generate requests the engine at `pod_ip` has received, in arrival order."""
    async with http.get(f"http://{pod_ip}:8000/sim/requests") as r:
        return list(await r.json())


def request_ids(recs: list[dict[str, Any]]) -> list[str]:
    return [rec["headers"].get("X-Request-Id", "") for rec in recs]


async def served(http: aiohttp.ClientSession, pod_ip: str) -> list[str]:
    """Request ids the engine at `pod_ip` has received, in arrival order."""
    return request_ids(await records(http, pod_ip))


class EngineLog:
    """What one engine process received, read every 50 ms until it stops answering. Once
    its pod is gone the replacement may get the same address, so a read counts only while
    it begins with the request this process received first."""

    def __init__(self, http: aiohttp.ClientSession, pod_ip: str, first: list[dict[str, Any]]):
        self.http, self.pod_ip, self.records = http, pod_ip, first
        self._gone = False
        self._task = asyncio.create_task(self._follow())

    async def _read(self) -> bool:
        """Whether this process still answered, its records taken."""
        if self._gone:
            return False
        try:
            now = await records(self.http, self.pod_ip)
        except aiohttp.ClientError:
            now = []
        self._gone = now[:1] != self.records[:1]
        if not self._gone:
            self.records = now
        return not self._gone

    async def _follow(self) -> None:
        async def ended() -> bool:
            return not await self._read()

        # Gone within its grace period; ids() stops the reading earlier.
        await harness.wait_until(ended, timeout=120, interval=0.05, message=f"{self.pod_ip} stops answering")

    async def ids(self) -> list[str]:
        """Every request id this process received, read once more if it still answers."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._read()
        return request_ids(self.records)


async def running(http: aiohttp.ClientSession, pod_ip: str) -> float:
    async with http.get(f"http://{pod_ip}:8000/metrics") as r:
        text = await r.text()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:num_requests_running"
    )


async def router_url(kube: Kube, namespace: str, name: str) -> str:
    svc = await kube.get("v1", "Service", f"{name}-router", namespace)
    return f"http://{svc['spec']['clusterIP']}:8000"


# ------------------------------------------------------------------ 4. an engine pod deleted
async def test_deleted_decode_pod_is_replaced_and_routed_around(
    kube: Kube,
    namespace: str,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
) -> None:
    await pdc.apply(spec_with(sim_cluster, "heal", decode=2))
    await wait_until(lambda: converged(kube, pdc, "heal"), timeout=180, message="Ready")
    victim = "heal-decode-0"
    old = (await decode_pods(kube, namespace, "heal"))[victim]
    old_ip = old["status"]["podIP"]

    async with (
        aiohttp.ClientSession() as http,
        StreamLoad(await router_url(kube, namespace, "heal"), 6, 40) as load,
    ):
        async def served_load() -> list[dict[str, Any]] | None:
            recs = await records(http, old_ip)
            return recs if any(StreamLoad.number(i) for i in request_ids(recs)) else None

        log = EngineLog(http, old_ip, await wait_until(served_load, timeout=30, message=f"{victim} serves"))
        url = await router_url(kube, namespace, "heal")
        await kube.delete("v1", "Pod", victim, namespace)
        sent_before_delete = load.sent

        async def deregistered() -> bool:
            async with http.get(f"{url}/backends") as r:
                decodes = [b["url"] for b in (await r.json())["decode"]]
            return f"http://{old_ip}:8000" not in decodes

        await wait_until(deregistered, timeout=10, interval=0.02, message="router drops the pod")
        # Requests numbered above this one were sent once the router had dropped the pod.
        sent_before_drop = load.sent

        def finished_after_drop() -> bool:
            after = [o for o in load.outcomes if load.number(o.request_id) > sent_before_drop]
            return len(after) >= load.concurrency

        # The engine keeps running through its 5 s preStop sleep, its log read until it
        # stops answering: once a round of requests sent after the drop has finished, the
        # log says what reached it.
        await wait_until(finished_after_drop, timeout=30, interval=0.05, message="a round after the drop")
        reached = await log.ids()
        late = [r for r in reached if load.number(r) > sent_before_drop]
        assert not late, f"{len(late)} requests sent after the router dropped {victim} reached it"
        # Not empty: the victim was deleted once it had served this load.
        before = [r for r in reached if 0 < load.number(r) <= sent_before_delete]

        async def replaced() -> dict[str, Any] | None:
            pod = (await decode_pods(kube, namespace, "heal")).get(victim)
            fresh = pod and pod["metadata"]["uid"] != old["metadata"]["uid"] and is_ready(pod)
            return pod if fresh else None

        new = await wait_until(replaced, timeout=120, message=f"{victim} recreated and Ready")
        # Once Ready, the new engine gets traffic again.
        await wait_until(
            lambda: served(http, new["status"]["podIP"]), timeout=30, message="traffic to the new pod"
        )
        outcomes = await load.stop()

    failures = load.failures()
    assert not failures, failures[:5]
    print(
        f"{len(outcomes)} streams, 0 failed; {len(before)} reached {victim} before its deletion; "
        f"{sent_before_drop - sent_before_delete} sent between the delete and the router dropping it"
    )
    await wait_until(lambda: converged(kube, pdc, "heal"), timeout=60, message="converged")
    assert operator.failures() == []


# ------------------------------------------------------------------ 6. scale-down with streams in flight
async def test_decode_scale_down_drops_no_stream(
    kube: Kube,
    namespace: str,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
) -> None:
    await pdc.apply(spec_with(sim_cluster, "drain", decode=3))
    await wait_until(lambda: converged(kube, pdc, "drain"), timeout=180, message="Ready with 3 decode pods")
    pods = await decode_pods(kube, namespace, "drain")
    ips = {name: pod["status"]["podIP"] for name, pod in pods.items()}
    leaving = ["drain-decode-1", "drain-decode-2"]

    async with (
        aiohttp.ClientSession() as http,
        StreamLoad(await router_url(kube, namespace, "drain"), 6, LONG_STREAM_TOKENS) as load,
    ):

        async def all_busy() -> bool:
            return all([await running(http, ips[name]) > 0 for name in leaving])

        await wait_until(all_busy, timeout=60, message="streams in flight on the decode pods to remove")
        await pdc.apply(spec_with(sim_cluster, "drain", decode=1))

        async def terminating() -> bool:
            pods = await decode_pods(kube, namespace, "drain")
            return any(pods.get(name, {}).get("metadata", {}).get("deletionTimestamp") for name in leaving)

        # The StatefulSet removes them one at a time; during its preStop sleep a leaving
        # engine still answers: which streams do they hold?
        await wait_until(terminating, timeout=60, interval=0.1, message="the scale-down under way")
        held = {name: set(await served(http, ips[name])) for name in leaving}

        async def finished_at_sigterm(name: str) -> set[str]:
            """The requests finished when the engine stopped taking connections, as it does
            at SIGTERM, after its preStop sleep: the others of its streams were in flight."""

            async def refuses() -> bool:
                try:
                    await running(http, ips[name])
                except (aiohttp.ClientError, TimeoutError):
                    return True
                return False

            await wait_until(refuses, timeout=120, interval=0.1, message=f"{name} stops listening")
            return {o.request_id for o in load.outcomes}

        finished = dict(zip(leaving, await asyncio.gather(*map(finished_at_sigterm, leaving)), strict=True))

        async def gone() -> bool:
            return set(await decode_pods(kube, namespace, "drain")) == {"drain-decode-0"}

        await wait_until(gone, timeout=120, message="decode pods 1 and 2 terminated")
        outcomes = await load.stop()

    failures = load.failures()
    assert not failures, failures[:5]
    by_id = {o.request_id: o for o in outcomes}
    drained = [by_id[r] for name in leaving for r in held[name] - finished[name] if r in by_id]
    # Streams that were still running when the preStop sleep ended, i.e. at SIGTERM.
    assert drained, "no stream outlived the preStop sleep: SIGTERM's drain was not exercised"
    print(
        f"{len(outcomes)} streams, 0 dropped; {sum(map(len, held.values()))} on the removed pods, {len(drained)} past SIGTERM"
    )
    await wait_until(lambda: converged(kube, pdc, "drain"), timeout=60, message="converged at 1 decode")
    assert operator.failures() == []


# ------------------------------------------------------------------ 10. a KV hand-off broken for one pair
async def test_a_broken_kv_hand_off_is_named_in_the_status_and_routed_around(
    kube: Kube,
    namespace: str,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
) -> None:
    """One prefill's KV transfers start failing (the simulator's fault switch): within a
    probe interval the router takes the pair out of rotation, the PDCluster's KVTransfer
    condition names both pods, a Warning event says so, and requests keep succeeding."""
    doc = sim_cluster(
        "kvcheck",
        prefill={
            "replicas": 2,
            "minReplicas": 1,
            "maxReplicas": 6,
            "args": ["--sim-faults", "--sim-record=1000"],
        },
        router={"image": "pdcluster/router:0.1.0", "kvProbe": {"intervalSeconds": 5}},
    )
    await pdc.apply(doc)
    await wait_until(lambda: converged(kube, pdc, "kvcheck"), timeout=180, message="Ready")

    async def handoff(status: str) -> dict[str, Any] | None:
        condition = await pdc.condition("kvcheck", "KVTransfer")
        return condition if condition and condition["status"] == status else None

    verified = await wait_until(lambda: handoff("True"), timeout=60, message="KVTransfer verified")
    assert verified["reason"] == "Verified" and "2 prefill -> decode pair(s)" in verified["message"]
    pods = await kube.list(
        "v1", "Pod", namespace, label_selector=f"{C.LABEL_CLUSTER}=kvcheck,{C.LABEL_ROLE}={C.ROLE_PREFILL}"
    )
    by_name = {p["metadata"]["name"]: f"http://{p['status']['podIP']}:8000" for p in pods}
    bad_url, good_url = by_name["kvcheck-prefill-1"], by_name["kvcheck-prefill-0"]
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{bad_url}/sim/faults", json={"kv_send": "fail"}) as r:
            assert r.status == 200
        broken_at = time.monotonic()
        failed = await wait_until(lambda: handoff("False"), timeout=60, message="KVTransfer False")
        detected_s = time.monotonic() - broken_at
        assert failed["reason"] == "HandOffFailed"
        assert "kvcheck-prefill-1 -> kvcheck-decode-0" in failed["message"], failed
        assert "kvcheck-prefill-0" not in failed["message"], failed

        # The condition turns False on the first router's verdict; each router probes on its
        # own, so the requests below wait until every router has taken the pair out.
        async def every_router_routes_around() -> bool:
            routers = await kube.list(
                "v1",
                "Pod",
                namespace,
                label_selector=f"{C.LABEL_CLUSTER}=kvcheck,{C.LABEL_ROLE}={C.ROLE_ROUTER}",
            )
            state = await kube.get("v1", "ConfigMap", "kvcheck-router-state", namespace)
            verdicts = (state or {}).get("data") or {}
            names = {r["metadata"]["name"] for r in routers}
            return bool(names) and all(
                any(
                    p["prefill"] == "kvcheck-prefill-1"
                    for p in json.loads(verdicts.get(n, "{}")).get("failed", [])
                )
                for n in names
            )

        await wait_until(
            every_router_routes_around, timeout=60, message="every router routes around the pair"
        )
        url = await router_url(kube, namespace, "kvcheck")
        # Requests sent once the status names the pair, told apart by their ids (the router
        # passes a client's id on to the engines), not by the clock.
        body = {"model": "llama-3.1-8b", "prompt": "x" * 2000, "max_tokens": 4}
        for i in range(10):
            async with http.post(
                f"{url}/v1/completions", json=body, headers={"X-Request-Id": f"after-break-{i}"}
            ) as r:
                assert r.status == 200, await r.text()

        async def sent_after_the_break(engine_url: str) -> list[dict[str, Any]]:
            async with http.get(f"{engine_url}/sim/requests") as r:
                records = await r.json()
            return [
                rec for rec in records if rec["headers"].get("X-Request-Id", "").startswith("after-break-")
            ]

        routed = await sent_after_the_break(bad_url)
        assert not routed, routed[:2]
        assert await sent_after_the_break(good_url), (
            "the ids did not reach the engines: the check proves nothing"
        )
        async with http.post(f"{bad_url}/sim/faults", json={"kv_send": "ok"}) as r:
            assert r.status == 200
        await wait_until(lambda: handoff("True"), timeout=60, message="KVTransfer verified again")
    events = await kube.list("v1", "Event", namespace)
    warned = [e for e in events if e.get("reason") == "KVTransferFailed"]
    assert warned and "kvcheck-prefill-1" in warned[0]["message"], warned
    print(f"broken hand-off named in the status {detected_s:.1f} s after it broke (probe interval 5 s)")
    assert operator.failures() == []


# ------------------------------------------------------------------ 12. an engine change under load
async def test_an_engine_change_rolls_both_roles_and_never_pairs_revisions(
    kube: Kube,
    namespace: str,
    operator: OperatorProcess,
    pdc: Any,
    sim_cluster: Any,
    wait_until: Any,
) -> None:
    """A change both roles must agree on (the engines' arguments) under streaming load: one
    pod of each role first, then both roles together; no decode request ever names a
    prefill engine of the other revision; no stream fails; `status.rollout` says how far
    it is; the autoscaler keeps deciding throughout."""
    record = ["--sim-record=100000"]
    doc = sim_cluster(
        "roll",
        # Three of each: old and new pods of both roles serve side by side for a while.
        prefill={"replicas": 3, "minReplicas": 1, "maxReplicas": 4, "args": record},
        decode={"replicas": 3, "minReplicas": 1, "maxReplicas": 4, "args": record},
        autoscaling={
            "enabled": True,
            "mode": "recommend",
            "gpuBudget": 8,
            "intervalSeconds": 5,
            "windowSeconds": 30,
        },
    )
    await pdc.apply(doc)
    await wait_until(lambda: converged(kube, pdc, "roll"), timeout=180, message="Ready")
    selector = f"{C.LABEL_CLUSTER}=roll"
    prefill_ids: dict[str, str] = {}  # engine id -> its pod's revision
    decode_seen: dict[str, tuple[str, set[str]]] = {}  # decode pod uid -> (revision, prefill ids named)
    rollout_seen: list[str] = []
    runs_during_rollout: set[str] = set()
    done = asyncio.Event()

    async def sample(http: aiohttp.ClientSession) -> None:
        while not done.is_set():
            for pod in await kube.list("v1", "Pod", namespace, label_selector=selector):
                labels, ip = pod["metadata"]["labels"], pod.get("status", {}).get("podIP")
                revision, role = labels.get(C.LABEL_KV_REVISION, ""), labels.get(C.LABEL_ROLE)
                if not ip or role not in C.ENGINE_ROLES:
                    continue
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    if role == C.ROLE_PREFILL:
                        async with http.get(
                            f"http://{ip}:8998/query", timeout=aiohttp.ClientTimeout(total=2)
                        ) as r:
                            for entry in (await r.json()).values():
                                prefill_ids[entry["engine_id"]] = revision
                    else:
                        async with http.get(
                            f"http://{ip}:8000/sim/requests", timeout=aiohttp.ClientTimeout(total=2)
                        ) as r:
                            named = {
                                (rec["body"].get("kv_transfer_params") or {}).get("remote_engine_id")
                                for rec in await r.json()
                            } - {None}
                        uid = pod["metadata"]["uid"]
                        decode_seen[uid] = (revision, decode_seen.get(uid, (revision, set()))[1] | named)
            status = (await pdc.get("roll") or {}).get("status") or {}
            if status.get("rollout"):
                rollout_seen.append(status["rollout"])
                runs_during_rollout.add((status.get("autoscaling") or {}).get("lastRunTime") or "")
            await asyncio.sleep(0.3)

    url = await router_url(kube, namespace, "roll")
    async with aiohttp.ClientSession() as http, StreamLoad(url, 4, 40) as load:
        sampler = asyncio.create_task(sample(http))

        def revisions_served() -> set[str]:
            return {revision for revision, named in decode_seen.values() if named}

        # The old revision has served hand-offs before the change.
        await wait_until(revisions_served, timeout=60, interval=0.3, message="the old revision serving")
        doc["spec"]["engine"]["args"] = [
            a.replace("--sim-kv-gbps=100", "--sim-kv-gbps=200") for a in doc["spec"]["engine"]["args"]
        ]
        assert "--sim-kv-gbps=200" in doc["spec"]["engine"]["args"]
        await pdc.apply(doc)

        async def rolled() -> bool:
            body = await pdc.get("roll")
            pods = await kube.list("v1", "Pod", namespace, label_selector=selector)
            revisions = {
                p["metadata"]["labels"].get(C.LABEL_KV_REVISION)
                for p in pods
                if p["metadata"]["labels"].get(C.LABEL_ROLE) in C.ENGINE_ROLES
            }
            return (
                len(revisions) == 1
                and not (body or {}).get("status", {}).get("rollout")
                and await converged(kube, pdc, "roll")
            )

        await wait_until(rolled, timeout=240, message="both roles on the new revision")
        # ... and the new one has too, as the sampler has seen.
        await wait_until(
            lambda: len(revisions_served()) == 2, timeout=60, interval=0.3, message="the new revision serving"
        )
        done.set()
        await sampler
        outcomes = await load.stop()
    assert not load.failures(), load.failures()[:5]
    mixed = {
        uid: sorted(prefill_ids.get(e, "unknown") for e in named if prefill_ids.get(e) != revision)
        for uid, (revision, named) in decode_seen.items()
    }
    assert not any(mixed.values()), mixed
    revisions = revisions_served()
    assert len(revisions) == 2, (
        f"both revisions must have served for the check to mean anything: {decode_seen}"
    )
    assert rollout_seen and rollout_seen[0].startswith("prefill 0/3, decode 0/3"), rollout_seen[:3]
    assert len(runs_during_rollout - {""}) >= 2, (
        f"the autoscaler ran {runs_during_rollout} during the rollout"
    )
    print(
        f"{len(outcomes)} streams, 0 failed; {len(decode_seen)} decode pods over both revisions, 0 mixed pairs; "
        f"progress seen: {' | '.join(dict.fromkeys(rollout_seen))}"
    )
    assert operator.failures() == []
