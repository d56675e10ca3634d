"""Running the real operator against the local cluster, shared by the test fixtures
(tests/conftest.py) and the benchmarks that need a live operator (benchmarks/soak.py,
benchmarks/specs_property.py). Plain functions, no pytest."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdcluster import constants as C
from pdcluster import observability as obs
from pdcluster.api.v1alpha1 import PDClusterSpec, PDClusterStatus
from pdcluster.drift import differences
from pdcluster.io.kube import ApiError, Kube
from pdcluster.render import Owner, Replicas, render_all

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "pdcluster.io_pdclusters.yaml"
# What the operator must never log: a traceback (an unhandled exception somewhere) or an
# ERROR line (kopf reports failed handlers that way).
_FAILURE = re.compile(r"Traceback \(most recent call last\)|\sERROR\s")


async def wait_until(
    predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.2, message: str = ""
) -> Any:
    """Polls `predicate` (sync or async) until it returns something truthy, and returns it.
    A predicate may also raise AssertionError to mean "not yet". The one wait with a
    deadline the tests use (the fixture `wait_until` is this function), so that no test
    sleeps for a fixed time in the hope that something has happened by then."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            last = value
        except AssertionError as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout}s: {message or predicate}; last: {last!r}")
        await asyncio.sleep(interval)


