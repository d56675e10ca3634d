"""The pod runner keys pods by uid: a successor of the same name waits for its predecessor's
processes, and the predecessor stops writing status (pure parts, no processes started)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from localcluster.podrunner import pod as podmod
from localcluster.podrunner import runner as runnermod


def _pod(uid: str, name: str = "demo-prefill-0") -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "name": name, "namespace": "demo"},
        "spec": {"nodeName": "gpu-0", "containers": [], "terminationGracePeriodSeconds": 0},
    }


class FakeWorker:
    def __init__(self, runner: Any, pod: dict[str, Any], predecessor: Any = None):
        self.uid, self.predecessor, self.gone_called = pod["metadata"]["uid"], predecessor, False
        self.namespace, self.name = pod["metadata"]["namespace"], pod["metadata"]["name"]

    def update(self, pod: dict[str, Any]) -> None:
        pass

    def gone(self) -> None:
        self.gone_called = True


def test_a_new_uid_of_a_known_name_is_its_predecessors_successor(monkeypatch):
    monkeypatch.setattr(runnermod, "PodWorker", FakeWorker)
    runner = SimpleNamespace(workers={}, by_name={}, _hosts={})
    dispatch = runnermod.Runner._dispatch.__get__(runner)
    dispatch(_pod("uid-a"))
    first = runner.workers["uid-a"]
    assert first.predecessor is None
    dispatch(_pod("uid-a"))  # an update of the same pod is not a successor
    assert runner.workers["uid-a"] is first and not first.gone_called

    dispatch(_pod("uid-b"))
    second = runner.workers["uid-b"]
    assert second.predecessor is first and first.gone_called
    assert runner.by_name[("demo", "demo-prefill-0")] is second
    # The predecessor finishing does not unlink the successor from its name.
    runnermod.Runner.forget(runner, first)
    assert runner.by_name[("demo", "demo-prefill-0")] is second and "uid-a" not in runner.workers


def _successor(predecessor: Any) -> Any:
    return SimpleNamespace(
        predecessor=predecessor, stopping=asyncio.Event(), namespace="demo", name="demo-prefill-0",
        runner=SimpleNamespace(log=lambda message: None),
    )


def _predecessor() -> Any:
    old = SimpleNamespace(uid="uid-a", pod=_pod("uid-a"), finished=asyncio.Event(), killed=False)

    async def kill_now() -> None:
        old.killed = True
        old.finished.set()

    old.kill_now = kill_now
    return old


async def test_the_successor_starts_after_its_predecessor_has_finished(monkeypatch):
    monkeypatch.setattr(podmod, "PREDECESSOR_SLACK", 5.0)
    old = _predecessor()
    new = _successor(old)
    waiting = asyncio.create_task(podmod.PodWorker._await_predecessor(new, until_stopped=True))
    await asyncio.sleep(0)
    assert not waiting.done()  # still waiting: the old processes hold the port
    old.finished.set()
    # The deadline only ends a broken test: a wait that ran out the slack kills the old pod.
    await asyncio.wait_for(waiting, 30)
    assert not old.killed and new.predecessor is None


async def test_a_predecessor_that_outlives_its_grace_is_killed(monkeypatch):
    monkeypatch.setattr(podmod, "PREDECESSOR_SLACK", 0.0)
    old = _predecessor()
    await asyncio.wait_for(podmod.PodWorker._await_predecessor(_successor(old), until_stopped=True), 30)
    assert old.killed


async def test_a_successor_stopped_while_waiting_is_finished_only_after_its_predecessor(monkeypatch):
    monkeypatch.setattr(podmod, "PREDECESSOR_SLACK", 5.0)
    old = _predecessor()
    middle = _successor(old)
    middle.stopping.set()  # deleted again while it waited
    await asyncio.wait_for(podmod.PodWorker._await_predecessor(middle, until_stopped=True), 30)
    assert middle.predecessor is old  # it stopped waiting to start, not waiting for the old pod
    finishing = asyncio.create_task(podmod.PodWorker._await_predecessor(middle, until_stopped=False))
    await asyncio.sleep(0)
    assert not finishing.done()
    old.finished.set()
    await asyncio.wait_for(finishing, 30)
    assert middle.predecessor is None and not old.killed


@pytest.mark.parametrize(
    ("status", "message", "result"),
    [
        (404, "not found", "gone"),
        (409, "Conflict", "gone"),
        (422, 'Pod "demo-prefill-0" is invalid: metadata.uid: Invalid value: field is immutable', "gone"),
        (422, "spec.containers: Invalid", "retry"),
        (500, "etcd timeout", "retry"),
    ],
)
async def test_status_writes_stop_once_the_name_is_a_newer_pods(status, message, result):
    async def request(*args: Any, **kwargs: Any) -> None:
        raise podmod.ApiError(status, "Reason", message)

    worker = SimpleNamespace(
        _dirty=asyncio.Event(),
        namespace="demo",
        name="demo-prefill-0",
        runner=SimpleNamespace(kube=SimpleNamespace(request=request), log=lambda message: None),
        _status_patch=lambda: {},
    )
    assert await podmod.PodWorker._flush_status(worker) == result
