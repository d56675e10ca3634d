"""The Controller at the operator's SIGTERM: no reconcile starts any more, one in flight
may finish within the grace period and is cancelled after it, idle workers end at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pdcluster import controller as controller_module
from pdcluster.controller import Controller


class _Status:
    def wire(self) -> dict:
        return {}


def body(name: str) -> dict:
    return {"metadata": {"namespace": "ns", "name": name, "uid": name}, "spec": {}}


class FakeReconcile:
    """Reconciles that block until released; records which started and which finished."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: list[str] = []
        self.release = asyncio.Event()

    async def __call__(self, context: object, body: dict) -> _Status:
        name = body["metadata"]["name"]
        self.started.append(name)
        await self.release.wait()
        self.finished.append(name)
        return _Status()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeReconcile:
    fake = FakeReconcile()
    monkeypatch.setattr(controller_module, "reconcile", fake)
    return fake


async def test_a_reconcile_in_flight_finishes_and_no_other_starts(
    fake: FakeReconcile, wait_until: Callable[..., Awaitable[Any]]
) -> None:
    # One slot: "a" reconciles, "b" waits for the slot when the stop comes.
    controller = Controller(context=None, resync=3600, concurrency=1)  # type: ignore[arg-type]
    controller.observe(body("a"))
    await wait_until(lambda: fake.started, interval=0.02, message="a reconcile in flight")
    controller.observe(body("b"))
    closing = asyncio.create_task(controller.close(grace=60))
    await wait_until(lambda: controller.closing, interval=0.02, message="closing")
    controller.observe(body("c"))  # an event after the stop starts no worker
    fake.release.set()
    await asyncio.wait_for(closing, 30)
    assert fake.started == ["a"] and fake.finished == ["a"]
    assert controller.workers == {}


async def test_a_reconcile_past_the_grace_period_is_cancelled(
    fake: FakeReconcile, wait_until: Callable[..., Awaitable[Any]]
) -> None:
    controller = Controller(context=None, resync=3600)  # type: ignore[arg-type]
    controller.observe(body("slow"))
    await wait_until(lambda: fake.started, interval=0.02, message="a reconcile in flight")
    worker = controller.workers[("ns", "slow")]
    # The fake never finishes (release is never set): close returns only by cancelling it.
    await asyncio.wait_for(controller.close(grace=0.1), 30)
    assert worker.task.cancelled()
    assert fake.finished == []


async def test_idle_workers_end_without_waiting_for_the_grace_period(
    fake: FakeReconcile, wait_until: Callable[..., Awaitable[Any]]
) -> None:
    fake.release.set()
    controller = Controller(context=None, resync=3600)  # type: ignore[arg-type]
    for name in ("a", "b", "c"):
        controller.observe(body(name))
    await wait_until(lambda: len(fake.finished) == 3, interval=0.02, message="three reconciles")
    workers = list(controller.workers.values())
    # Idle, they are cancelled at once: a grace period of an hour is not waited for.
    await asyncio.wait_for(controller.close(grace=3600), 30)
    assert all(w.task.cancelled() for w in workers)
