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
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
import yaml  # noqa: E402
from rich.console import Console  # noqa: E402

from pdcluster import constants as C  # noqa: E402
from pdcluster.api.v1alpha1 import AutoscalingSpec  # noqa: E402
from pdcluster.io.kube import ApiError, Kube, KubeConfig  # noqa: E402
from pdcluster.sim.trace import TraceError  # noqa: E402
from pddemo import workload  # noqa: E402
from pddemo.cluster_setup import (  # noqa: E402
    CHART,
    CLUSTER,
    NAMESPACE,
    OPERATOR_NAMESPACE,
    deploy_example,
    install_operator,
)
from pddemo.observe import Observer  # noqa: E402
from pddemo.replay import Outcomes, replay  # noqa: E402
from pddemo.view import View, make_console, step, summary  # noqa: E402
from pddemo.workload import ENGINES, TRACES, Engine, Phase, Request, parse_phases  # noqa: E402


@dataclass(frozen=True)
class ReplayPlan:
    """What a run replays: the engine, its example PDCluster and the requests."""

    engine: Engine
    doc: dict[str, Any]
    phases: list[Phase]
    requests: list[Request]

    @property
    def spec(self) -> dict[str, Any]:
        return self.doc["spec"]


def plan_replay(args: argparse.Namespace) -> ReplayPlan:
    """Reads the example and builds the workload; raises TraceError, OSError or KeyError."""
    engine = ENGINES[args.engine]
    doc = yaml.safe_load(engine.example.read_text())
    phases = args.phases or parse_phases(engine.phases)
    requests = workload.build(
        engine, phases, args.trace, args.start_minute * 60, doc["spec"]["model"].get("maxModelLen")
    )
    return ReplayPlan(engine, doc, phases, requests)


@dataclass
class Target:
    kubeconfig: str
    prometheus_url: str
    router_url: str | None  # None: the router Service's ClusterIP (reachable from this host)
    namespace: str
    name: str


async def _router_url(kube: Kube, target: Target) -> str:
    if target.router_url is not None:
        return target.router_url
    svc = await kube.get("v1", "Service", f"{target.name}-{C.ROLE_ROUTER}", target.namespace)
    return f"http://{svc['spec']['clusterIP']}:{C.ROUTER_PORT}"


async def replay_while_watching(
    url: str, model: str, run: ReplayPlan, observer: Observer, view: View, cooldown_s: float
) -> Outcomes:
    """Replays while the view follows the cluster; after the replay, watches until the
    cluster is back at its smallest or `cooldown_s` has passed."""
    out = Outcomes()
    replay_task = asyncio.create_task(replay(url, model, run.requests, out, run.engine))
    cooldown_until = None
    while True:
        with contextlib.suppress(ApiError, aiohttp.ClientError, TimeoutError):
            await observer.poll()
        view.update(out, observer, "replaying" if not replay_task.done() else "cooling down")
        if replay_task.done():
            replay_task.result()
            cooldown_until = cooldown_until or time.monotonic() + cooldown_s
            if time.monotonic() >= cooldown_until or observer.settled(run.spec):
                return out
        await asyncio.sleep(1)


async def run_and_watch(
    console: Console, target: Target, args: argparse.Namespace
) -> tuple[Outcomes, Observer, float]:
    run = plan_replay(args)
    auto = AutoscalingSpec.model_validate(run.spec["autoscaling"])
    async with Kube(KubeConfig.from_file(target.kubeconfig)) as kube:
        url = await _router_url(kube, target)
        model = run.spec["model"].get("servedModelName") or run.spec["model"]["name"]
        colocated = run.spec.get("mode") == "colocated"
        observer = Observer(kube, target.prometheus_url, target.namespace, target.name, auto, colocated)
        title = (
            f"PDCluster {target.namespace}/{target.name}: {workload.source(args.trace)} from minute "
            f"{args.start_minute:g}, {workload.describe_phases(run.phases)}: {len(run.requests)} requests via {url}"
        )
        step(console, title)
        started = time.monotonic()
        try:
            with View(console, title, len(run.requests), args.plain) as view:
                out = await replay_while_watching(url, model, run, observer, view, args.cooldown)
        finally:
            await observer.close()
    return out, observer, time.monotonic() - started


