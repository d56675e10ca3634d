"""10,000 generated PDCluster specs against the real apiserver and operator.

    .venv/bin/python benchmarks/specs_property.py [--count 10000] [--concurrency 24] [--record]

The property of tests/integration/test_specs_property.py (tests/e2e/specgen.py) at
scale: every spec is either rejected by the apiserver (schema, CEL) with a message naming
a field of the document, or accepted, reconciled (status written for its generation)
and deleted again, with no traceback or ERROR in the operator's log. It starts (or
reuses) the local cluster `specbench`, runs the operator as a process on one namespace,
and prints the counts: accepted and rejected, what rejected them, what the accepted ones
reported (Degraded reasons; apply failures grouped by the field the apiserver named),
throughput, and every spec that broke the property. With --record those are written to
tests/fixtures/crashers/ for the test to replay.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "e2e"), str(REPO / "e2e" / "local")]

from harness import install_crd, rss_mib, start_operator, stop_on_sigterm  # noqa: E402
from specgen import Outcome, check_spec, pdcluster, shape_name  # noqa: E402

from localcluster import load_state  # noqa: E402
from pdcluster import constants as C  # noqa: E402
from pdcluster.io.kube import Kube, KubeConfig  # noqa: E402

CRASHERS = REPO / "tests" / "fixtures" / "crashers"
_FIELD = re.compile(r"((?:spec|metadata)(?:\.[\w/-]+|\[[^\]]*\])+)")


CHUNK = 250  # specs per hypothesis run: one long run slows down as it explores


def generate(count: int, seed_value: int) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []

    @seed(seed_value)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    @given(pdcluster())
    def collect(doc: dict[str, Any]) -> None:
        docs.append(doc)

    collect()
    return docs


def where(message: str) -> str:
    """The first field path an apiserver message names, indices folded."""
    m = _FIELD.search(message)
    return re.sub(r"\[[^\]]*\]", "[]", m.group(1)) if m else message[:80]


async def run(args: argparse.Namespace) -> int:
    subprocess.run(
        [sys.executable, str(REPO / "e2e" / "local" / "cluster"), "--name", args.cluster, "up"], check=True
    )
    state = load_state(args.cluster)
    assert state is not None
    namespace = "specs-property"
    log = Path(state.run_dir) / "specs-property-operator.log"
    async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
        await install_crd(kube)
        if await kube.get("v1", "Namespace", namespace) is None:
            await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        # Whatever an interrupted run left behind.
        await kube.request("DELETE", f"/apis/{C.API_VERSION}/namespaces/{namespace}/{C.PLURAL}")
        # Resync rarely: every reconcile here is caused by a change, as in production.
        op = start_operator(
            state.kubeconfig,
            namespace,
            log,
            f"--prometheus-url={state.prometheus_url}",
            "--resync-seconds=60",
        )
        outcomes: list[Outcome] = []
        broken: list[tuple[dict[str, Any], list[str]]] = []
        operator_failures: list[str] = []
        gate = asyncio.Semaphore(args.concurrency)
        started = time.monotonic()

        async def one(doc: dict[str, Any]) -> None:
            async with gate:
                outcome = await check_spec(kube, namespace, doc)
            outcomes.append(outcome)
            if outcome.problems:
                broken.append((doc, outcome.problems))
                print(f"  broken: {doc['metadata']['name']}: {outcome.problems}", flush=True)
            if len(outcomes) % 500 == 0:
                operator_failures.extend(op.failures())
                rate = len(outcomes) / (time.monotonic() - started)
                print(f"  {len(outcomes)} specs, {rate:.1f}/s, {len(broken)} broken, "
                      f"{len(operator_failures)} operator failures, operator RSS {rss_mib(op.proc.pid):.0f} MiB",
                      flush=True)  # fmt: skip

        try:
            # Generate the next chunk in a thread while this one is checked.
            serial = itertools.count()
            chunks = [min(CHUNK, args.count - i) for i in range(0, args.count, CHUNK)]
            upcoming = asyncio.create_task(asyncio.to_thread(generate, chunks[0], args.seed))
            for i in range(len(chunks)):
                docs = await upcoming
                if i + 1 < len(chunks):
                    upcoming = asyncio.create_task(
                        asyncio.to_thread(generate, chunks[i + 1], args.seed + i + 1)
                    )
                for doc in docs:
                    doc["metadata"]["name"] = shape_name(doc["metadata"]["name"], next(serial))
                await asyncio.gather(*(one(doc) for doc in docs))
        finally:
            operator_failures.extend(op.failures())
            alive = op.proc.poll() is None
            rss = rss_mib(op.proc.pid) if alive else 0.0
            op.kill()
    elapsed = time.monotonic() - started
    report(outcomes, broken, operator_failures, elapsed, rss, alive)
    if args.record and broken:
        CRASHERS.mkdir(parents=True, exist_ok=True)
        for doc, problems in broken:
            path = CRASHERS / f"{doc['metadata']['name'].lower()[:40]}.yaml"
            header = "".join(f"# {p}\n" for p in problems)
            path.write_text(header + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
        print(f"recorded {len(broken)} specs in {CRASHERS.relative_to(REPO)}")
    if operator_failures:
        # `down` removes the run directory: keep the log with the whole tracebacks.
        kept = Path(tempfile.mkdtemp(prefix="specs-property-")) / log.name
        shutil.copy(log, kept)
        print(f"operator log with the tracebacks: {kept}")
    if not args.keep:
        subprocess.run(
            [sys.executable, str(REPO / "e2e" / "local" / "cluster"), "--name", args.cluster, "down"]
        )
    return 1 if broken or operator_failures or not alive else 0


def report(
    outcomes: list[Outcome],
    broken: list[tuple[dict[str, Any], list[str]]],
    operator_failures: list[str],
    elapsed: float,
    rss: float,
    alive: bool,
) -> None:
    accepted = [o for o in outcomes if o.accepted]
    rejected = [o for o in outcomes if not o.accepted]
    print(f"\n{len(outcomes)} specs in {elapsed:.0f} s ({len(outcomes) / elapsed:.1f}/s)")
    print(f"rejected by the apiserver: {len(rejected)}, accepted and reconciled: {len(accepted)}")
    print("\nrejections by the first field named:")
    for field, n in Counter(o.reason for o in rejected).most_common(25):
        print(f"  {n:6d}  {field}")
    print("\naccepted, by Degraded reason:")
    for reason, n in Counter(o.reason for o in accepted).most_common():
        print(f"  {n:6d}  {reason}")
    applies = Counter(where(o.message.partition(": ")[2]) for o in accepted if o.reason == "ApplyFailed")
    if applies:
        print("\napply failures (spec passed the CRD, a child did not), by field:")
        for field, n in applies.most_common(20):
            print(f"  {n:6d}  {field}")
    print(f"\nproperty broken: {len(broken)}")
    for doc, problems in broken[:20]:
        print(f"  {doc['metadata']['name']}: {problems}")
    print(f"operator: {'alive' if alive else 'DEAD'}, RSS {rss:.0f} MiB, "
          f"{len(operator_failures)} traceback/ERROR lines")  # fmt: skip
    for line in operator_failures[:10]:
        print(f"  {line[:300]}")


def main() -> None:
    stop_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=24, help="specs in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster", default="specbench", help="local cluster name")
    p.add_argument("--keep", action="store_true", help="leave the cluster up afterwards")
    p.add_argument("--record", action="store_true", help="write broken specs to tests/fixtures/crashers/")
    sys.exit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
