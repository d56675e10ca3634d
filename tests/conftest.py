"""Shared fixtures. The cluster fixtures start (or reuse) the local control plane
(e2e/local/cluster); pure unit tests never request them, so they start nothing. The
operator fixtures (`crd`, `operator`, `pdc`, `sim_cluster`) run the real operator as a
process; their plain helpers are in tests/e2e/harness.py, shared with the benchmarks.

  PDCLUSTER_TEST_CLUSTER   cluster name used by the tests (default: pdtest)
  PDCLUSTER_KEEP_CLUSTER=1 leave the cluster up after the session (the next one reuses it)

Tests marked `vllm` run real vLLM engines on a second cluster, `<name>-vllm`, whose pod
runner runs vLLM's image on the real-vLLM runtime (e2e/local/vllm); the first cluster
keeps vLLM pods Pending, as the tests of GPU-only examples expect.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "e2e" / "local"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from harness import OperatorProcess, install_crd, make_sim_cluster, start_operator, wait_until  # noqa: E402

from localcluster import State, load_state  # noqa: E402
from localcluster.kubeconfig import for_service_account  # noqa: E402
from localcluster.ports import free_port  # noqa: E402
from pdcluster import constants as C  # noqa: E402
from pdcluster.io.kube import Kube, KubeConfig  # noqa: E402

CLUSTER_NAME = os.environ.get("PDCLUSTER_TEST_CLUSTER", "pdtest")
_timings: list[tuple[str, str, float]] = []


def _cluster(*args: str, name: str = CLUSTER_NAME) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "e2e" / "local" / "cluster"), "--name", name, *args], check=True
    )


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[State]:
    """The local control plane, started once per session (or reused if it is already up)."""
    started = time.monotonic()
    _cluster("up")
    _timings.append(("session", "cluster up", time.monotonic() - started))
    state = load_state(CLUSTER_NAME)
    assert state is not None
    yield state
    if os.environ.get("PDCLUSTER_KEEP_CLUSTER") != "1":
        _cluster("down")


@pytest.fixture(scope="session")
def vllm_runtime() -> Path:
    """The real-vLLM runtime, built if missing. A build that fails is the test's failure,
    never a skip: it says why."""
    out = subprocess.run([str(REPO / "e2e" / "local" / "vllm" / "build.sh")], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"the real-vLLM runtime could not be built:\n{out.stderr[-4000:]}", pytrace=False)
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def vllm_cluster(vllm_runtime: Path) -> Iterator[State]:
    """A local cluster whose pod runner runs vLLM's image on the real-vLLM runtime."""
    name = f"{CLUSTER_NAME}-vllm"
    started = time.monotonic()
    _cluster("up", "--vllm", "--gpu-nodes", "2", "--cpu-nodes", "1", name=name)
    _timings.append(("session", "vLLM cluster up", time.monotonic() - started))
    state = load_state(name)
    assert state is not None
    yield state
    if os.environ.get("PDCLUSTER_KEEP_CLUSTER") != "1":
        _cluster("down", name=name)


@pytest.fixture(scope="session")
def prometheus_url(local_cluster: State) -> str:
    return local_cluster.prometheus_url


@pytest.fixture
async def kube(local_cluster: State) -> AsyncIterator[Kube]:
    """An async client with the admin kubeconfig (system:masters)."""
    async with Kube(KubeConfig.from_file(local_cluster.kubeconfig)) as client:
        yield client


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Awaitable[Any]]:
    return wait_until


