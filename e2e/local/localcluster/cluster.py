"""Start, reuse, inspect and stop a local cluster: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok, the LeaderWorkerSet controller, the pod
runner and Prometheus, all as plain processes on 127.0.0.1 with their state under one run directory."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from localcluster import kubeconfig, nodes, paths, pki, procs, prometheus
from localcluster.ports import free_port
from pdcluster.io.kube import ApiError, Kube, KubeConfig

SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
# Stopped in this order: the pod runner first, so pods get their SIGTERM while the API is up.
COMPONENTS = ("podrunner", "prometheus", "lws-controller", "kwok", "kube-scheduler", "kube-controller-manager",
              "kube-apiserver", "etcd")
Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class State:
    """state.json: everything a client or `down` needs to know about a running cluster."""

    name: str
    run_dir: str
    bin_dir: str
    server: str
    kubeconfig: str
    prometheus_url: str
    ports: dict[str, int]
    procs: dict[str, list[int]] = field(default_factory=dict)
    nodes: dict[str, Any] = field(default_factory=dict)
    slot: int = 0  # address slot: which loopback ranges this cluster uses (nodes.py)
    started_at: float = 0.0
    # Components taken down by stop_component: their argv and environment, to start them again.
    stopped: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / "state.json"

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(self.path)

    def proc(self, component: str) -> procs.Proc | None:
        value = self.procs.get(component)
        return procs.Proc.from_json(value) if value else None

    @property
    def pki(self) -> pki.Pki:
        return pki.Pki(Path(self.run_dir) / "pki")


def load_state(name: str) -> State | None:
    path = paths.run_dir(name) / "state.json"
    try:
        return State(**json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    """One `up`/`down` at a time per cluster name (parallel test sessions share one)."""
    lock_path = paths.run_dir(name).parent / f".{name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _tls(p: pki.Pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(p.ca_cert))
    ctx.load_cert_chain(str(p.admin_cert), str(p.admin_key))
    return ctx


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _wait(what: str, check: Callable[[], bool], *, timeout: float, proc: procs.Proc | None = None,
          log_file: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and not procs.alive(proc):
            raise RuntimeError(f"{what}: the process exited; last lines of {log_file}:\n{_log_tail(log_file or Path())}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout:.0f}s; see {log_file}")
        time.sleep(0.1)


def bind_shim() -> Path:
    """The LD_PRELOAD bind shim, compiled once per source version into the cache."""
    source = Path(__file__).with_name("bindshim.c")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    target = paths.cache_dir() / f"bindshim-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(tmp), str(source), "-ldl"], check=True)
        tmp.replace(target)
    return target


def healthy(state: State) -> bool:
    return all(
        (p := state.proc(c)) is not None and procs.alive(p) for c in COMPONENTS
    ) and _http_ok(f"{state.server}/readyz", _tls(state.pki))


def _free_slot() -> int:
    """The lowest address slot no other running cluster holds."""
    taken = set()
    for path in paths.run_dir("_").parent.glob("*/state.json"):
        try:
            taken.add(json.loads(path.read_text()).get("slot", 0))
        except (OSError, ValueError):
            continue
    for slot in range(nodes.MAX_SLOTS):
        if slot not in taken:
            return slot
    raise RuntimeError(f"{nodes.MAX_SLOTS} local clusters are already running; stop one first")


def up(name: str, pool: nodes.NodePool | None = None, *, scrape_interval: str = "2s", vllm: bool = False,
       log: Log = _stderr) -> State:
    """Starts the cluster, or reuses it when it is already up and healthy. With `vllm`, the
    pod runner runs pods of vLLM's image on the real-vLLM runtime (podrunner/vllm.py);
    without, they wait with ImageNotRunnableLocally, as anything else it cannot run."""
    pool = pool or nodes.NodePool()
    if os.geteuid() != 0:
        raise PermissionError("the local cluster runs as root: pods get private mount namespaces "
                              "and the kubernetes Service listens on port 443")
    with _lock(name):
        state = load_state(name)
        if state is not None and healthy(state):
            asyncio.run(_ensure_nodes(state, pool, log))
            state.nodes = asdict(pool)
            state.save()
            log(f"cluster {name!r} is already up: {state.server}")
            return state
        if state is not None or paths.run_dir(name).exists():
            _down(name, log)
        try:
            return _start(name, pool, scrape_interval, vllm, log)
        except BaseException:
            # Stop what did start, but keep the logs for a look; the next `up` clears them.
            if (partial := load_state(name)) is not None:
                _stop_processes(partial)
            log(f"cluster {name!r} did not come up; logs in {paths.run_dir(name)}")
            raise


def _start(name: str, pool: nodes.NodePool, scrape_interval: str, vllm: bool, log: Log) -> State:
    t0 = time.monotonic()

    def step(message: str) -> None:
        log(f"[{time.monotonic() - t0:5.1f}s] {message}")

    slot = _free_slot()
    run = paths.run_dir(name)
    run.mkdir(parents=True)
    bins = paths.bin_dir()
    shim = bind_shim()
    ports = {k: free_port() for k in ("etcd", "etcd_peer", "apiserver", "podrunner", "prometheus",
                                        "lws_webhook", "lws_health")}
    server = f"https://127.0.0.1:{ports['apiserver']}"
    keys = pki.create(
        run / "pki",
        dns_names=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                   "kubernetes.default.svc.cluster.local"],
        ip_addresses=["127.0.0.1", nodes.kubernetes_service_ip(slot)],
    )
    admin = kubeconfig.write(
        run / "admin.kubeconfig", name=name, server=server, ca_file=keys.ca_cert,
        user={"client-certificate": str(keys.admin_cert), "client-key": str(keys.admin_key)},
    )
    state = State(
        name=name, run_dir=str(run), bin_dir=str(bins), server=server, kubeconfig=str(admin),
        prometheus_url=f"http://127.0.0.1:{ports['prometheus']}", ports=ports, nodes=asdict(pool),
        started_at=time.time(), slot=slot,
    )
    step(f"pki and kubeconfig in {run}")

    def start(component: str, argv: list[str], env: dict[str, str] | None = None) -> procs.Proc:
        proc = procs.spawn(argv, run / f"{component}.log", env=env, cwd=run)
        state.procs[component] = proc.to_json()
        state.save()  # `down` can stop whatever started, even if `up` fails half-way
        return proc

    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    peer_url = f"http://127.0.0.1:{ports['etcd_peer']}"
    etcd = start("etcd", [
        f"{bins}/etcd", "--name=n0", f"--data-dir={run / 'etcd'}", "--unsafe-no-fsync", "--log-level=warn",
        f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
        f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=n0={peer_url}",
    ])
    _wait("etcd", lambda: _http_ok(f"{etcd_url}/health"), timeout=30, proc=etcd, log_file=run / "etcd.log")
    step("etcd ready")

    apiserver = start("kube-apiserver", [
        f"{bins}/kube-apiserver", f"--etcd-servers={etcd_url}",
        "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={ports['apiserver']}",
        f"--tls-cert-file={keys.apiserver_cert}", f"--tls-private-key-file={keys.apiserver_key}",
        f"--client-ca-file={keys.ca_cert}", "--authorization-mode=Node,RBAC",
        f"--service-account-issuer={SA_ISSUER}", f"--service-account-key-file={keys.sa_pub}",
        f"--service-account-signing-key-file={keys.sa_key}",
        f"--service-cluster-ip-range={nodes.service_cidr(slot)}",
        # The default "lease" reconciler would write 127.0.0.1 into the kubernetes Endpoints,
        # which validation rejects (loopback); the pod runner routes that Service itself.
        "--endpoint-reconciler-type=none",
        # Pods requesting nvidia.com/gpu tolerate the GPU nodes' taint, as on GPU clusters.
        "--enable-admission-plugins=ExtendedResourceToleration",
        "--allow-privileged=true", "--profiling=false",
    ])
    tls = _tls(keys)
    _wait("kube-apiserver", lambda: _http_ok(f"{server}/readyz", tls), timeout=90, proc=apiserver,
          log_file=run / "kube-apiserver.log")
    step("kube-apiserver ready")

    start("kube-controller-manager", [
        f"{bins}/kube-controller-manager", f"--kubeconfig={admin}", "--leader-elect=false", "--secure-port=0",
        f"--root-ca-file={keys.ca_cert}", f"--service-account-private-key-file={keys.sa_key}",
        f"--cluster-name={name}", "--node-monitor-period=2s", "--controllers=*",
    ])
    start("kube-scheduler", [f"{bins}/kube-scheduler", f"--kubeconfig={admin}", "--leader-elect=false", "--secure-port=0"])
    start("kwok", [f"{bins}/kwok", f"--kubeconfig={admin}", f"--config={Path(__file__).with_name('kwok.yaml')}"])
    start("podrunner", [
        sys.executable, "-m", "localcluster.podrunner", f"--run-dir={run}", f"--kubeconfig={admin}",
        f"--bind-shim={shim}", f"--venv-bin={Path(sys.executable).parent}",
        f"--apiserver=127.0.0.1:{ports['apiserver']}", f"--listen=127.0.0.1:{ports['podrunner']}",
        *(["--vllm"] if vllm else []),
    ], env={**os.environ, "PYTHONPATH": f"{paths.LOCAL_DIR}:{paths.REPO_ROOT / 'operator'}", "PYTHONUNBUFFERED": "1"})
    runner_url = f"http://127.0.0.1:{ports['podrunner']}"
    prom_config = prometheus.config(targets_url=f"{runner_url}/targets", scrape_interval=scrape_interval)
    (run / "prometheus.yml").write_text(yaml.safe_dump(prom_config, sort_keys=False))
    start("prometheus", [
        "prometheus", f"--config.file={run / 'prometheus.yml'}", f"--storage.tsdb.path={run / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{ports['prometheus']}", "--web.enable-lifecycle",
        "--storage.tsdb.retention.time=1d", "--log.level=warn",
    ])
    step("controllers, scheduler, kwok, pod runner and prometheus started")

    asyncio.run(_ensure_nodes(state, pool, step))
    lws = _lws_config(state, keys)
    asyncio.run(_install_lws(state, keys))
    start("lws-controller", [str(paths.lws_dir(bins) / "lws-controller"), f"--config={lws}", "--zap-log-level=info"],
          env={**os.environ, "KUBECONFIG": str(admin)})
    _wait("lws-controller", lambda: _http_ok(f"http://127.0.0.1:{ports['lws_health']}/readyz")
          and _listening(ports["lws_webhook"]), timeout=30, proc=state.proc("lws-controller"),
          log_file=run / "lws-controller.log")
    step("LeaderWorkerSet controller ready")
    _wait("pod runner", lambda: _http_ok(f"{runner_url}/healthz"), timeout=30, proc=state.proc("podrunner"),
          log_file=run / "podrunner.log")
    _wait("prometheus", lambda: _http_ok(f"{state.prometheus_url}/-/ready"), timeout=30,
          proc=state.proc("prometheus"), log_file=run / "prometheus.log")
    step(f"cluster {name!r} is up: {server}")
    return state


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _lws_config(state: State, keys: pki.Pki) -> Path:
    """The LeaderWorkerSet controller's configuration: webhooks on loopback with the
    apiserver's serving certificate (its SANs hold 127.0.0.1, which the apiserver checks
    when it calls them), no certificate rotation of its own, one replica."""
    run = Path(state.run_dir)
    certs = run / "lws-certs"
    certs.mkdir(exist_ok=True)
    shutil.copy(keys.apiserver_cert, certs / "tls.crt")
    shutil.copy(keys.apiserver_key, certs / "tls.key")
    config = {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": state.ports["lws_webhook"], "certDir": str(certs)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{state.ports['lws_health']}"},
        "leaderElection": {"leaderElect": False},
    }
    path = run / "lws-config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def lws_webhooks(manifests: str, port: int, ca_bundle: bytes) -> list[dict[str, Any]]:
    """The controller's webhook configurations, called at https://127.0.0.1:<port>.
    As its own deployment patches them: pod webhooks only for pods of a LeaderWorkerSet,
    so that every other pod is created even while the controller is down."""
    out = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        doc["metadata"]["name"] = f"lws-{doc['metadata']['name']}"
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                    "caBundle": base64.b64encode(ca_bundle).decode()}
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = {"matchExpressions": [
                    {"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}
        out.append(doc)
    return out


async def _install_lws(state: State, keys: pki.Pki) -> None:
    """CRDs and webhook configurations of the LeaderWorkerSet controller, server-side applied."""
    source = paths.lws_dir(Path(state.bin_dir))
    objects = [yaml.safe_load(crd.read_text()) for crd in sorted(source.glob("*_*.yaml"))]
    objects += lws_webhooks((source / "manifests.yaml").read_text(), state.ports["lws_webhook"],
                            keys.ca_cert.read_bytes())
    async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
        for obj in objects:
            await kube.apply(obj, field_manager="localcluster")
        deadline = time.monotonic() + 30
        while not await _established(kube):
            if time.monotonic() > deadline:
                raise TimeoutError("the LeaderWorkerSet CRD was not established in 30s")
            await asyncio.sleep(0.2)


async def _established(kube: Kube) -> bool:
    crd = await kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition",
                         "leaderworkersets.leaderworkerset.x-k8s.io")
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


async def _ensure_nodes(state: State, pool: nodes.NodePool, log: Log) -> None:
    """Creates missing nodes and waits until the scheduler can use them: kwok made them
    Ready, the node lifecycle controller lifted their not-ready taint, and the service
    account controllers have populated the default namespace."""
    async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
        for node in nodes.manifests(pool, state.slot):
            with contextlib.suppress(ApiError):
                await kube.create(node)

        async def ready() -> bool:
            listed = {n["metadata"]["name"]: n for n in await kube.list("v1", "Node")}
            for name in nodes.node_names(pool):
                node = listed.get(name)
                if node is None:
                    return False
                conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
                taints = {t["key"] for t in node["spec"].get("taints", [])}
                if conditions.get("Ready") != "True" or "node.kubernetes.io/not-ready" in taints:
                    return False
            return (
                await kube.get("v1", "ServiceAccount", "default", "default") is not None
                and await kube.get("v1", "ConfigMap", "kube-root-ca.crt", "default") is not None
            )

        deadline = time.monotonic() + 60
        while not await ready():
            for component in ("kwok", "kube-controller-manager"):
                if not procs.alive(state.proc(component)):  # type: ignore[arg-type]
                    log_file = Path(state.run_dir) / f"{component}.log"
                    raise RuntimeError(f"{component} exited; last lines of {log_file}:\n{_log_tail(log_file)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes not schedulable after 60s; see {state.run_dir}/kwok.log "
                                   "and kube-controller-manager.log")
            await asyncio.sleep(0.2)
    log(f"{pool.gpu_nodes} GPU and {pool.cpu_nodes} CPU nodes ready")


def down(name: str, log: Log = _stderr) -> bool:
    """Stops every process of the cluster and removes its run directory."""
    with _lock(name):
        return _down(name, log)


def _down(name: str, log: Log) -> bool:
    run = paths.run_dir(name)
    state = load_state(name)
    if state is None and not run.exists():
        return False
    if state is not None:
        _stop_processes(state)
    shutil.rmtree(paths.memory_dir(name), ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)
    log(f"cluster {name!r} is down")
    return True


def _stop_processes(state: State) -> None:
    for component in COMPONENTS:
        if (proc := state.proc(component)) is not None:
            procs.stop([proc], timeout=15 if component == "podrunner" else 5)
    # Containers the pod runner could not stop (if it died first) are recorded here.
    leftovers = []
    for pid_file in Path(state.run_dir).glob("pods/*/*.pid"):
        with contextlib.suppress(ValueError, OSError):
            leftovers.append(procs.Proc.from_json(json.loads(pid_file.read_text())))
    procs.stop(leftovers, timeout=2)


def stop_component(name: str, component: str) -> None:
    """Stops one component (fault injection: an apiserver or Prometheus outage) and
    remembers its command line and environment for start_component."""
    with _lock(name):
        state = load_state(name)
        proc = state.proc(component) if state else None
        if state is None or proc is None or not procs.alive(proc):
            raise RuntimeError(f"{component} of cluster {name!r} is not running")
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().rstrip(b"\0").split(b"\0")
        state.stopped[component] = {
            "argv": [a.decode() for a in argv],
            "env": dict(e.decode().partition("=")[::2] for e in environ if b"=" in e),
        }
        state.save()
        procs.stop([proc], timeout=15 if component == "podrunner" else 5)


def start_component(name: str, component: str, timeout: float = 90) -> None:
    """Starts a component stopped by stop_component again, exactly as it ran (same ports,
    same data), and waits until it serves."""
    with _lock(name):
        state = load_state(name)
        if state is None or component not in state.stopped:
            raise RuntimeError(f"{component} of cluster {name!r} was not stopped by stop_component")
        run = Path(state.run_dir)
        saved = state.stopped.pop(component)
        proc = procs.spawn(saved["argv"], run / f"{component}.log", env=saved["env"], cwd=run)
        state.procs[component] = proc.to_json()
        state.save()
        checks: dict[str, Callable[[], bool]] = {
            "kube-apiserver": lambda: _http_ok(f"{state.server}/readyz", _tls(state.pki)),
            "prometheus": lambda: _http_ok(f"{state.prometheus_url}/-/ready"),
            "podrunner": lambda: _http_ok(f"http://127.0.0.1:{state.ports['podrunner']}/healthz"),
            "etcd": lambda: _http_ok(f"http://127.0.0.1:{state.ports['etcd']}/health"),
        }
        _wait(component, checks.get(component, lambda: True), timeout=timeout, proc=proc,
              log_file=run / f"{component}.log")


def restart(name: str, component: str) -> None:
    """Stops one component and starts it again with the same command line."""
    stop_component(name, component)
    start_component(name, component)


def status(name: str) -> dict[str, Any]:
    state = load_state(name)
    if state is None:
        return {"name": name, "up": False}
    components = {c: bool((p := state.proc(c)) and procs.alive(p)) for c in COMPONENTS}
    return {
        "name": name,
        "up": all(components.values()) and _http_ok(f"{state.server}/readyz", _tls(state.pki)),
        "components": components,
        "server": state.server,
        "kubeconfig": state.kubeconfig,
        "prometheus_url": state.prometheus_url,
        "run_dir": state.run_dir,
        "nodes": state.nodes,
    }
