"""The pod runner: a tiny kubelet for known images on the fake nodes, plus what
kube-proxy and cluster DNS would do (ClusterIP proxies, per-pod hosts files)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from localcluster import paths
from localcluster.podrunner import discovery, forwarder, network
from localcluster.podrunner.pod import IMAGES, PodWorker, now
from localcluster.podrunner.vllm import REPOSITORIES as VLLM_REPOSITORIES
from pdcluster.io.kube import ApiError, Kube

Obj = dict[str, Any]
KUBERNETES_SERVICE = ("default", "kubernetes")


def _key(obj: Obj) -> tuple[str, str]:
    return obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _finished(pod: Obj) -> bool:
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")


class Runner:
    def __init__(self, kube: Kube, *, run_dir: Path, bind_shim: Path, venv_bin: Path, apiserver: tuple[str, int],
                 listen: tuple[str, int], vllm: bool = False):
        self.kube = kube
        self.run_dir = run_dir
        self.pods_dir = run_dir / "pods"
        self.memory_dir = paths.memory_dir(run_dir.name)
        self.bind_shim = bind_shim
        self.venv_bin = venv_bin
        self.images = set(IMAGES) if vllm else set(IMAGES) - set(VLLM_REPOSITORIES)
        self.apiserver = apiserver
        self.listen = listen
        self.pods: dict[str, Obj] = {}  # by uid: every pod in the cluster (for endpoints and DNS)
        self.services: dict[tuple[str, str], Obj] = {}
        self.workers: dict[str, PodWorker] = {}  # by uid, as a kubelet keys pods
        self.by_name: dict[tuple[str, str], PodWorker] = {}  # the newest worker of each pod name
        self.services_synced = asyncio.Event()
        self.pods_synced = asyncio.Event()
        self.http: aiohttp.ClientSession
        self._network_changed = asyncio.Event()
        self._hosts: dict[str, str] = {}  # uid -> last hosts file written
        self._nodes: dict[str, dict[str, str]] = {}
        self.proxy = forwarder.ServiceProxy(self._targets, self.log)

    @staticmethod
    def log(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)

    async def run(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/targets", self._targets_sd)
        site_runner = web.AppRunner(app, access_log=None)
        await site_runner.setup()
        await web.TCPSite(site_runner, *self.listen).start()
        async with aiohttp.ClientSession() as self.http:
            tasks = [asyncio.create_task(t) for t in (self._watch_services(), self._watch_pods(), self._network())]
            await asyncio.wait([asyncio.create_task(stop.wait()), *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                if task.done() and task.exception():
                    self.log(f"fatal: {task.exception()!r}")
                task.cancel()
            self.log("stopping all pods")
            await asyncio.gather(*(w.kill_now() for w in list(self.workers.values())))
            await self.proxy.close()
        await site_runner.cleanup()

    async def _healthz(self, _: web.Request) -> web.Response:
        synced = self.pods_synced.is_set() and self.services_synced.is_set()
        return web.Response(status=200 if synced else 503, text="ok" if synced else "syncing")

    async def _targets_sd(self, _: web.Request) -> web.Response:
        return web.json_response(discovery.pod_targets(list(self.pods.values())))

    async def _events(self, kind: str) -> AsyncIterator[tuple[str, Obj]]:
        while True:
            try:
                async for event in self.kube.watch("v1", kind):
                    yield event
            except (ApiError, aiohttp.ClientError, TimeoutError) as e:
                self.log(f"watch {kind}: {e!r}; retrying")
                await asyncio.sleep(1)

    async def _watch_services(self) -> None:
        async for kind, obj in self._events("Service"):
            if kind == "SYNC":
                self.services = {_key(s): s for s in obj["items"]}
                self.services_synced.set()
            elif kind == "DELETED":
                self.services.pop(_key(obj), None)
            else:
                self.services[_key(obj)] = obj
            self._network_changed.set()

    async def _watch_pods(self) -> None:
        async for kind, obj in self._events("Pod"):
            if kind == "SYNC":
                self.pods = {p["metadata"]["uid"]: p for p in obj["items"]}
                for uid in list(self.workers):
                    if uid not in self.pods:
                        self.workers[uid].gone()
                for pod in obj["items"]:
                    self._dispatch(pod)
                if not self.pods_synced.is_set():
                    self.log(f"synced {len(obj['items'])} pods; running those on the fake nodes")
                self.pods_synced.set()
            elif kind == "DELETED":
                uid = obj["metadata"]["uid"]
                self.pods.pop(uid, None)
                if uid in self.workers:
                    self.workers[uid].gone()
            else:
                self.pods[obj["metadata"]["uid"]] = obj
                self._dispatch(obj)
            self._network_changed.set()

    def _dispatch(self, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        if worker := self.workers.get(uid):
            worker.update(pod)
        elif pod["spec"].get("nodeName") and not (_finished(pod) and not pod["metadata"].get("deletionTimestamp")):
            # A pod of the same name before this one (a StatefulSet's successor after a
            # force delete) no longer exists in the API: stop it, and start this one's
            # containers only once its processes are gone.
            predecessor = self.by_name.get(_key(pod))
            if predecessor is not None:
                predecessor.gone()
            self.workers[uid] = self.by_name[_key(pod)] = PodWorker(self, pod, predecessor=predecessor)

    def forget(self, worker: PodWorker) -> None:
        self.workers.pop(worker.uid, None)
        self._hosts.pop(worker.uid, None)
        if self.by_name.get((worker.namespace, worker.name)) is worker:
            del self.by_name[(worker.namespace, worker.name)]

    async def node_allocatable(self, name: str) -> dict[str, str]:
        if name not in self._nodes:
            node = await self.kube.get("v1", "Node", name)
            self._nodes[name] = (node or {}).get("status", {}).get("allocatable", {})
        return self._nodes[name]

    async def event(self, pod: Obj, kind: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        stamp = now()
        with contextlib.suppress(ApiError, aiohttp.ClientError, TimeoutError):
            await self.kube.create({
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": meta["uid"]},
                "reason": reason, "message": message, "type": kind, "count": 1,
                "firstTimestamp": stamp, "lastTimestamp": stamp,
                "source": {"component": "kubelet", "host": pod["spec"].get("nodeName", "")},
            })

    # --- Services and DNS ------------------------------------------------------------

    def hosts_for(self, pod: Obj) -> str:
        return network.hosts_file(pod, list(self.services.values()), list(self.pods.values()))

    def _targets(self, service_port: forwarder.ServicePort) -> list[forwarder.Address]:
        namespace, name, port = service_port
        if (namespace, name) == KUBERNETES_SERVICE:
            return [self.apiserver]
        svc = self.services.get((namespace, name))
        if svc is None:
            return []
        spec_port = next((p for p in svc["spec"].get("ports", []) if p["port"] == port), None)
        if spec_port is None:
            return []
        return [(e.ip, e.port) for e in network.endpoints(svc, spec_port, list(self.pods.values()))]

    async def _network(self) -> None:
        """Keeps the ClusterIP listeners and every running pod's hosts file current."""
        while True:
            await self._network_changed.wait()
            await asyncio.sleep(0.05)  # one pass for a burst of events
            self._network_changed.clear()
            wanted: dict[forwarder.Address, forwarder.ServicePort] = {}
            for (ns, name), svc in self.services.items():
                ip = svc["spec"].get("clusterIP")
                if not ip or ip == "None":
                    continue
                for p in svc["spec"].get("ports", []):
                    if p.get("protocol", "TCP") == "TCP":
                        wanted[(ip, p["port"])] = (ns, name, p["port"])
            await self.proxy.sync(wanted)
            for uid, worker in list(self.workers.items()):
                if not worker.hosts_path.exists():
                    continue
                text = self.hosts_for(worker.pod)
                if self._hosts.get(uid) != text:
                    worker.write_hosts(text)
                    self._hosts[uid] = text
