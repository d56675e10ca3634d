"""Faults for the chaos runs, on a seeded schedule, and a watch of the cluster while they
land: which roles have ready engines, and when the PDCluster is converged again. Plain
code shared by tests/e2e/test_chaos.py and benchmarks/chaos.py, no pytest."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from chaosload import MixedLoad, Verdicts, judge, prompts, references
from harness import (
    OperatorProcess,
    convergence_problems,
    is_ready,
    make_sim_cluster,
    settled,
    start_operator,
    wait_until,
)

from localcluster import State, restart, start_component, stop_component
from localcluster.ports import free_port
from pdcluster import constants as C
from pdcluster import observability as obs
from pdcluster.io.kube import Kube

# Every kind of fault, each once in the short run.
KINDS = (
    "sigkill-prefill",
    "sigkill-decode",
    "delete-prefill",
    "delete-decode",
    "delete-router",
    "sigkill-operator",
    "sigkill-mooncake-master",
    "stop-prometheus",
    "restart-apiserver",
)
PROMETHEUS_DOWN_S = 60.0
OPERATOR_DOWN_S = (2.0, 8.0)  # how long the operator stays dead: a pod's restart, roughly
INJECT_RETRY_S = 60.0  # a pod fault waits this long for an apiserver that is restarting
NOTICE_S = 10.0  # a divergence this soon after a fault is the fault's (pods take a moment to fail)
OPERATOR_DECISIONS = obs.OPERATOR_DECISIONS + "_total"


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the start of the run
    kind: str


def schedule(seed: int, duration: float, repeat_every: float | None = None) -> list[Fault]:
    """Each kind once at a random time in the first 70% of `duration` (so they overlap);
    with `repeat_every`, then random kinds about that often until the run's last 15%."""
    rng = random.Random(seed)
    faults = [Fault(round(rng.uniform(0.05, 0.7) * duration, 1), kind) for kind in KINDS]
    if repeat_every:
        at = 0.7 * duration
        while (at := at + rng.uniform(0.5, 1.5) * repeat_every) < 0.85 * duration:
            faults.append(Fault(round(at, 1), rng.choice(KINDS)))
    return sorted(faults, key=lambda f: f.at)


@dataclass
class Injected:
    fault: Fault
    target: str
    started: float  # time.monotonic()
    ended: float  # the fault is over (a component is back, a replacement asked for)
    converged_after: float | None = None  # seconds from `ended` to converged again (0: never diverged)


@dataclass
class Watch:
    """Polls the PDCluster, its pods and the operator: when a role had no ready engine,
    when all was converged (the full check, harness.convergence_problems), how many times
    the autoscaler decided (the operator's counter, summed over its restarts)."""

    kube: Kube
    namespace: str
    name: str
    operator: Callable[[], OperatorProcess]
    no_engine_at: list[float] = field(default_factory=list)
    polls: list[tuple[float, bool]] = field(default_factory=list)  # (when, converged)
    decisions: float = 0.0
    _last_count: float = 0.0

    async def run(self, stop: asyncio.Event, interval: float = 1.0) -> None:
        while not stop.is_set():
            now = time.monotonic()
            try:
                self.polls.append((now, await self._poll(now)))
            except Exception:  # the apiserver may be down: keep watching
                self.polls.append((now, False))
            await self._count_decisions()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def _poll(self, now: float) -> bool:
        selector = f"{C.LABEL_CLUSTER}={self.name}"
        pods = await self.kube.list("v1", "Pod", self.namespace, label_selector=selector)
        ready = {role: 0 for role in C.ENGINE_ROLES}
        for pod in pods:
            role = pod["metadata"]["labels"].get(C.LABEL_ROLE)
            if role in ready and is_ready(pod) and not pod["metadata"].get("deletionTimestamp"):
                ready[role] += 1
        if 0 in ready.values():
            self.no_engine_at.append(now)
        # Healed means every pod Ready and none terminating, besides the children as rendered.
        if any(not is_ready(p) or p["metadata"].get("deletionTimestamp") for p in pods):
            return False
        body = await self.kube.get(C.API_VERSION, C.KIND, self.name, self.namespace)
        return bool(body and settled(body) and not await convergence_problems(self.kube, body))

    async def _count_decisions(self) -> None:
        try:
            count = await self.operator().metric(OPERATOR_DECISIONS, pdcluster=self.name)
        except (aiohttp.ClientError, OSError):
            return  # the operator is down
        # A restarted operator counts from zero again.
        self.decisions += count - self._last_count if count >= self._last_count else count
        self._last_count = count

    def recovered_after(self, t: float) -> float | None:
        """Seconds from `t` (a fault's end) until converged again, counting the first
        divergence seen within NOTICE_S of it; 0.0 when none was seen."""
        later = [(at, ok) for at, ok in self.polls if at >= t]
        diverged = next((i for i, (at, ok) in enumerate(later) if not ok and at <= t + NOTICE_S), None)
        if diverged is None:
            return 0.0
        return next((at - t for at, ok in later[diverged:] if ok), None)


