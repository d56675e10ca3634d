"""Chaos under load: every fault at once, on a seeded schedule, for --minutes (default 20)
on the local cluster; tests/e2e/test_chaos.py is the two-minute version in `make test`.

    .venv/bin/python benchmarks/chaos.py [--minutes 20] [--seed 31] [--repeat-every 30] [--cluster chaos]

A PDCluster of engine simulators (two of each role, two routers, KV through the Mooncake
master, the autoscaler in auto mode) under six streaming and two non-streaming clients
through the router's Service. Each kind of fault lands once in the first 70% of the run
(so they overlap), then a random kind about every --repeat-every seconds until 85%:
SIGKILL and delete of prefill and decode pods, a router pod deleted, the operator
SIGKILLed (back after 2-8 s), the Mooncake master SIGKILLed, Prometheus stopped for a
minute, the apiserver restarted. Printed: requests sent, whole, lost (and why),
duplicated, tokens lost, those answered 503 while a role had no engine at all; each
fault with the seconds until the PDCluster converged after it; the operator's
tracebacks and ERROR lines; whether the cluster ends as its spec renders. Exit status 1
if a request was lost or duplicated, the operator logged a traceback, or the cluster
did not converge.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "e2e"), str(REPO / "e2e" / "local")]

from chaosfaults import run_chaos  # noqa: E402
from harness import install_crd, stop_on_sigterm, wait_until  # noqa: E402

from localcluster import load_state  # noqa: E402
from pdcluster.io.kube import Kube, KubeConfig  # noqa: E402

NAMESPACE = "chaos"
NAME = "chaos"


async def run(args: argparse.Namespace) -> int:
    cluster = [sys.executable, str(REPO / "e2e" / "local" / "cluster"), "--name", args.cluster]
    subprocess.run([*cluster, "up"], check=True)
    state = load_state(args.cluster)
    assert state is not None
    try:
        async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
            await install_crd(kube)
            if await kube.get("v1", "Namespace", NAMESPACE) is None:
                await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
            await wait_until(lambda: kube.get("v1", "ServiceAccount", "default", NAMESPACE), timeout=30)
            log = Path(state.run_dir) / "chaos-operator.log"
            result = await run_chaos(
                kube, state, NAMESPACE, NAME, log,
                seed=args.seed, duration=args.minutes * 60, repeat_every=args.repeat_every,
            )  # fmt: skip
            await kube.delete("v1", "Namespace", NAMESPACE)
    finally:
        if not args.keep:
            subprocess.run([*cluster, "down"])
    print(*result.lines(), sep="\n")
    if args.json:
        figures = asdict(result.verdicts) | {
            "faults": [
                {
                    "at": i.fault.at,
                    "kind": i.fault.kind,
                    "target": i.target,
                    "converged_after": i.converged_after,
                }
                for i in result.injected
            ],
            "tracebacks": len(result.tracebacks),
            "error_lines": len(result.errors),
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))
    v = result.verdicts
    return 1 if v.lost or v.duplicated or result.tracebacks or result.final_problems else 0


def main() -> None:
    stop_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20)
    p.add_argument("--seed", type=int, default=31)
    p.add_argument("--repeat-every", type=float, default=30.0, help="seconds between the later random faults")
    p.add_argument("--cluster", default="chaos", help="local cluster name")
    p.add_argument("--keep", action="store_true", help="leave the cluster up afterwards")
    p.add_argument("--json", help="also write the figures here")
    sys.exit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