def make_sim_cluster(name: str, **overrides: Any) -> dict[str, Any]:
    """examples/pdcluster-sim.yaml (engine simulators) with `name`, autoscaling off and
    top-level spec sections replaced."""
    doc = yaml.safe_load((REPO / "examples" / "pdcluster-sim.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["autoscaling"] = {"enabled": False}
    for key, value in overrides.items():
        doc["spec"][key] = copy.deepcopy(value)
    return doc


async def install_crd(kube: Kube) -> None:
    """Applies every CRD in crds/ (PDCluster, PDRoleScaler) and waits until they are served."""
    for path in sorted(CRD.parent.glob("*.yaml")):
        await kube.apply(yaml.safe_load(path.read_text()), field_manager="pdcluster-tests")

    async def established(name: str) -> bool:
        obj = await kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", name)
        conditions = ((obj or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    async def served(kind: str) -> bool:
        """Established is not enough: right after it a list can still get 429 "storage is
        (re)initializing", which kopf logs at ERROR before it retries."""
        try:
            await kube.list(C.API_VERSION, kind)
        except ApiError:
            return False
        return True

    async def all_served() -> bool:
        return (
            await established(C.CRD_NAME)
            and await established(C.SCALER_CRD_NAME)
            and await served(C.KIND)
            and await served(C.SCALER_KIND)
        )

    await wait_until(all_served, timeout=30, interval=0.1, message="CRDs served")


@dataclass
class OperatorProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str]
    _seen: int = field(default=0, repr=False)
    metrics_port: int = 0  # its /metrics, when started with --metrics-port

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of the operator's samples of `name` with `labels`, from its /metrics."""
        assert self.metrics_port, "started without --metrics-port"
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as r:
            return counter(await r.text(), name, **labels)

    async def reconciles(self) -> float:
        """How many reconciles the operator has finished, whatever their result: a count
        of its work, so that a test can wait for some to pass instead of for some time."""
        return await self.metric(obs.OPERATOR_RECONCILES + "_total")

    async def decisions(self, pdcluster: str, action: str) -> float:
        """How many runs of the control law for `pdcluster` ended in `action`."""
        return await self.metric(obs.OPERATOR_DECISIONS + "_total", pdcluster=pdcluster, action=action)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def failures(self) -> list[str]:
        """Traceback and ERROR lines logged since the last call (all of them the first time)."""
        text = self.log()
        new, self._seen = text[self._seen :], len(text)
        return [line for line in new.splitlines() if _FAILURE.search(line)]


def rss_mib(pid: int) -> float:
    """Resident memory of a process (NaN once it has exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt, so a benchmark's `finally` stops what it started."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def start_operator(kubeconfig: str, namespace: str, log_path: Path, *extra: str) -> OperatorProcess:
    """`pdcluster-operator` as a real process watching one namespace, without leader
    election, resyncing every 5 s; its output is appended to `log_path`."""
    args = [
        str(REPO / ".venv" / "bin" / "pdcluster-operator"),
        f"--kubeconfig={kubeconfig}",
        f"--namespace={namespace}",
        "--no-leader-election",
        "--resync-seconds=5",
        "--metrics-port=0",
        "--health-port=0",
        *extra,
    ]
    if not Path(args[0]).exists():
        args[0:1] = [sys.executable, "-m", "pdcluster.main"]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    return OperatorProcess(proc, log_path, args, _seen=log_path.stat().st_size)


# ------------------------------------------------------------------ convergence checks
# Every kind of child the operator renders, with its API version.
CHILD_KINDS = {
    "StatefulSet": "apps/v1",
    "Deployment": "apps/v1",
    "Service": "v1",
    "ConfigMap": "v1",
    "ServiceAccount": "v1",
    "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1",
    "LeaderWorkerSet": C.LWS_API_VERSION,
    "Job": "batch/v1",
    "PersistentVolumeClaim": "v1",
}


def desired_children(body: dict[str, Any]) -> list[dict[str, Any]]:
    """What the operator renders for this PDCluster as stored (spec and status)."""
    spec = PDClusterSpec.model_validate(body["spec"])
    status = PDClusterStatus.model_validate(body.get("status") or {})
    return render_all(spec, Owner.from_body(body), Replicas.choose(spec, status.autoscaling))


async def convergence_problems(kube: Kube, body: dict[str, Any]) -> list[str]:
    """How the live children of a PDCluster differ from what it renders: missing, drifted
    or orphaned objects, wrong owners, a wrong number of pods. Empty when converged."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    desired = {(o["kind"], o["metadata"]["name"]): o for o in desired_children(body)}
    selector = f"{C.LABEL_CLUSTER}={name}"
    problems = []
    seen = set()
    for kind, api_version in CHILD_KINDS.items():
        for obj in await kube.list(api_version, kind, namespace, label_selector=selector):
            key = (kind, obj["metadata"]["name"])
            seen.add(key)
            owners = [r.get("uid") for r in obj["metadata"].get("ownerReferences") or []]
            if key not in desired:
                problems.append(f"orphaned {kind} {key[1]}")
            elif drifted := _drift(desired[key], obj):
                problems.append(f"{kind} {key[1]} differs at {drifted[:3]}")
            if owners != [uid]:
                problems.append(f"{kind} {key[1]} is owned by {owners}, not only by {uid}")
    problems += [f"missing {kind} {n}" for kind, n in desired if (kind, n) not in seen]
    pods = await kube.list("v1", "Pod", namespace, label_selector=selector)
    for obj in desired.values():
        if obj["kind"] in ("StatefulSet", "Deployment", "LeaderWorkerSet"):
            role = obj["metadata"]["labels"][C.LABEL_ROLE]
            live = [p for p in pods if p["metadata"]["labels"].get(C.LABEL_ROLE) == role]
            want = obj["spec"]["replicas"] * obj["spec"].get("leaderWorkerTemplate", {}).get("size", 1)
            if len(live) != want:
                problems.append(f"{len(live)} {role} pods, want {want}")
    return problems


def _drift(desired: dict[str, Any], live: dict[str, Any]) -> list[str]:
    body = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "metadata")}
    labels = desired["metadata"].get("labels") or {}
    return differences(body, live) + differences(labels, live["metadata"].get("labels"), ".metadata.labels")


async def converged(kube: Kube, pdc: Any, name: str) -> bool:
    """The PDCluster settled with every child as rendered. A difference is an
    AssertionError, which wait_until takes as "not yet" and reports if it lasts."""
    body = await pdc.get(name)
    if not settled(body):
        return False
    problems = await convergence_problems(kube, body)
    assert not problems, problems
    return True


def is_ready(pod: dict[str, Any] | None) -> bool:
    """A pod whose Ready condition is True."""
    conditions = ((pod or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return None


def settled(body: dict[str, Any] | None) -> bool:
    """Ready, nothing in progress, and the status describes the current generation."""
    if not body:
        return False
    ready, progressing = condition(body, "Ready"), condition(body, "Progressing")
    return (
        (body.get("status") or {}).get("observedGeneration") == body["metadata"]["generation"]
        and ready is not None
        and ready["status"] == "True"
        and (progressing is None or progressing["status"] == "False")
    )


# ------------------------------------------------------------------ client load
@dataclass
class Outcome:
    request_id: str
    sent: float  # time.monotonic()
    ended: float
    status: int
    tokens: int
    error: str = ""  # empty when the answer was complete

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


async def stream_completion(
    http: aiohttp.ClientSession, url: str, request_id: str, max_tokens: int, prompt: str = "hello"
) -> Outcome:
    """One streamed completion; an answer counts only if it ends with [DONE] after exactly
    `max_tokens` tokens and carries no error event. Tokens are counted by the usage the
    stream ends with: a real engine's detokenizer may hold a token back (an incomplete
    UTF-8 character) and send it with the next, so events are not tokens."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}) as r:
            raw = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError) as e:
        return Outcome(request_id, sent, time.monotonic(), 0, 0, f"{type(e).__name__}: {e}")
    ended = time.monotonic()
    if status != 200:
        return Outcome(request_id, sent, ended, status, 0, raw[:200].decode(errors="replace"))
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    if not events or events[-1] != b"[DONE]":
        return Outcome(request_id, sent, ended, status, 0, "stream cut off before [DONE]")
    try:
        chunks = [json.loads(e) for e in events[:-1]]
    except ValueError:
        return Outcome(request_id, sent, ended, status, 0, f"not JSON: {raw[:200]!r}")
    if errors := [c for c in chunks if "error" in c]:
        return Outcome(request_id, sent, ended, status, 0, json.dumps(errors[0])[:200])
    usage = next((c["usage"] for c in chunks if c.get("usage")), None)
    if usage is None:
        return Outcome(request_id, sent, ended, status, 0, "no usage at the end of the stream")
    tokens = usage["completion_tokens"]
    error = "" if tokens == max_tokens else f"{tokens} tokens, want {max_tokens}"
    return Outcome(request_id, sent, ended, status, tokens, error)


class StreamLoad:
    """`concurrency` clients sending streamed completions until stop(), each `pause_s`
    after its last one ended (0: back to back). Request ids carry a sequence number, so
    engines' request records (the simulator's --sim-record) tell which client request
    reached which engine."""

    def __init__(self, url: str, concurrency: int, max_tokens: int, pause_s: float = 0.0):
        self.url = url
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.pause_s = pause_s
        self.outcomes: list[Outcome] = []
        self.sent_at: dict[str, float] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = 0
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> StreamLoad:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _client(self) -> None:
        assert self._http is not None
        while not self._stop.is_set():
            self._seq += 1
            request_id = f"load-{self._seq}"
            self.sent_at[request_id] = time.monotonic()
            self.outcomes.append(await stream_completion(self._http, self.url, request_id, self.max_tokens))
            if self.pause_s:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.pause_s)

    async def stop(self) -> list[Outcome]:
        """Stop sending and wait for the requests in flight."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        if self._http is not None:
            await self._http.close()
            self._http = None
        return self.outcomes

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def sent(self) -> int:
        """The number of the last request started: any request numbered above the value
        read at some point was started after that point."""
        return self._seq

    @staticmethod
    def number(request_id: str) -> int:
        """The sequence number in a request id of this load; 0 for another id."""
        prefix, _, n = request_id.partition("-")
        return int(n) if prefix == "load" and n.isdigit() else 0


def counter(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus exposition's samples of `name` that carry `labels`."""
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