class Injector:
    """Carries out faults against one PDCluster; keeps the current operator process
    (`start_operator()` starts another after a SIGKILL)."""

    def __init__(
        self,
        kube: Kube,
        state: State,
        namespace: str,
        name: str,
        start_operator: Callable[[], OperatorProcess],
        seed: int,
    ):
        self.kube, self.state, self.namespace, self.name = kube, state, namespace, name
        self.start_operator = start_operator
        self.operators = [start_operator()]
        self.rng = random.Random(seed)
        # Overlapping faults of one component take turns: one operator at a time, say.
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def operator(self) -> OperatorProcess:
        return self.operators[-1]

    async def inject(self, fault: Fault) -> Injected:
        started = time.monotonic()
        action, _, what = fault.kind.partition("-")
        async with self._locks.setdefault(what, asyncio.Lock()):
            deadline = started + INJECT_RETRY_S
            while True:
                try:
                    target = await self._inject(action, what)
                    break
                except Exception as e:  # the apiserver may be restarting: try again, then say so
                    if time.monotonic() > deadline:
                        target = f"not injected: {type(e).__name__}: {e}"[:120]
                        break
                    await asyncio.sleep(1.0)
        return Injected(fault, target, started, time.monotonic())

    async def _inject(self, action: str, what: str) -> str:
        if what in C.ENGINE_ROLES or what == C.ROLE_ROUTER:
            return await self._pod_fault(action, what)
        if what == "operator":
            return await self._operator_fault()
        if what == "mooncake-master":
            return await self._pod_fault("sigkill", C.ROLE_MOONCAKE_MASTER)
        if what == "prometheus":
            await asyncio.to_thread(stop_component, self.state.name, "prometheus")
            try:
                await asyncio.sleep(PROMETHEUS_DOWN_S)
            finally:
                await asyncio.to_thread(start_component, self.state.name, "prometheus")
            return f"prometheus stopped for {PROMETHEUS_DOWN_S:.0f}s"
        await asyncio.to_thread(restart, self.state.name, "kube-apiserver")
        return "kube-apiserver restarted"

    async def _pod_fault(self, action: str, role: str) -> str:
        """SIGKILL to the container's processes (as an OOM kill: the pod restarts it) or a
        graceful delete (its controller makes another) of a random ready pod of `role`."""
        selector = f"{C.LABEL_CLUSTER}={self.name},{C.LABEL_ROLE}={role}"
        pods = [
            p
            for p in await self.kube.list("v1", "Pod", self.namespace, label_selector=selector)
            if is_ready(p) and not p["metadata"].get("deletionTimestamp")
        ]
        if not pods:
            return f"no ready {role} pod"
        pod = self.rng.choice(pods)
        name = pod["metadata"]["name"]
        if action == "delete":
            await self.kube.delete("v1", "Pod", name, self.namespace)
            return f"{name} deleted"
        # The pod runner's container id is the process (group) id.
        pid = int(pod["status"]["containerStatuses"][0]["containerID"].rpartition("/")[2])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return f"{name} SIGKILLed"

    async def _operator_fault(self) -> str:
        self.operator.kill(signal.SIGKILL)
        await asyncio.sleep(self.rng.uniform(*OPERATOR_DOWN_S))
        self.operators.append(self.start_operator())
        return f"operator SIGKILLed, back after {len(self.operators) - 1} restart(s)"


async def run_schedule(injector: Injector, faults: list[Fault], started: float) -> list[Injected]:
    """Each fault at its time; the long ones (Prometheus away for a minute) overlap later ones."""

    async def at(fault: Fault) -> Injected:
        await asyncio.sleep(max(0.0, started + fault.at - time.monotonic()))
        return await injector.inject(fault)

    return list(await asyncio.gather(*(at(f) for f in faults)))


def operator_failures(log: Path) -> tuple[list[str], list[str]]:
    """(tracebacks, ERROR lines) in the operators' shared log."""
    lines = log.read_text(errors="replace").splitlines()
    return (
        [line for line in lines if "Traceback (most recent call last)" in line],
        [line for line in lines if " ERROR " in line],
    )


# ------------------------------------------------------------------ a whole run
def chaos_spec(name: str) -> dict[str, Any]:
    """The demo PDCluster with two engines of each role and two routers, engines passing
    their KV through the Mooncake master, and the autoscaler on (auto, 2 to 3 a role)."""
    doc = make_sim_cluster(
        name,
        prefill={"replicas": 2, "minReplicas": 2, "maxReplicas": 3},
        decode={"replicas": 2, "minReplicas": 2, "maxReplicas": 3},
        router={"image": "pdcluster/router:0.1.0", "replicas": 2},
        autoscaling={
            "enabled": True,
            "mode": "auto",
            "slo": {"ttftMs": 2000, "itlMs": 50, "quantile": "p90"},
            "gpuBudget": 6,
            "intervalSeconds": 5,
            "windowSeconds": 15,
            "scaleDownStabilizationSeconds": 30,
            "cooldownSeconds": 10,
        },
    )
    doc["spec"]["engine"]["args"] = [
        *doc["spec"]["engine"]["args"],
        f"--sim-mooncake-master={name}-{C.ROLE_MOONCAKE_MASTER}:50051",  # the master's Service
    ]
    return doc


