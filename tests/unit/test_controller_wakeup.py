"""A worker wakes at least every autoscaling interval: the control law's timers (a
scale-down wanted for the stabilization window) assume it runs that often, and discard
themselves after a longer gap. And one worker per name follows the object that holds the
name now."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pdcluster import controller as controller_module
from pdcluster.controller import Controller, wake_after


def auto(**fields: object) -> dict:
    return {"spec": {"autoscaling": fields}}


def test_resync_without_autoscaling() -> None:
    assert wake_after({"spec": {}}, 30.0) == 30.0
    assert wake_after(auto(enabled=False, intervalSeconds=10), 30.0) == 30.0


def test_autoscaling_interval_when_shorter() -> None:
    assert wake_after(auto(enabled=True, intervalSeconds=10), 30.0) == 10.0
    assert wake_after(auto(enabled=True, intervalSeconds=60), 30.0) == 30.0
    assert wake_after(auto(enabled=True), 30.0) == 30.0


# ---------------------------------------------------------------------- same name, new object
class _Status:
    def wire(self) -> dict:
        return {}


def body(uid: str, deleting: bool = False) -> dict:
    meta = {"namespace": "ns", "name": "pd", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {}}


async def test_a_recreated_pdcluster_keeps_its_worker_when_the_old_ones_events_come_late(
    monkeypatch: pytest.MonkeyPatch, wait_until: Callable[..., Awaitable[Any]]
) -> None:
    """kopf handles objects (uids) concurrently, so the deleted object's last events can
    follow its successor's first: they must not stop the successor's reconciles."""
    reconciled: list[str] = []

    async def fake_reconcile(context: object, body: dict) -> _Status:
        reconciled.append(body["metadata"]["uid"])
        return _Status()

    monkeypatch.setattr(controller_module, "reconcile", fake_reconcile)
    controller = Controller(context=None, resync=3600)  # type: ignore[arg-type]
    controller.observe(body("old"))
    controller.observe(body("new"))  # recreated under the same name
    controller.observe(body("old", deleting=True))  # the old one's late update
    controller.forget("ns", "pd", "old")  # and its late DELETED
    worker = controller.workers[("ns", "pd")]
    assert worker.uid == "new" and not worker.task.done()
    await wait_until(lambda: reconciled, interval=0.02, message="the first reconcile")
    assert reconciled == ["new"]

    controller.forget("ns", "pd", "new")
    assert ("ns", "pd") not in controller.workers
    await asyncio.wait_for(asyncio.gather(worker.task, return_exceptions=True), 5)
    assert worker.task.cancelled()
    await controller.close()


# ---------------------------------------------------------------------- who reconciles first
async def test_a_pdcluster_waiting_for_its_first_status_goes_first() -> None:
    slots = controller_module.Slots(1)
    order: list[str] = []
    hold = asyncio.Event()

    async def run(name: str, urgent: bool) -> None:
        async with slots.take(urgent):
            order.append(name)
            if name == "holder":
                await hold.wait()

    holder = asyncio.create_task(run("holder", False))
    await asyncio.sleep(0)
    later = [
        asyncio.create_task(run(n, u)) for n, u in (("resync-1", False), ("new", True), ("resync-2", False))
    ]
    cancelled = asyncio.create_task(run("gone", True))
    await asyncio.sleep(0)
    cancelled.cancel()  # a worker stopped while waiting gives up its place, not a slot
    hold.set()
    await asyncio.gather(holder, *later)
    assert order == ["holder", "new", "resync-1", "resync-2"]
    assert slots.free == 1