def check(args: argparse.Namespace) -> int:
    """Every input of `up`, checked in seconds, so a mistake is not found after the build."""
    problems = []
    for path in (ENGINES[args.engine].example, CHART / "Chart.yaml", CHART / "values.yaml"):
        try:
            list(yaml.safe_load_all(path.read_text()))
        except (OSError, yaml.YAMLError) as e:
            problems.append(f"{path.relative_to(REPO)}: {e}")
    if os.geteuid() != 0:
        problems.append(
            "the local cluster needs root (private mount namespaces, the kubernetes Service on port 443)"
        )
    requests: list[Request] = []
    if not problems:
        try:
            requests = plan_replay(args).requests
        except (TraceError, OSError, KeyError) as e:
            problems.append(str(e))
        if not problems and not requests:
            problems.append("the replay has no requests: check --phases and --start-minute")
    for problem in problems:
        print(f"demo: {problem}", file=sys.stderr)
    if not problems:
        print(f"demo: inputs ok; {len(requests)} requests to replay from {workload.source(args.trace)}")
    return 1 if problems else 0


def _set_up(console: Console, args: argparse.Namespace) -> tuple[Target, dict[str, Any]]:
    """The local cluster, the operator and a Ready PDCluster of the engine's example."""
    from localcluster import cluster

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
    install_operator(state.bin_dir, state.kubeconfig, state.prometheus_url)
    example = ENGINES[args.engine].example
    doc = yaml.safe_load(example.read_text())
    # Real vLLM engines take a minute or two to start on two cores.
    asyncio.run(deploy_example(state.kubeconfig, console, example, doc, ready_timeout_s=900 if vllm else 300))
    target = Target(state.kubeconfig, state.prometheus_url, None, NAMESPACE, doc["metadata"]["name"])
    return target, doc


def _after_the_demo(console: Console, args: argparse.Namespace, name: str, seconds: float) -> None:
    env = f'eval "$(e2e/local/cluster env --name {args.cluster})"'
    console.print(
        f"\nDemo done in {seconds:.0f} s. The cluster stays up:\n"
        f"  {env}\n"
        f"  kubectl get pdc -n {NAMESPACE}\n"
        f"  kubectl describe pdc {name} -n {NAMESPACE}      # conditions and scaling Events\n"
        f"  kubectl get pods -A -o wide\n"
        f"  helm list -n {OPERATOR_NAMESPACE}\n"
        f'  curl -s "$PDCLUSTER_PROMETHEUS_URL/api/v1/query?query=pdcluster_desired_replicas"\n'
        f"  make demo-down                          # stop it"
    )


def up(args: argparse.Namespace) -> int:
    console = make_console()
    started = time.monotonic()
    if check(args):
        return 1
    target, doc = _set_up(console, args)
    console.print(f"    set up in {time.monotonic() - started:.0f} s")
    out, observer, seconds = asyncio.run(run_and_watch(console, target, args))
    summary(console, out, observer, seconds)
    _after_the_demo(console, args, doc["metadata"]["name"], time.monotonic() - started)
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


def _replay_options() -> argparse.ArgumentParser:
    """The options of every command that replays (and of `check`, which checks them)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--trace",
        help="replay a real trace: a file of the traces folder (PDCLUSTER_TRACES) or a path "
        "(default: a generated conversation workload, or Mooncake's conversation trace with PDCLUSTER_TRACES)",
    )
    p.add_argument("--start-minute", type=float, default=0.0, help="where the slice starts in the trace")
    p.add_argument(
        "--phases",
        type=parse_phases,
        help=f"replay phases SECONDS:SPEED[:TRACE[*OUTPUT_SCALE]],... (TRACE: {', '.join(TRACES)}; default: "
        f"{ENGINES['sim'].phases} for the simulator, a mix shift; {ENGINES['vllm'].phases} for vLLM: calm, "
        "surge, calm)",
    )
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="sim",
        help="engine simulators (default) or real vLLM on CPU",
    )
    p.add_argument(
        "--cooldown", type=float, default=30.0, help="after the replay, keep watching this long (seconds)"
    )
    p.add_argument("--plain", action="store_true", help="plain lines even on a terminal")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="demo.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    replay_opts = _replay_options()
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
