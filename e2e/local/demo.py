#!/usr/bin/env python3
"""`make demo`: a PD cluster on the local control plane, driven by a real trace.

    up     start the local cluster `demo`, install the operator from the Helm chart,
           apply examples/pdcluster-sim.yaml (`--engine vllm`: examples/pdcluster-vllm-cpu.yaml,
           real vLLM on CPU with a tiny model), replay a slice of a public trace through
           the router and show replicas, latency against the SLO and every scaling
           decision live; the cluster stays up afterwards
    watch  the replay and the live view only, against a cluster set up elsewhere
           (e2e/kind/run.sh uses it through port-forwards)
    down   stop the cluster
    check  check every input (examples, chart, phases, traces) and build the workload,
           before anything is built or started: `make demo` runs it first

Requests are drawn from distributions fitted to public traces (pdcluster.sim.synthetic:
Mooncake's conversation trace and Azure's 2023 conversation trace), so the demo needs
no file beside the repository; `--trace FILE` (or PDCLUSTER_TRACES, the folder of the
public traces) replays a real trace instead. Either way: arrival times (sped up per
phase, --phases, which may switch traces and stretch answers: the default shifts the
mix), prompt lengths, prefix blocks (token ids derived from the 512-token block hashes,
so shared prefixes stay shared) and output lengths (max_tokens with ignore_eos); for the
tiny model of real vLLM, lengths are scaled down to fit its 512-token context. Without a
terminal (CI) the view is plain lines: a status line every 10 s with the latest
decision's one-line summary, and a line for each scaling decision.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
# Like e2e/local/cluster: run under the project's venv when started with another Python.
if (
    __name__ == "__main__"
    and VENV_PYTHON.exists()
    and Path(sys.prefix).resolve() != VENV_PYTHON.parent.parent.resolve()
):
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), str(Path(__file__).resolve()), *sys.argv[1:]])
sys.path.insert(0, str(HERE))

import aiohttp  # noqa: E402
import orjson  # noqa: E402
import yaml  # noqa: E402
from rich.console import Console, Group  # noqa: E402
from rich.live import Live  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from pdcluster import constants as C  # noqa: E402
from pdcluster import observability as O  # noqa: E402
from pdcluster import perf  # noqa: E402
from pdcluster.api.v1alpha1 import Quantile  # noqa: E402
from pdcluster.io.kube import ApiError, Kube, KubeConfig  # noqa: E402
from pdcluster.sim import synthetic  # noqa: E402
from pdcluster.sim.trace import MOONCAKE_BLOCK_TOKENS, Trace, TraceError, load_trace  # noqa: E402

CLUSTER = "demo"
NAMESPACE = "demo"
OPERATOR_NAMESPACE = "pdcluster-system"
RELEASE = "pdcluster-operator"
CHART = REPO / "charts" / "pdcluster-operator"
VOCABULARY = 128_000  # Llama 3's vocabulary size: token ids stay plausible


@dataclass(frozen=True)
class Engine:
    example: Path
    vocabulary: int
    phases: str
    length_divisor: int = 1  # prompt lengths / this, so they fit the model's context
    max_output: int | None = None


ENGINES = {
    # A mix shift: long-context conversations (Mooncake), calm then twice as fast, which
    # want prefill engines; then the Azure conversation trace's short prompts at six times
    # its rate with answers three times as long (as a reasoning model gives), which want
    # decode engines. Within the example's 8 GPUs the autoscaler (10 s interval, 30 s
    # window) moves GPUs from prefill to decode; it is given no latency profile.
    "sim": Engine(REPO / "examples" / "pdcluster-sim.yaml", VOCABULARY, "90:1,150:2,180:6:azure*3"),
    # Real vLLM on two cores: one prefill and one decode engine of a 2048-token vocabulary
    # and a 512-token context, and a two-minute replay (the trace's prompts are 12k
    # tokens on average: divided by 64, they fit with their prefixes still shared).
    "vllm": Engine(
        REPO / "examples" / "pdcluster-vllm-cpu.yaml",
        2048,
        "40:1,40:2,40:1",
        length_divisor=64,
        max_output=32,
    ),
}


# ------------------------------------------------------------------ the workload (pure)


@dataclass(frozen=True)
class Request:
    at_s: float  # seconds after the replay starts
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    salt: int  # makes the tokens past the trace's known blocks private to this request


class Phase(NamedTuple):
    seconds: float  # of wall-clock time
    speed: float  # seconds of trace played per second
    trace: str | None = None  # a name of TRACES; None: --trace
    output_scale: float = 1.0  # the trace's output lengths times this (answers of a reasoning model)


# Traces a phase may name: files of the traces folder when replaying real traces, and
# their generated stand-ins (pdcluster.sim.synthetic) otherwise.
TRACES = {
    "conv": "mooncake_conversation_trace.jsonl",
    "synthetic": "mooncake_synthetic_trace.jsonl",
    "azure": "AzureLLMInferenceTrace_conv_2023.csv",
}
GENERATED = {"conv": synthetic.MOONCAKE_CONVERSATION, "azure": synthetic.AZURE_CONVERSATION}
DEFAULT_TRACE = "conv"


def workload(traces: Trace | dict[str | None, Trace], start_s: float, phases: list[Phase]) -> list[Request]:
    """The traces from `start_s` on, replayed in phases: a phase at speed 3 plays three
    seconds of its trace each second; each trace goes on where its last phase stopped."""
    traces = traces if isinstance(traces, dict) else {None: traces}
    cursors = {key: t.arrival_s[0] + start_s for key, t in traces.items()}  # trace time where a phase starts
    salts = {key: k << 40 for k, key in enumerate(traces)}  # no two traces' requests share filler
    out = []
    wall = 0.0
    for phase in map(lambda p: Phase(*p), phases):
        trace, cursor = traces[phase.trace], cursors[phase.trace]
        end = cursor + phase.seconds * phase.speed
        out += [
            Request(
                wall + (at - cursor) / phase.speed,
                trace.input_tokens[i],
                max(1, round(trace.output_tokens[i] * phase.output_scale)),
                trace.blocks[i],
                salts[phase.trace] + i,
            )
            for i, at in enumerate(trace.arrival_s)
            if cursor <= at < end
        ]
        cursors[phase.trace], wall = end, wall + phase.seconds
    return out


def parse_phases(text: str) -> list[Phase]:
    """'60:1,150:3,180:6:azure*4' -> phases: seconds, speed, and optionally a trace of
    TRACES with its output lengths multiplied."""
    phases = []
    for part in text.split(","):
        seconds, _, rest = part.partition(":")
        speed, _, trace = rest.partition(":")
        trace, _, scale = trace.partition("*")
        try:
            phase = Phase(float(seconds), float(speed or 1), trace or None, float(scale or 1))
        except ValueError:
            phase = None
        if phase is None or phase.seconds <= 0 or phase.speed <= 0 or phase.output_scale <= 0:
            raise argparse.ArgumentTypeError(
                f"phases must be SECONDS:SPEED[:TRACE[*OUTPUT_SCALE]],... with positive numbers, not {text!r}"
            )
        if phase.trace is not None and phase.trace not in TRACES:
            raise argparse.ArgumentTypeError(f"unknown trace {phase.trace!r} in phases (known: {', '.join(TRACES)})")
        phases.append(phase)
    if not phases:
        raise argparse.ArgumentTypeError("no phases")
    return phases


def _block(seed: int, length: int, vocabulary: int) -> list[int]:
    """`length` token ids determined by `seed` (a multiplicative hash, cheap and spread)."""
    return [1 + (seed * 2654435761 + k * 40503) % (vocabulary - 1) for k in range(length)]


def prompt_ids(
    request: Request, block_tokens: int = MOONCAKE_BLOCK_TOKENS, vocabulary: int = VOCABULARY
) -> list[int]:
    """Token ids whose blocks repeat exactly where the trace's block hashes do."""
    ids: list[int] = []
    for h in request.blocks:
        if len(ids) >= request.input_tokens:
            break
        ids += _block(h, min(block_tokens, request.input_tokens - len(ids)), vocabulary)
    if len(ids) < request.input_tokens:
        ids += _block(request.salt + (1 << 48), request.input_tokens - len(ids), vocabulary)
    return ids