@dataclass
class Run:
    injected: list[Injected]
    verdicts: Verdicts
    tracebacks: list[str]
    errors: list[str]
    operator_restarts: int
    autoscaler_decisions: int
    final_problems: list[str]

    def lines(self) -> list[str]:
        out = [f"requests: {self.verdicts.line()}"]
        for i in self.injected:
            after = "not seen" if i.converged_after is None else f"{i.converged_after:.1f}s"
            out.append(
                f"  t={i.fault.at:6.1f}s {i.fault.kind:24} {i.target}; converged again {after} after it ended"
            )
        out.append(
            f"operator: {len(self.tracebacks)} tracebacks, {len(self.errors)} ERROR lines, "
            f"{self.operator_restarts} restarts; autoscaler decisions: {self.autoscaler_decisions}; "
            f"at the end, after a spec change: {self.final_problems or 'matches the spec, no orphans'}"
        )
        return out


async def run_chaos(
    kube: Kube,
    state: State,
    namespace: str,
    name: str,
    log: Path,
    *,
    seed: int,
    duration: float,
    repeat_every: float | None = None,
    max_tokens: int = 48,
) -> Run:
    """Applies chaos_spec, waits for it, then runs traffic for `duration` seconds while the
    schedule's faults land, and waits for the cluster to converge once more."""

    def operator() -> OperatorProcess:
        port = free_port()
        extra = (f"--prometheus-url={state.prometheus_url}", f"--metrics-port={port}")
        op = start_operator(state.kubeconfig, namespace, log, *extra)
        op.metrics_port = port
        return op

    doc = {"apiVersion": C.API_VERSION, "kind": C.KIND, **chaos_spec(name)}
    doc["metadata"] = {**doc["metadata"], "namespace": namespace}
    await kube.apply(doc, field_manager="chaos")
    injector = Injector(kube, state, namespace, name, operator, seed)
    watch = Watch(kube, namespace, name, lambda: injector.operator)
    stop = asyncio.Event()
    try:
        await wait_until(lambda: _converged(kube, namespace, name), timeout=240, interval=1, message="Ready")
        svc = await kube.get("v1", "Service", f"{name}-router", namespace)
        url = f"http://{svc['spec']['clusterIP']}:8000"
        texts = prompts(8, seed)
        answers_before = await references(url, texts, max_tokens)
        watcher = asyncio.create_task(watch.run(stop))
        async with MixedLoad(url, texts, max_tokens, streams=6, wholes=2, seed=seed) as load:
            started = time.monotonic()
            injected = await run_schedule(injector, schedule(seed, duration, repeat_every), started)
            await asyncio.sleep(max(0.0, started + duration - time.monotonic()))
        # Convergence is judged with the watch still running, after the last fault.
        await wait_until(
            lambda: _converged(kube, namespace, name), timeout=300, interval=1, message="converged"
        )
        stop.set()
        await watcher
        watch.polls.append((time.monotonic(), True))  # for faults that ended after its last poll
        final = await _acts_on_a_spec_change(kube, doc)
    finally:
        stop.set()
        injector.operator.kill(signal.SIGTERM)
    for i in injected:
        i.converged_after = watch.recovered_after(i.ended)
    tracebacks, errors = operator_failures(log)
    return Run(
        injected,
        judge(load.answers, answers_before, watch.no_engine_at, max_tokens),
        tracebacks,
        errors,
        len(injector.operators) - 1,
        int(watch.decisions),
        final,
    )


async def _acts_on_a_spec_change(kube: Kube, doc: dict[str, Any]) -> list[str]:
    """After the faults, the operator still follows its PDClusters (kopf's watch survived
    the apiserver restarts): a change of the spec converges. What still differs, if not."""
    namespace, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
    doc["spec"]["router"]["replicas"] = 3  # a Deployment's change: no engine rolls
    await kube.apply(doc, field_manager="chaos")
    with contextlib.suppress(AssertionError):  # what still differs is reported below
        await wait_until(
            lambda: _converged(kube, namespace, name), timeout=180, interval=1, message="changed"
        )
    body = await kube.get(C.API_VERSION, C.KIND, name, namespace)
    if not body:
        return ["the PDCluster is gone"]
    problems = await convergence_problems(kube, body)
    return problems if settled(body) else [*problems, "not settled on the changed spec"]


async def _converged(kube: Kube, namespace: str, name: str) -> bool:
    body = await kube.get(C.API_VERSION, C.KIND, name, namespace)
    if not settled(body):
        return False
    problems = await convergence_problems(kube, body)
    assert not problems, problems
    return True
