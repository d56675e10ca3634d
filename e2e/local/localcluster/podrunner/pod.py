"""One pod on a fake node, run as local processes: volumes, init containers, containers
with restarts and back-off, probes, status, and graceful deletion."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from localcluster import paths, procs
from localcluster.podrunner import envvars, network, probes, status, vllm, volumes
from pdcluster.io.kube import ApiError

if TYPE_CHECKING:
    from localcluster.podrunner.runner import Runner

Obj = dict[str, Any]


def _dockerfile(image: str, entrypoint: list[str]) -> tuple[list[str], list[str]]:
    """(ENTRYPOINT, CMD) of images/<image>/Dockerfile, so pods run what the image would."""
    path = paths.REPO_ROOT / "images" / image / "Dockerfile"
    text = path.read_text() if path.exists() else ""

    def exec_form(instruction: str) -> list[str] | None:
        m = re.search(rf"^{instruction}\s+(\[.*\])\s*$", text, re.MULTILINE)
        return json.loads(m.group(1)) if m else None

    return exec_form("ENTRYPOINT") or entrypoint, exec_form("CMD") or []


# Images this runner can run, by repository (registry host and tag ignored), with their
# (entrypoint, default args); their programs are the project's console scripts.
IMAGES: dict[str, tuple[list[str], list[str]]] = {
    "pdcluster/router": _dockerfile("router", ["pdcluster-router"]),
    "pdcluster/engine-sim": _dockerfile("engine-sim", ["pdcluster-engine-sim"]),
    "pdcluster/operator": _dockerfile("operator", ["pdcluster-operator"]),
    "pdcluster/mooncake": _dockerfile("mooncake", ["mooncake_master"]),  # the venv's Mooncake wheel
    "python": ([], ["python3"]),  # as the official image: no entrypoint, CMD python3
    # on the real-vLLM runtime: localcluster/podrunner/vllm.py
    **dict.fromkeys(vllm.REPOSITORIES, (vllm.ENTRYPOINT, [])),
}
# The kubelet's crash-loop back-off: 10s doubling to 5 minutes, reset after 10 minutes of running.
BACKOFF_INITIAL, BACKOFF_MAX, BACKOFF_RESET = 10.0, 300.0, 600.0
# How long a successor waits past its predecessor's grace period before it kills what is
# left of it: the predecessor's processes get their grace, not forever.
PREDECESSOR_SLACK = 10.0
MIN_GRACE = 2.0  # the kubelet's minimum grace period, also after a preStop hook used it up


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def image_repository(image: str) -> str:
    """'registry.example:5000/pdcluster/router:1.0@sha256:…' -> 'pdcluster/router'."""
    name = image.split("@", 1)[0]
    if ":" in name.rsplit("/", 1)[-1]:
        name = name[: name.rindex(":")]
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]
    if len(parts) == 2 and parts[0] == "library":
        parts = parts[1:]
    return "/".join(parts)


async def first(*events: asyncio.Event) -> None:
    """Waits until any of the events is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def write_in_place(path: Path, text: str) -> None:
    """Rewrites a file that is bind-mounted into running containers without replacing its
    inode (a rename would leave the containers on the old file). Writing before
    truncating means a concurrent reader sees new entries first, never an empty file."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


class Container:
    def __init__(self, pod: PodWorker, spec: Obj):
        self.pod, self.spec, self.name = pod, spec, spec["name"]
        self.status: Obj = {
            "name": self.name, "image": spec["image"], "imageID": "", "ready": False, "started": False,
            "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}},
        }
        self.proc: asyncio.subprocess.Process | None = None
        self.stopped = False
        self.started_event = asyncio.Event()
        self.env: dict[str, str] = {}
        self.mounts: list[volumes.Mount] = []  # as the last start bound them
        self._probe_task: asyncio.Task[None] | None = None
        self._kill_task: asyncio.Task[None] | None = None
        self._backoff = 0.0
        self._started_at = 0.0

    @property
    def log_path(self) -> Path:
        return self.pod.dir / f"{self.name}.log"

    @property
    def pid_path(self) -> Path:
        return self.pod.dir / f"{self.name}.pid"

    @property
    def workdir(self) -> str:
        return self.spec.get("workingDir") or str(self.pod.dir / "work" / self.name)

    @property
    def runnable(self) -> bool:
        return image_repository(self.spec["image"]) in self.pod.runner.images

    def _set_state(self, state: Obj) -> None:
        if "terminated" in self.status["state"] and "terminated" not in state:
            self.status["lastState"] = {"terminated": self.status["state"]["terminated"]}
        self.status["state"] = state
        self.pod.dirty()

    def set_waiting(self, reason: str, message: str = "") -> None:
        self._set_state({"waiting": {"reason": reason, **({"message": message} if message else {})}})

    def _terminated(self, code: int, reason: str, message: str, started: str) -> None:
        self.status.update(ready=False, started=False)
        term = {"exitCode": code, "reason": reason, "startedAt": started, "finishedAt": now()}
        if message:
            term["message"] = message
        if self.status.get("containerID"):
            term["containerID"] = self.status["containerID"]
        self._set_state({"terminated": term})

    async def _command(self) -> list[str]:
        runner, pod = self.pod.runner, self.pod.pod
        await runner.services_synced.wait()
        config_maps, secrets = envvars.referenced_objects(self.spec)
        ns = pod["metadata"]["namespace"]
        self.env = {
            "PATH": f"{runner.venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "HOSTNAME": network.pod_hostname(pod),
            **envvars.container_env(
                pod, self.spec, services=list(runner.services.values()),
                config_maps={n: await runner.kube.get("v1", "ConfigMap", n, ns) for n in config_maps},
                secrets={n: await runner.kube.get("v1", "Secret", n, ns) for n in secrets},
                node_allocatable=await runner.node_allocatable(pod["spec"]["nodeName"]),
            ),
        }
        # Mooncake's transfer engine listens on, and advertises, the address of a host
        # interface (unless told); in a pod that is the pod IP, here the host's.
        self.env.setdefault("MC_TCP_BIND_ADDRESS", self.pod.ip)
        repository = image_repository(self.spec["image"])
        entrypoint, default_args = IMAGES[repository]
        argv = envvars.command_line(entrypoint, default_args, self.spec, self.env)
        if repository in vllm.REPOSITORIES:
            serves = argv[:2] == vllm.ENTRYPOINT
            argv = vllm.command(argv)
            self.env = vllm.environment(self.env, pod_ip=self.pod.ip, cache_dir=self.pod.dir / "vllm-cache", serves=serves)
        return argv

    async def run_once(self) -> int | None:
        """Starts the process and waits for it; its exit code, or None if it could not be
        configured (a missing ConfigMap key, say) and should be retried."""
        try:
            argv = await self._command()
        except (envvars.EnvError, vllm.RuntimeMissing, ApiError, ValueError, aiohttp.ClientError, TimeoutError) as e:
            self.set_waiting("CreateContainerConfigError", str(e))
            self.pod.event("Warning", "Failed", f"Error: {e}")
            return None
        started = now()
        executable = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=self.env.get("PATH"))
        if not executable:
            self._terminated(128, "StartError", f'exec: "{argv[0]}": executable file not found in $PATH', started)
            return 128
        if self.stopped:
            return None
        tmp = self.pod.dir / "tmp" / self.name
        shutil.rmtree(tmp, ignore_errors=True)  # a restarted container starts from a clean filesystem
        tmp.mkdir(parents=True)
        self.mounts = mounts = volumes.with_private_dirs(volumes.mounts(self.spec, self.pod.volumes, self.env), tmp=tmp,
                                           shm=self.pod.memory_dir / ".dev-shm")
        # A checkout or cache under /tmp (a fresh clone there) must survive the private /tmp.
        # So must a volume there (a hostPath PV of a test's tmp_path).
        needed = [paths.REPO_ROOT, self.pod.runner.venv_bin, self.pod.runner.bind_shim, *self.pod.volumes.values()]
        needed += [vllm.runtime()] if image_repository(self.spec["image"]) in vllm.REPOSITORIES else []
        script = volumes.launch_script(mounts, hosts_file=self.pod.hosts_path, hostname=network.pod_hostname(self.pod.pod),
                                       workdir=self.workdir, keep_host_tmp=volumes.host_tmp_paths(needed),
                                       host_tmp_view=self.pod.dir / "host-tmp")
        proc_env = {**self.env, "LD_PRELOAD": str(self.pod.runner.bind_shim), "PDCLUSTER_POD_IP": self.pod.ip}
        with open(self.log_path, "ab") as log:
            if self.status["restartCount"] or "terminated" in self.status["state"]:
                log.write(f"--- {started} restarting {self.name} (restart {self.status['restartCount']}) ---\n".encode())
                log.flush()
            self.proc = await asyncio.create_subprocess_exec(
                "unshare", "--mount", "--uts", "--propagation", "private", "--", "/bin/sh", "-ec", script,
                self.name, *argv, env=proc_env, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,
            )
        proc = self.proc
        self.pid_path.write_text(json.dumps(procs.identify(proc.pid).to_json()))
        if self.stopped:  # deletion began while we were starting
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._started_at = asyncio.get_running_loop().time()
        self.status["containerID"] = f"pdcluster://{proc.pid}"
        self._set_state({"running": {"startedAt": started}})
        self.pod.event("Normal", "Started", f"Started container {self.name}")
        self._probe_task = asyncio.create_task(self._probe(proc.pid))
        rc = await proc.wait()
        self._probe_task.cancel()
        self.pid_path.unlink(missing_ok=True)
        code = rc if rc >= 0 else 128 - rc
        message = volumes.termination_message(self.spec, self.mounts, code, self.log_path)
        self._terminated(code, "Completed" if code == 0 else "Error", message, started)
        return code

    async def _probe(self, pid: int) -> None:
        """Startup probe, then readiness and liveness probes, as the kubelet's prober."""
        ports = {p["name"]: p["containerPort"] for p in self.spec.get("ports", []) if p.get("name")}
        target = probes.Target(self.pod.ip, ports, pid, self.env, self.workdir)
        session = self.pod.runner.http
        if startup := self.spec.get("startupProbe"):
            await asyncio.sleep(startup.get("initialDelaySeconds", 0))
            failures = 0
            while True:
                ok, detail = await probes.run(startup, target, startup.get("timeoutSeconds", 1), session)
                if ok:
                    break
                failures += 1
                if failures >= startup.get("failureThreshold", 3):
                    self.pod.event("Warning", "Unhealthy", f"Startup probe failed: {detail}")
                    self._kill_soon(startup)
                    return
                await asyncio.sleep(startup.get("periodSeconds", 10))
        self.status["started"] = True
        self.started_event.set()
        readiness, liveness = self.spec.get("readinessProbe"), self.spec.get("livenessProbe")
        if not readiness:
            self.status["ready"] = True
        self.pod.dirty()

        async def on_ready(ok: bool, detail: str) -> None:
            self.status["ready"] = ok
            self.pod.dirty()
            if not ok:
                self.pod.event("Warning", "Unhealthy", f"Readiness probe failed: {detail}")

        async def on_alive(ok: bool, detail: str) -> None:
            if not ok:
                self.pod.event("Warning", "Unhealthy", f"Liveness probe failed: {detail}")
                self._kill_soon(liveness)

        loops = []
        if readiness:
            loops.append(probes.probe_loop(readiness, target, session, on_ready))
        if liveness:
            loops.append(probes.probe_loop(liveness, target, session, on_alive, initially=True))
        await asyncio.gather(*loops)

    def _kill_soon(self, probe: Obj) -> None:
        grace = probe.get("terminationGracePeriodSeconds", self.pod.pod["spec"].get("terminationGracePeriodSeconds", 30))
        self.pod.event("Normal", "Killing", f"Container {self.name} failed a probe, will be restarted")
        self._kill_task = asyncio.create_task(self.signal_stop(grace, pre_stop=False))

    async def signal_stop(self, grace: float, *, pre_stop: bool) -> None:
        """preStop hook, SIGTERM, and SIGKILL once the grace period is over."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(grace, MIN_GRACE)
        hook = self.spec.get("lifecycle", {}).get("preStop")
        if pre_stop and hook:
            ports = {p["name"]: p["containerPort"] for p in self.spec.get("ports", []) if p.get("name")}
            target = probes.Target(self.pod.ip, ports, proc.pid, self.env, self.workdir)
            ok, detail = await probes.run(hook, target, max(grace, 0.1), self.pod.runner.http)
            if not ok:
                self.pod.event("Warning", "FailedPreStopHook", f"PreStopHook failed: {detail}")
            deadline = max(deadline, loop.time() + MIN_GRACE)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), max(deadline - loop.time(), 0))
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def supervise(self, restart_policy: str) -> int | None:
        """Runs the container, restarting it per the policy with the kubelet's back-off;
        returns the last exit code once it is not restarted any more."""
        while not self.stopped:
            code = await self.run_once()
            if self.stopped:
                return code
            if code is not None and not (restart_policy == "Always" or (restart_policy == "OnFailure" and code != 0)):
                return code
            loop = asyncio.get_running_loop()
            ran_for = loop.time() - self._started_at
            if code is None or ran_for < BACKOFF_RESET:
                delay, self._backoff = self._backoff, min(max(self._backoff * 2, BACKOFF_INITIAL), BACKOFF_MAX)
            else:
                delay, self._backoff = 0.0, BACKOFF_INITIAL
            if delay:
                if code is not None:
                    self.set_waiting("CrashLoopBackOff", f"back-off {delay:.0f}s restarting failed container={self.name}")
                    self.pod.event("Warning", "BackOff", "Back-off restarting failed container")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.pod.stopping.wait(), delay)
            if code is not None and not self.stopped:
                self.status["restartCount"] += 1
        return None


class PodWorker:
    """One pod, keyed by uid like a kubelet's: its directory is pods/<uid> (pods/<namespace>_<name>
    is a link to the newest pod of that name, for people and tests), its processes and
    status writes are its own, and a successor of the same name starts its containers
    only after this one's processes have exited."""

    def __init__(self, runner: Runner, pod: Obj, predecessor: PodWorker | None = None):
        self.runner, self.pod = runner, pod
        meta = pod["metadata"]
        self.uid, self.namespace, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.dir = runner.pods_dir / self.uid
        self.name_link = runner.pods_dir / f"{self.namespace}_{self.name}"
        self.predecessor = predecessor
        self.finished = asyncio.Event()  # every process of this pod has exited
        self.hosts_path = self.dir / "hosts"
        self.memory_dir = runner.memory_dir / self.uid
        self.init_containers = [Container(self, c) for c in pod["spec"].get("initContainers", [])]
        self.containers = [Container(self, c) for c in pod["spec"]["containers"]]
        self.volumes: dict[str, Path] = {}
        self.has_ip = asyncio.Event()
        self.stopping = asyncio.Event()
        self.terminal = False  # the final status: phase Succeeded/Failed on deletion
        self._dirty = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lifecycle = asyncio.create_task(self._run())
        self._writer = asyncio.create_task(self._write_status())
        self._termination: asyncio.Task[None] | None = None
        self.update(pod)

    @property
    def ip(self) -> str:
        return self.pod.get("status", {}).get("podIP", "")

    @property
    def all_containers(self) -> list[Container]:
        return self.init_containers + self.containers

    def dirty(self) -> None:
        self._dirty.set()

    def event(self, kind: str, reason: str, message: str) -> None:
        task = asyncio.create_task(self.runner.event(self.pod, kind, reason, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def update(self, pod: Obj) -> None:
        self.pod = pod
        if self.ip:
            self.has_ip.set()
        if pod["metadata"].get("deletionTimestamp") and self._termination is None:
            grace = pod["metadata"].get("deletionGracePeriodSeconds")
            if grace is None:
                grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            self._termination = asyncio.create_task(self.terminate(float(grace), delete=True))

    def gone(self) -> None:
        """The pod object was removed (force deletion): stop at once, nothing to report (the
        name may already be a successor's, whose status is not ours to write)."""
        self._writer.cancel()
        if self._termination is None:
            self._termination = asyncio.create_task(self.terminate(0.0, delete=False))

    async def _await_predecessor(self, *, until_stopped: bool) -> None:
        """Waits for the previous pod of this name to be gone, as a kubelet holds a
        StatefulSet's successor until its predecessor's containers are: its processes
        still hold the ports and the devices this pod is about to take. A pod that is
        stopped while it waits still waits before it calls itself finished, so a chain of
        deletions (a successor deleted while it waited) is gone in order."""
        old = self.predecessor
        if old is None:
            return
        grace = float(old.pod["spec"].get("terminationGracePeriodSeconds", 30))
        waits = (old.finished, self.stopping) if until_stopped else (old.finished,)
        try:
            await asyncio.wait_for(first(*waits), grace + PREDECESSOR_SLACK)
        except TimeoutError:
            self.runner.log(f"{self.namespace}/{self.name}: predecessor {old.uid[:8]} still running; killing it")
            await old.kill_now()
        if old.finished.is_set():
            self.predecessor = None

    def _prepare_dir(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.memory_dir / ".dev-shm").mkdir(parents=True, exist_ok=True)
        (self.dir / "pod").write_text(f"{self.namespace}/{self.name}\n")
        link = self.name_link.with_name(f".{self.name_link.name}.{self.uid[:8]}")
        link.unlink(missing_ok=True)
        link.symlink_to(self.uid)
        os.replace(link, self.name_link)
        self.write_hosts(self.runner.hosts_for(self.pod))

    def write_hosts(self, text: str) -> None:
        write_in_place(self.hosts_path, text)

    async def _run(self) -> None:
        await first(self.has_ip, self.stopping)
        if self.stopping.is_set():
            return
        # A kubelet runs the pods of its own node only: a pod bound to a node that does
        # not exist is someone else's (tests write such pods' status themselves).
        if await self.runner.kube.get("v1", "Node", self.pod["spec"]["nodeName"]) is None:
            self.runner.log(f"{self.namespace}/{self.name}: node {self.pod['spec']['nodeName']!r} does not exist; not running it")
            return
        await self._await_predecessor(until_stopped=True)
        if self.stopping.is_set():
            return
        self._prepare_dir()
        self.dirty()
        for c in self.all_containers:
            if not c.runnable:
                known = ", ".join(sorted(self.runner.images))
                c.set_waiting("ImageNotRunnableLocally",
                              f"image {c.spec['image']!r} cannot run on the local cluster (runnable: {known})")
                self.event("Warning", "Failed", f"image {c.spec['image']!r} is not runnable locally")
        delay = 0.5
        while not self.stopping.is_set():
            try:
                self.volumes = await volumes.prepare(
                    self.runner.kube, self.pod, self.dir / "volumes", self.memory_dir,
                    await self.runner.node_allocatable(self.pod["spec"]["nodeName"]),
                )
                break
            except (volumes.VolumeError, ApiError) as e:
                self.event("Warning", "FailedMount", str(e))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay)
                delay = min(delay * 2, 10.0)
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.init_containers:
            if self.stopping.is_set() or not c.runnable:
                return
            if status.is_sidecar(c.spec):
                self._spawn(c.supervise("Always"))
                await first(c.started_event, self.stopping)
                continue
            code = await c.supervise("Never" if policy == "Never" else "OnFailure")
            if code != 0:
                return
        runs = [self._spawn(c.supervise(policy)) for c in self.containers if c.runnable]
        await asyncio.gather(*runs, return_exceptions=True)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def terminate(self, grace: float, *, delete: bool) -> None:
        """Graceful deletion, as the kubelet does it: preStop hooks and SIGTERM, SIGKILL after
        the grace period, then the final status and the pod's removal (a DELETE with grace 0)."""
        self.stopping.set()
        for c in self.all_containers:
            c.stopped = True
            if c.proc is not None and c.proc.returncode is None:
                self.event("Normal", "Killing", f"Stopping container {c.name}")
        await asyncio.gather(*(c.signal_stop(grace, pre_stop=delete) for c in self.all_containers))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._lifecycle), 5)
        self.terminal = True
        self._writer.cancel()
        shutil.rmtree(self.dir / "volumes", ignore_errors=True)  # the logs stay, as a kubelet's do for a while
        shutil.rmtree(self.memory_dir, ignore_errors=True)
        await self._await_predecessor(until_stopped=False)
        self.finished.set()
        if delete:
            await self._flush_status()
            await self._delete()
        self.runner.forget(self)

    async def _delete(self) -> None:
        for _ in range(10):
            try:
                await self.runner.kube.request(
                    "DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                    body={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                          "preconditions": {"uid": self.uid}},
                )
                return
            except ApiError as e:
                if e.status in (404, 409):  # gone already, or the name is a newer pod's
                    return
                self.runner.log(f"{self.namespace}/{self.name}: delete failed: {e}")
            except (aiohttp.ClientError, TimeoutError) as e:
                self.runner.log(f"{self.namespace}/{self.name}: delete failed: {e!r}")
            await asyncio.sleep(1.0)

    async def kill_now(self) -> None:
        """The runner is shutting down (cluster down): no hooks, short grace, no API calls."""
        self.stopping.set()
        for c in self.all_containers:
            c.stopped = True
        await asyncio.gather(*(c.signal_stop(2.0, pre_stop=False) for c in self.all_containers))
        for c in self.all_containers:
            c.pid_path.unlink(missing_ok=True)
        await self._await_predecessor(until_stopped=False)
        self.finished.set()

    def _status_patch(self) -> Obj:
        init = [c.status for c in self.init_containers]
        main = [c.status for c in self.containers]
        phase = status.phase(self.pod["spec"], init, main, terminal=self.terminal)
        body: Obj = {
            "phase": phase,
            "conditions": status.conditions(self.pod, init, main, phase, now()),
            "containerStatuses": main,
        }
        if init:
            body["initContainerStatuses"] = init
        return {"metadata": {"uid": self.uid}, "status": body}

    async def _flush_status(self) -> str:
        """Sends the current status: "ok", "gone" (no such pod any more) or "retry"."""
        self._dirty.clear()
        try:
            await self.runner.kube.request(
                "PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status",
                body=self._status_patch(), content_type="application/strategic-merge-patch+json",
            )
            return "ok"
        except ApiError as e:
            # 409, or 422 on metadata.uid: the name now belongs to a newer pod
            if e.status in (404, 409) or (e.status == 422 and "metadata.uid" in e.message):
                return "gone"
            self.runner.log(f"{self.namespace}/{self.name}: status update failed: {e}")
        except (aiohttp.ClientError, TimeoutError) as e:
            self.runner.log(f"{self.namespace}/{self.name}: status update failed: {e!r}")
        self._dirty.set()
        return "retry"

    async def _write_status(self) -> None:
        while True:
            await self._dirty.wait()
            result = await self._flush_status()
            if result == "gone":
                return
            # Coalesce bursts of changes into one update; back off while the API fails.
            await asyncio.sleep(0.05 if result == "ok" else 1.0)