def fit(requests: list[Request], engine: Engine, max_model_len: int | None) -> list[Request]:
    """The trace's requests scaled to an engine with a short context: prompt lengths
    divided (the block structure with them) and outputs capped, within the context."""
    if engine.length_divisor == 1 and engine.max_output is None:
        return requests
    out = []
    for r in requests:
        output = min(r.output_tokens, engine.max_output or r.output_tokens)
        room = (max_model_len or 1 << 30) - output
        out.append(
            Request(
                r.at_s, max(1, min(room, r.input_tokens // engine.length_divisor)), output, r.blocks, r.salt
            )
        )
    return out


def load_traces(trace: str | None, phases: list[Phase], start_s: float) -> dict[str | None, Trace]:
    """The traces the phases replay: generated ones unless a real trace is asked for (a
    --trace, or the traces folder in PDCLUSTER_TRACES). Raises TraceError, naming what is
    missing, before anything starts."""
    real = trace is not None or bool(os.environ.get("PDCLUSTER_TRACES"))
    names = {None: trace or DEFAULT_TRACE} | {p.trace: p.trace for p in phases if p.trace}
    if not real:
        unknown = sorted(n for n in names.values() if n not in GENERATED)
        if unknown:
            raise TraceError(f"no generated stand-in for {', '.join(unknown)}: replay the real trace with --trace "
                             f"or PDCLUSTER_TRACES (generated: {', '.join(GENERATED)})")
        # Long enough for the slice: every phase's seconds at its speed, from the start.
        span = start_s + sum(p.seconds * p.speed for p in phases) + 60.0
        return {key: synthetic.generate(GENERATED[name], span, seed=k) for k, (key, name) in enumerate(names.items())}
    try:
        folder = perf.traces_dir()
    except FileNotFoundError:
        folder = None
    traces = {}
    for key, name in names.items():
        file = TRACES.get(name, name)
        path = Path(file) if "/" in file else (folder / file if folder else None)
        if path is None or not path.is_file():
            raise TraceError(f"trace {file!r} not found (set PDCLUSTER_TRACES to the folder of the public traces, "
                             "give --trace a path, or leave both out for the generated workload)")
        traces[key] = load_trace(path)
    return traces


def percentile(values: list[float], q: float) -> float | None:
    """q in [0, 100]; None without values."""
    return perf.percentile(values, q) if values else None


def ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:.0f} ms"


# ---------------------------------------------------------------------- the replay


@dataclass
class Outcomes:
    sent: int = 0
    ok: int = 0
    rejected: int = 0
    failed: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # one mean per request
    last_error: str = ""

    @property
    def done(self) -> int:
        return self.ok + self.rejected + self.failed


async def send(
    session: aiohttp.ClientSession, url: str, model: str, request: Request, out: Outcomes, engine: Engine
) -> None:
    body = {
        "model": model,
        "prompt": prompt_ids(request, MOONCAKE_BLOCK_TOKENS // engine.length_divisor, engine.vocabulary),
        "max_tokens": request.output_tokens,
        "ignore_eos": True,  # the trace's output length, not the simulator's EOS draw
        "stream": True,
    }
    started = time.monotonic()
    stamps: list[float] = []
    try:
        async with session.post(
            f"{url}/v1/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as resp:
            if resp.status == 429:
                out.rejected += 1
                return
            if resp.status != 200:
                out.failed += 1
                out.last_error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    stamps.append(time.monotonic())
    except (aiohttp.ClientError, TimeoutError) as e:
        out.failed += 1
        out.last_error = repr(e)
        return
    if not stamps:
        out.failed += 1
        out.last_error = "stream ended without tokens"
        return
    out.ok += 1
    out.ttft_s.append(stamps[0] - started)
    if len(stamps) > 1:
        out.itl_s.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))


async def replay(url: str, model: str, requests: list[Request], out: Outcomes, engine: Engine) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.monotonic()
        tasks = []
        for request in requests:
            delay = started + request.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            out.sent += 1
            tasks.append(asyncio.create_task(send(session, url, model, request, out, engine)))
        await asyncio.gather(*tasks)


# ------------------------------------------------------------------ what the cluster says


@dataclass
class Snapshot:
    roles: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (desired, ready)
    ready: str = "?"
    ttft_s: float | None = None
    itl_s: float | None = None
    rate: float | None = None
    last_decision: dict[str, Any] | None = None


@dataclass
class Decision:
    at: str
    prefill: str
    decode: str
    reason: str


class Observer:
    """Polls the PDCluster's status and Events and the router's latency in Prometheus."""

    def __init__(
        self, kube: Kube, prometheus_url: str, namespace: str, name: str, quantile: float, window_s: int
    ):
        self.kube, self.prometheus_url, self.namespace, self.name = kube, prometheus_url, namespace, name
        selector = f'{O.PROM_LABEL_CLUSTER}="{name}",namespace="{namespace}"'

        def q(metric: str) -> str:
            return f"histogram_quantile({quantile}, sum by (le) (rate({metric}_bucket{{{selector}}}[{window_s}s])))"

        self.queries = {
            "ttft": q(O.ROUTER_TTFT),
            "itl": q(O.ROUTER_ITL),
            "rate": f"sum(rate({O.ROUTER_REQUESTS}_total{{{selector}}}[{window_s}s]))",
        }
        self.snapshot = Snapshot()
        self.decisions: list[Decision] = []
        self._seen_events: set[str] = set()
        self.uid = ""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))

    async def close(self) -> None:
        await self._http.close()

    async def _prom(self, promql: str) -> float | None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError):
            async with self._http.get(f"{self.prometheus_url}/api/v1/query", params={"query": promql}) as r:
                value = float((await r.json())["data"]["result"][0]["value"][1])
                return None if math.isnan(value) else value
        return None

    async def poll(self) -> Snapshot:
        s = Snapshot()
        obj = await self.kube.get(C.API_VERSION, C.KIND, self.name, self.namespace) or {}
        self.uid = obj.get("metadata", {}).get("uid", "")
        status = obj.get("status") or {}
        for role in C.ENGINE_ROLES:
            r = status.get(role) or {}
            s.roles[role] = (r.get("desired", 0), r.get("ready", 0))
        ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
        s.ready = ready["status"] if ready else "?"
        s.last_decision = (status.get("autoscaling") or {}).get("lastDecision")
        s.ttft_s, s.itl_s, s.rate = [await self._prom(q) for q in self.queries.values()]
        await self._events()
        self.snapshot = s
        return s

    async def _events(self) -> None:
        if not self.uid:
            return
        # Only this PDCluster's: one of the same name from an earlier run has another uid.
        answer = await self.kube.request(
            "GET",
            f"/api/v1/namespaces/{self.namespace}/events",
            params={"fieldSelector": f"involvedObject.uid={self.uid}"},
        )
        events = sorted(
            answer.get("items", []), key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or ""
        )
        for e in events:
            uid = e["metadata"]["uid"]
            if uid in self._seen_events:
                continue
            self._seen_events.add(uid)
            if e.get("reason") in ("Scaled", "Recommended"):
                stamp = (e.get("lastTimestamp") or e.get("eventTime") or "")[11:19]
                self.decisions.append(Decision(stamp, *_split_decision(e.get("message", ""))))


