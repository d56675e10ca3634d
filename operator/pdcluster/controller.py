"""Runs `reconcile` for every known PDCluster: level-based, one worker per cluster.

A worker reconciles on a wake-up (its PDCluster or one of its children changed) or
after `resync` seconds (the autoscaling interval, if shorter), whichever comes first,
and only while this replica leads.
Nothing here needs a finalizer: children are garbage-collected by owner references,
so a PDCluster can be deleted even when the operator is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import heapq
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from pdcluster import metrics
from pdcluster.io.kube import ApiError
from pdcluster.io.lease import LeaderElector
from pdcluster.reconcile import Context, reconcile

log = logging.getLogger(__name__)

# Child events arrive in bursts (one per object we apply); reconcile once per burst.
DEBOUNCE_SECONDS = 0.2
MAX_BACKOFF_SECONDS = 60.0
MAX_CONCURRENT_RECONCILES = 8  # each applies a few children at once: inside the client's pool (io/kube.py)


def wake_after(body: dict[str, Any], resync: float) -> float:
    """Seconds until a worker reconciles without an event: the resync period, or the
    autoscaling interval when shorter (the control law's timers, such as a scale-down
    wanted for the stabilization window, assume it runs every interval)."""
    autoscaling = (body.get("spec") or {}).get("autoscaling") or {}
    if autoscaling.get("enabled"):
        return min(resync, float(autoscaling.get("intervalSeconds") or resync))
    return resync


def transient(error: BaseException) -> bool:
    """An apiserver that is busy, restarting or slow: a retry, not a bug to trace."""
    if isinstance(error, ApiError):
        return error.status in (409, 429, 500, 502, 503, 504)
    return isinstance(error, (aiohttp.ClientError, TimeoutError, ConnectionError))


class Slots:
    """At most `size` reconciles at once, PDClusters whose status does not describe their
    current generation first: a thousand new PDClusters all get a first status before
    any of them is reconciled again for its children's status updates."""

    def __init__(self, size: int):
        self.free = size
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @contextlib.asynccontextmanager
    async def take(self, urgent: bool) -> AsyncIterator[None]:
        if self.free > 0 and not self._waiting:
            self.free -= 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (0 if urgent else 1, next(self._order), turn))
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._release()  # handed a slot while being cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():
                turn.set_result(None)
                return
        self.free += 1


def _urgent(body: dict[str, Any]) -> bool:
    """No status yet for the current spec: the user is waiting for this one."""
    observed = (body.get("status") or {}).get("observedGeneration")
    return observed is None or observed != body["metadata"].get("generation")


class Worker:
    def __init__(self, controller: Controller, key: tuple[str, str], body: dict[str, Any]):
        self.controller = controller
        self.key = key
        self.body = body
        self.wakeup = asyncio.Event()
        self.wakeup.set()
        self.uid = body["metadata"].get("uid")
        self.reconciling = False  # inside a reconcile, which shutdown lets finish
        self.task = asyncio.create_task(self._loop(), name=f"reconcile {key[0]}/{key[1]}")

    def stop(self) -> None:
        """No reconcile after the one in flight; an idle worker ends at once."""
        if not self.reconciling:
            self.task.cancel()

    async def _loop(self) -> None:
        backoff = 1.0
        while not self.controller.closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.wakeup.wait(), timeout=wake_after(self.body, self.controller.resync)
                )
            await asyncio.sleep(DEBOUNCE_SECONDS)
            self.wakeup.clear()
            if self.controller.elector is not None:
                await self.controller.elector.leading.wait()
            if self.controller.synced is not None:
                await self.controller.synced.wait()  # not before the children cache is whole
            try:
                async with self.controller.slots.take(_urgent(self.body)):
                    if self.controller.closing:
                        return  # handed a slot as the operator stops
                    self.reconciling = True
                    try:
                        status = await reconcile(self.controller.context, self.body)
                    finally:
                        self.reconciling = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep the worker alive; the next attempt may succeed
                metrics.RECONCILES.labels("error").inc()
                if transient(e):
                    log.warning("reconcile %s/%s: %s; retrying in %.0fs", *self.key, e, backoff)
                else:
                    log.exception("reconcile %s/%s failed; retrying in %.0fs", *self.key, backoff)
                if self.controller.closing:
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                self.wakeup.set()
                continue
            backoff = 1.0
            # Until the watch delivers our own status write, reconcile against it.
            self.body["status"] = status.wire()


class Controller:
    def __init__(
        self,
        context: Context,
        *,
        resync: float = 30.0,
        elector: LeaderElector | None = None,
        concurrency: int = MAX_CONCURRENT_RECONCILES,
        synced: asyncio.Event | None = None,
    ):
        self.context = context
        self.resync = resync
        self.elector = elector
        self.synced = synced  # reconciles wait for it: the children cache has listed
        # Thousands of wake-ups become at most this many reconciles (and their requests)
        # at once; each worker still reconciles its own cluster one at a time.
        self.slots = Slots(concurrency)
        self.workers: dict[tuple[str, str], Worker] = {}
        self.closing = False  # the operator is stopping: no reconcile starts any more

    # kopf handles each object's events in order, but objects (uids) concurrently: when a
    # PDCluster is deleted and created again under its name, the old one's last events
    # may be handled after the new one's first. Workers are keyed by name (their
    # children are), so the uid decides which object an event may act for.
    def observe(self, body: dict[str, Any]) -> None:
        """The PDCluster as the watch delivered it (created, changed, or listed again)."""
        if self.closing:
            return
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        worker = self.workers.get(key)
        body = copy.deepcopy(body)
        if worker is None or worker.task.done():
            self.workers[key] = Worker(self, key, body)
            return
        if worker.uid != meta.get("uid"):
            if meta.get("deletionTimestamp"):
                return  # a late event of the object this name had before
            worker.task.cancel()  # deleted and recreated under the same name
            self.workers[key] = Worker(self, key, body)
            return
        worker.body = body
        worker.wakeup.set()

    def forget(self, namespace: str, name: str, uid: str | None) -> None:
        """A PDCluster was deleted: stop its worker, unless the name has a new owner."""
        worker = self.workers.get((namespace, name))
        if worker is not None and uid is not None and worker.uid != uid:
            return
        self.workers.pop((namespace, name), None)
        if worker is not None:
            worker.task.cancel()
        metrics.forget(namespace, name)

    def wake(self, namespace: str, name: str) -> None:
        worker = self.workers.get((namespace, name))
        if worker is not None:
            worker.wakeup.set()

    async def close(self, grace: float = 0.0) -> None:
        """Stops every worker: none starts another reconcile, those in flight get `grace`
        seconds to finish and are then cancelled. A reconcile cut short is safe (the next
        operator redoes it, as after a crash); bounding it keeps the exit inside the pod's
        termination grace period, however many PDClusters are reconciling."""
        self.closing = True
        workers = list(self.workers.values())
        for worker in workers:
            worker.stop()
        tasks = [w.task for w in workers if not w.task.done()]
        if tasks and grace > 0:
            _, late = await asyncio.wait(tasks, timeout=grace)
            if late:
                log.warning("%d reconcile(s) still running %.0fs after the stop: cancelled", len(late), grace)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.workers.clear()