@pytest.fixture
async def namespace(kube: Kube, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A fresh namespace for one test, deleted afterwards. Teardown waits until its pods are
    gone, so the next test finds the nodes' GPUs free again."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"{slug}-{uuid.uuid4().hex[:5]}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    # Pods are refused until the service account controller has made "default".
    await wait_until(
        lambda: kube.get("v1", "ServiceAccount", "default", name),
        timeout=30,
        message=f"default ServiceAccount in {name}",
    )
    yield name
    # Deleting the namespace first stops controllers from re-creating pods (the apiserver
    # refuses new objects in a terminating namespace); deleting the pods ourselves saves
    # the namespace controller's fixed 5 s delay before it starts.
    await kube.delete("v1", "Namespace", name)
    await kube.request("DELETE", f"/api/v1/namespaces/{name}/pods")

    async def pods_gone() -> bool:
        return not await kube.list("v1", "Pod", name)

    await wait_until(pods_gone, timeout=120, interval=0.5, message=f"pods of namespace {name} deleted")


@pytest.fixture
def service_account_kubeconfig(kube: Kube, tmp_path: Path) -> Callable[[str, str], Awaitable[Path]]:
    """`await service_account_kubeconfig(namespace, name)`: a kubeconfig that authenticates
    as that ServiceAccount (a TokenRequest token), to run a component with its own RBAC."""

    async def mint(namespace: str, name: str) -> Path:
        return await for_service_account(kube, tmp_path / f"{namespace}-{name}.kubeconfig", namespace, name)

    return mint


@pytest.fixture
def pod_log(local_cluster: State) -> Callable[[str, str, str], str]:
    """`pod_log(namespace, pod, container)`: what the container has written so far."""

    def read(namespace: str, pod: str, container: str) -> str:
        path = Path(local_cluster.run_dir) / "pods" / f"{namespace}_{pod}" / f"{container}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    return read


@pytest.fixture(name="sim_cluster")
def sim_cluster_fixture() -> Any:
    """`sim_cluster(name, **spec_sections)`: the demo PDCluster (engine simulators) with
    autoscaling off, a new name and some spec sections replaced."""
    return make_sim_cluster


@pytest.fixture(scope="session")
async def crd(local_cluster: State) -> None:
    async with Kube(KubeConfig.from_file(local_cluster.kubeconfig)) as kube:
        await install_crd(kube)


@pytest.fixture
def operator(local_cluster: State, crd: None, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator as a real process, scoped to this test's namespace, with its /metrics
    on a port of its own (`op.reconciles()`)."""
    metrics_port = free_port()
    op = start_operator(
        local_cluster.kubeconfig,
        namespace,
        tmp_path / "operator.log",
        f"--prometheus-url={local_cluster.prometheus_url}",
        f"--metrics-port={metrics_port}",
    )
    op.metrics_port = metrics_port
    yield op
    op.kill(signal.SIGTERM)
    if "Traceback" in op.log():
        print(op.log()[-5000:])


@pytest.fixture
async def pdc(kube: Kube, namespace: str) -> AsyncIterator[Any]:
    """Helpers for PDClusters in the test namespace."""

    class PDC:
        async def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
            doc = {"apiVersion": C.API_VERSION, "kind": C.KIND, **doc}
            doc["metadata"] = {**doc["metadata"], "namespace": namespace}
            return await kube.apply(doc, field_manager="kubectl-test")

        async def get(self, name: str) -> dict[str, Any] | None:
            return await kube.get(C.API_VERSION, C.KIND, name, namespace)

        async def condition(self, name: str, type_: str) -> dict[str, Any] | None:
            obj = await self.get(name)
            for c in (obj or {}).get("status", {}).get("conditions", []):
                if c["type"] == type_:
                    return c
            return None

        async def is_true(self, name: str, type_: str) -> bool:
            c = await self.condition(name, type_)
            return bool(c and c["status"] == "True")

    yield PDC()


@pytest.fixture
def stopwatch(request: pytest.FixtureRequest) -> Callable[[str], Any]:
    """`with stopwatch("what"):` records how long a part of a test took; the figures are
    printed at the end of the session."""

    @contextmanager
    def measure(what: str) -> Iterator[None]:
        started = time.monotonic()
        yield
        _timings.append((request.node.name, what, time.monotonic() - started))

    return measure


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _timings:
        terminalreporter.section("local cluster timings")
        for test, what, seconds in _timings:
            terminalreporter.write_line(f"{seconds:7.2f}s  {test}: {what}")