def _split_decision(message: str) -> tuple[str, str, str]:
    """'prefill 2 -> 3, decode 4 -> 3: <why>' (the operator's Scaled event) -> the new
    counts and why; a role the message does not name kept its count ("=")."""
    head, _, why = message.partition(": ")
    counts = {}
    for part in head.split(","):
        role, _, change = part.strip().partition(" ")
        counts[role] = change.rpartition("->")[2].strip() or "?"
    return counts.get("prefill", "="), counts.get("decode", "="), why or message


# ------------------------------------------------------------------------------ view


class View:
    """A rich live view on a terminal; plain periodic lines otherwise (CI logs)."""

    def __init__(self, console: Console, title: str, slo: dict[str, Any], total: int, plain: bool):
        self.console, self.title, self.slo, self.total = console, title, slo, total
        self.plain = plain or not console.is_terminal
        self.started = time.monotonic()
        self._last_line = 0.0
        self._printed_decisions = 0
        self.progress = Progress(
            TextColumn("replay"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("sent {task.fields[sent]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task("replay", total=total, sent=0)
        self.live = None if self.plain else Live(console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> View:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def _elapsed(self) -> str:
        return f"[{time.monotonic() - self.started:5.0f}s]"

    def update(self, out: Outcomes, observer: Observer, phase: str) -> None:
        s = observer.snapshot
        self.progress.update(self.task, completed=out.done, sent=out.sent)
        if self.live:
            self.live.update(self._render(out, observer, phase))
            return
        for d in observer.decisions[self._printed_decisions :]:
            self.console.print(
                f"{self._elapsed()} decision at {d.at}: prefill {d.prefill}, decode {d.decode}: {d.reason}"
            )
        self._printed_decisions = len(observer.decisions)
        if time.monotonic() - self._last_line >= 10:
            self._last_line = time.monotonic()
            roles = "  ".join(
                f"{r} {s.roles.get(r, (0, 0))[1]}/{s.roles.get(r, (0, 0))[0]}" for r in C.ENGINE_ROLES
            )
            self.console.print(
                f"{self._elapsed()} {phase}: sent {out.sent}/{self.total} ok {out.ok} rejected {out.rejected} "
                f"failed {out.failed} | ready/desired {roles} | TTFT {self.slo['quantile']} {ms(s.ttft_s)} "
                f"(SLO {self.slo['ttftMs']} ms) ITL {self.slo['quantile']} {ms(s.itl_s)} (SLO {self.slo['itlMs']} ms)"
            )
            if s.last_decision:
                self.console.print(
                    f"{' ' * 9}last decision ({s.last_decision['action']}): {s.last_decision.get('summary') or s.last_decision['reason']}"
                )

    def _render(self, out: Outcomes, observer: Observer, phase: str) -> Group:
        s = observer.snapshot
        q = self.slo["quantile"]
        replicas = Table(title="replicas", expand=True)
        for column in ("role", "desired", "ready"):
            replicas.add_column(column, justify="right" if column != "role" else "left")
        for role in C.ENGINE_ROLES:
            desired, ready = s.roles.get(role, (0, 0))
            replicas.add_row(role, str(desired), f"[{'green' if ready == desired else 'yellow'}]{ready}")

        def against(value: float | None, slo_ms: float) -> str:
            if value is None:
                return "-"
            return f"[{'green' if value * 1000 <= slo_ms else 'red'}]{ms(value)}[/] (SLO {slo_ms:.0f} ms)"

        latency = Table(title=f"router {q}, Prometheus", expand=True)
        latency.add_column("metric")
        latency.add_column("value", justify="right")
        latency.add_row("TTFT", against(s.ttft_s, self.slo["ttftMs"]))
        latency.add_row("ITL", against(s.itl_s, self.slo["itlMs"]))
        latency.add_row("requests/s", "-" if s.rate is None else f"{s.rate:.1f}")
        latency.add_row("ok / rejected / failed", f"{out.ok} / {out.rejected} / {out.failed}")
        top = Table.grid(expand=True)
        top.add_column()
        top.add_column()
        top.add_row(replicas, latency)

        decisions = Table(title="scaling decisions (Events)", expand=True)
        for column in ("time", "prefill", "decode", "why"):
            decisions.add_column(column, overflow="fold")
        for d in observer.decisions[-8:]:
            decisions.add_row(d.at, d.prefill, d.decode, d.reason)
        last = s.last_decision or {}
        footer = (
            f"last decision ({last.get('action', '-')}): {last.get('summary') or last.get('reason', 'none yet')}"
            if last
            else "last decision: none yet (the autoscaler waits for a window of metrics)"
        )
        return Group(
            f"[bold]{self.title}[/]  ({phase}, Ready={s.ready})", self.progress, top, decisions, footer
        )


# ------------------------------------------------------------------------ the cluster


def step(console: Console, message: str) -> None:
    console.print(f"[bold cyan]==>[/] {message}")


def helm(bin_dir: str, kubeconfig: str, *args: str) -> None:
    subprocess.run(
        [f"{bin_dir}/helm", f"--kubeconfig={kubeconfig}", *args], check=True, stdout=subprocess.DEVNULL
    )


async def wait_ready(kube: Kube, console: Console, namespace: str, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        obj = await kube.get(C.API_VERSION, C.KIND, name, namespace) or {}
        status = obj.get("status") or {}
        ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
        if ready and ready["status"] == "True":
            console.print(f"    Ready: {ready['message']}")
            return
        line = ready["message"] if ready else "waiting for the operator"
        if line != last:
            console.print(f"    {line}")
            last = line
        await asyncio.sleep(1)
    raise SystemExit(
        f"PDCluster {namespace}/{name} not Ready after {timeout:.0f}s; see `kubectl describe pdc {name} -n {namespace}`"
    )


async def fresh_pdcluster(kube: Kube, console: Console, doc: dict[str, Any]) -> None:
    """Applies the example; one left by an earlier run is replaced, so each run starts at 1:1."""
    name = doc["metadata"]["name"]
    if await kube.get("v1", "Namespace", NAMESPACE) is None:
        await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    if await kube.get(C.API_VERSION, C.KIND, name, NAMESPACE) is not None:
        step(console, f"replacing the PDCluster {NAMESPACE}/{name} of an earlier run")
        await kube.delete(C.API_VERSION, C.KIND, name, NAMESPACE)
        selector = f"{C.LABEL_CLUSTER}={name}"
        while await kube.get(C.API_VERSION, C.KIND, name, NAMESPACE) or await kube.list(
            "v1", "Pod", NAMESPACE, label_selector=selector
        ):
            await asyncio.sleep(0.5)
    # The default ServiceAccount must exist before any pod can be created.
    while await kube.get("v1", "ServiceAccount", "default", NAMESPACE) is None:
        await asyncio.sleep(0.2)
    await kube.apply(
        {**doc, "metadata": {**doc["metadata"], "namespace": NAMESPACE}}, field_manager="pdcluster-demo"
    )


async def crd_established(kube: Kube) -> None:
    for _ in range(100):
        crd = await kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", C.CRD_NAME) or {}
        if any(
            c["type"] == "Established" and c["status"] == "True"
            for c in (crd.get("status") or {}).get("conditions", [])
        ):
            return
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------------------- the run


@dataclass
class Target:
    kubeconfig: str
    prometheus_url: str
    router_url: str | None  # None: the router Service's ClusterIP (reachable from this host)
    namespace: str
    name: str


async def run_and_watch(
    console: Console, target: Target, args: argparse.Namespace
) -> tuple[Outcomes, Observer, float]:
    engine = ENGINES[args.engine]
    doc = yaml.safe_load(engine.example.read_text())
    spec = doc["spec"]
    phases = args.phases or parse_phases(engine.phases)
    requests = build_workload(args)
    slo = {"quantile": "p90", "ttftMs": 2000, "itlMs": 25, **spec["autoscaling"].get("slo", {})}
    window_s = int(spec["autoscaling"].get("windowSeconds", 30))
    out = Outcomes()
    async with Kube(KubeConfig.from_file(target.kubeconfig)) as kube:
        url = target.router_url
        if url is None:
            svc = await kube.get("v1", "Service", f"{target.name}-{C.ROLE_ROUTER}", target.namespace)
            url = f"http://{svc['spec']['clusterIP']}:{C.ROUTER_PORT}"
        model = spec["model"].get("servedModelName") or spec["model"]["name"]
        observer = Observer(
            kube,
            target.prometheus_url,
            target.namespace,
            target.name,
            Quantile(slo["quantile"]).fraction,
            window_s,
        )
        described = ", ".join(
            f"{p.seconds:g} s at {p.speed:g}x"
            + (f" of {p.trace}" if p.trace else "")
            + (f" (answers x{p.output_scale:g})" if p.output_scale != 1 else "")
            for p in phases
        )
        title = (
            f"PDCluster {target.namespace}/{target.name}: {workload_source(args)} from minute {args.start_minute:g}, "
            f"{described}: {len(requests)} requests via {url}"
        )
        step(console, title)
        started = time.monotonic()
        try:
            with View(console, title, slo, len(requests), args.plain) as view:
                replay_task = asyncio.create_task(replay(url, model, requests, out, engine))
                cooldown_until = None
                while True:
                    with contextlib.suppress(ApiError, aiohttp.ClientError, TimeoutError):
                        await observer.poll()
                    phase = "replaying" if not replay_task.done() else "cooling down"
                    view.update(out, observer, phase)
                    if replay_task.done():
                        replay_task.result()
                        cooldown_until = cooldown_until or time.monotonic() + args.cooldown
                        if time.monotonic() >= cooldown_until or _settled(observer, spec):
                            break
                    await asyncio.sleep(1)
        finally:
            await observer.close()
    return out, observer, time.monotonic() - started


def _settled(observer: Observer, spec: dict[str, Any]) -> bool:
    """Scaled and back to the smallest cluster after the load: nothing more to show."""
    at_minimum = all(
        observer.snapshot.roles.get(role, (0, 0)) == (spec[role].get("minReplicas", 1),) * 2
        for role in C.ENGINE_ROLES
    )
    return at_minimum and bool(observer.decisions)


def summary(console: Console, out: Outcomes, observer: Observer, seconds: float) -> None:
    table = Table(title="summary", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    table.add_row(
        "requests sent / ok / rejected (429) / failed",
        f"{out.sent} / {out.ok} / {out.rejected} / {out.failed}",
    )
    for label, values in (("TTFT (client)", out.ttft_s), ("ITL (client, mean per request)", out.itl_s)):
        table.add_row(label, "  ".join(f"p{q}: {ms(percentile(values, q))}" for q in (50, 90, 99)))
    table.add_row("scaling decisions", str(len(observer.decisions)))
    final = observer.snapshot.roles
    table.add_row(
        "replicas now (ready/desired)",
        ", ".join(f"{r} {final.get(r, (0, 0))[1]}/{final.get(r, (0, 0))[0]}" for r in C.ENGINE_ROLES),
    )
    table.add_row("replay and watch", f"{seconds:.0f} s")
    console.print(table)
    for d in observer.decisions:
        console.print(f"  {d.at}  prefill {d.prefill}, decode {d.decode}: {d.reason}")
    if out.last_error:
        console.print(f"  last error: {out.last_error}")


def make_console() -> Console:
    """Logs without a terminal get long lines rather than rich's 80 columns, each written
    at once (a pipe is block-buffered)."""
    if sys.stdout.isatty():
        return Console()
    sys.stdout.reconfigure(line_buffering=True)
    return Console(width=200)


def build_workload(args: argparse.Namespace) -> list[Request]:
    engine = ENGINES[args.engine]
    spec = yaml.safe_load(engine.example.read_text())["spec"]
    phases = args.phases or parse_phases(engine.phases)
    traces = load_traces(args.trace, phases, args.start_minute * 60)
    return fit(workload(traces, args.start_minute * 60, phases), engine, spec["model"].get("maxModelLen"))


def workload_source(args: argparse.Namespace) -> str:
    if args.trace:
        return Path(args.trace).name
    if os.environ.get("PDCLUSTER_TRACES"):
        return f"{TRACES[DEFAULT_TRACE]} (PDCLUSTER_TRACES)"
    return "a generated conversation workload"


def check(args: argparse.Namespace) -> int:
    """Every input of `up`, checked in seconds, so a mistake is not found after the build."""
    problems = []
    for path in (ENGINES[args.engine].example, CHART / "Chart.yaml", CHART / "values.yaml"):
        try:
            list(yaml.safe_load_all(path.read_text()))
        except (OSError, yaml.YAMLError) as e:
            problems.append(f"{path.relative_to(REPO)}: {e}")
    if os.geteuid() != 0:
        problems.append("the local cluster needs root (private mount namespaces, the kubernetes Service on port 443)")
    requests: list[Request] = []
    if not problems:
        try:
            requests = build_workload(args)
        except (TraceError, OSError, KeyError) as e:
            problems.append(str(e))
        if not problems and not requests:
            problems.append("the replay has no requests: check --phases and --start-minute")
    for problem in problems:
        print(f"demo: {problem}", file=sys.stderr)
    if not problems:
        print(f"demo: inputs ok; {len(requests)} requests to replay from {workload_source(args)}")
    return 1 if problems else 0


def up(args: argparse.Namespace) -> int:
    from localcluster import cluster

    console = make_console()
    started = time.monotonic()
    if check(args):
        return 1
    vllm = args.engine == "vllm"
    if vllm:
        step(console, "real-vLLM runtime (e2e/local/vllm/build.sh: minutes the first time)")
        subprocess.run([str(HERE / "vllm" / "build.sh")], check=True, stdout=subprocess.DEVNULL)
    flag = " --vllm" if vllm else ""
    step(console, f"local cluster {args.cluster!r} (e2e/local/cluster up --name {args.cluster}{flag})")
    state = cluster.up(args.cluster, vllm=vllm)
    step(
        console, f"operator from the Helm chart into {OPERATOR_NAMESPACE} (Prometheus {state.prometheus_url})"
    )
    helm(
        state.bin_dir,
        state.kubeconfig,
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--wait",
        "--timeout=180s",
        "--set",
        f"prometheusUrl={state.prometheus_url}",
    )
    example = ENGINES[args.engine].example
    doc = yaml.safe_load(example.read_text())

    async def prepare() -> None:
        async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
            await crd_established(kube)
            step(console, f"PDCluster from {example.relative_to(REPO)} into namespace {NAMESPACE}")
            await fresh_pdcluster(kube, console, doc)
            # Real vLLM engines take a minute or two to start on two cores.
            await wait_ready(kube, console, NAMESPACE, doc["metadata"]["name"], timeout=900 if vllm else 300)

    asyncio.run(prepare())
    console.print(f"    set up in {time.monotonic() - started:.0f} s")
    target = Target(state.kubeconfig, state.prometheus_url, None, NAMESPACE, doc["metadata"]["name"])
    out, observer, seconds = asyncio.run(run_and_watch(console, target, args))
    summary(console, out, observer, seconds)
    env = f'eval "$(e2e/local/cluster env --name {args.cluster})"'
    console.print(
        f"\nDemo done in {time.monotonic() - started:.0f} s. The cluster stays up:\n"
        f"  {env}\n"
        f"  kubectl get pdc -n {NAMESPACE}\n"
        f"  kubectl describe pdc {doc['metadata']['name']} -n {NAMESPACE}      # conditions and scaling Events\n"
        f"  kubectl get pods -A -o wide\n"
        f"  helm list -n {OPERATOR_NAMESPACE}\n"
        f'  curl -s "$PDCLUSTER_PROMETHEUS_URL/api/v1/query?query=pdcluster_desired_replicas"\n'
        f"  make demo-down                          # stop it"
    )
    return 0 if out.ok else 1


def watch(args: argparse.Namespace) -> int:
    console = make_console()
    name = args.pdcluster or yaml.safe_load(ENGINES[args.engine].example.read_text())["metadata"]["name"]
    target = Target(args.kubeconfig, args.prometheus_url, args.router_url, args.namespace, name)
    out, observer, seconds = asyncio.run(run_and_watch(console, target, args))
    summary(console, out, observer, seconds)
    return 0 if out.ok else 1


def down(args: argparse.Namespace) -> int:
    from localcluster import cluster

    if not cluster.down(args.cluster):
        print(f"cluster {args.cluster!r} was not up", file=sys.stderr)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="demo.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    replay_opts = argparse.ArgumentParser(add_help=False)
    replay_opts.add_argument(
        "--trace",
        help="replay a real trace: a file of the traces folder (PDCLUSTER_TRACES) or a path "
        "(default: a generated conversation workload, or Mooncake's conversation trace with PDCLUSTER_TRACES)",
    )
    replay_opts.add_argument(
        "--start-minute", type=float, default=0.0, help="where the slice starts in the trace"
    )
    replay_opts.add_argument(
        "--phases",
        type=parse_phases,
        help=f"replay phases SECONDS:SPEED[:TRACE[*OUTPUT_SCALE]],... (TRACE: {', '.join(TRACES)}; default: "
        f"{ENGINES['sim'].phases} for the simulator, a mix shift; {ENGINES['vllm'].phases} for vLLM: calm, "
        "surge, calm)",
    )
    replay_opts.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="sim",
        help="engine simulators (default) or real vLLM on CPU",
    )
    replay_opts.add_argument(
        "--cooldown", type=float, default=30.0, help="after the replay, keep watching this long (seconds)"
    )
    replay_opts.add_argument("--plain", action="store_true", help="plain lines even on a terminal")
    sub = p.add_subparsers(dest="command")
    for name in ("up", "down"):
        s = sub.add_parser(name, parents=[replay_opts] if name == "up" else [])
        s.add_argument("--cluster", default=CLUSTER, help="local cluster name (default: %(default)s)")
    sub.add_parser("check", parents=[replay_opts])
    w = sub.add_parser("watch", parents=[replay_opts])
    w.add_argument("--kubeconfig", required=True)
    w.add_argument("--prometheus-url", required=True)
    w.add_argument("--router-url", required=True, help="the router, e.g. through kubectl port-forward")
    w.add_argument("--namespace", default=NAMESPACE)
    w.add_argument("--pdcluster", help="PDCluster name (default: the engine's example's)")
    args = p.parse_args(argv)
    if args.command is None:
        args = p.parse_args(["up", *(argv if argv is not None else sys.argv[1:])])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return {"up": up, "watch": watch, "down": down, "check": check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
