"""The operator's own PDCluster watch (follow.py): a list observes every PDCluster and
forgets those gone meanwhile; events observe and forget; a failed watch (an apiserver
restarting) lists again instead of stopping, as kopf's watch of a resource its discovery
missed did."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pdcluster import controller as controller_module
from pdcluster import follow as follow_module
from pdcluster.controller import Controller
from pdcluster.io.kube import ApiError


class _Status:
    def wire(self) -> dict:
        return {}


def body(name: str, generation: int = 1) -> dict:
    meta = {"namespace": "ns", "name": name, "uid": name, "generation": generation, "managedFields": [{}]}
    return {"metadata": meta, "spec": {"generation": generation}}


class _Apiserver:
    """Kube.watch as follow() sees it: each call one scripted session, ended by an error
    (an apiserver restarting) or left open."""

    def __init__(self, sessions: list[list[tuple[str, dict] | Exception]]):
        self.sessions = sessions
        self.calls = 0

    async def watch(self, api_version: str, kind: str, namespace: str | None):
        session = self.sessions[self.calls] if self.calls < len(self.sessions) else []
        self.calls += 1
        for step in session:
            if isinstance(step, Exception):
                raise step
            yield step
        await asyncio.Event().wait()


async def test_lists_events_and_a_failed_watch(
    monkeypatch: pytest.MonkeyPatch, wait_until: Callable[..., Awaitable[Any]]
) -> None:
    async def fake_reconcile(context: object, body: dict) -> _Status:
        return _Status()

    monkeypatch.setattr(controller_module, "reconcile", fake_reconcile)
    monkeypatch.setattr(follow_module, "RETRY_SECONDS", 0.01)
    controller = Controller(context=None, resync=3600)  # type: ignore[arg-type]
    controller.observe(body("gone"))  # known before the list, deleted while unwatched
    apiserver = _Apiserver(
        [
            [
                ("SYNC", {"items": [body("a"), body("b")]}),
                ("DELETED", body("b")),
                ApiError(503, "ServiceUnavailable", "the request has been made before all known HTTP paths"),
            ],
            [ApiError(404, "NotFound", "the server could not find the requested resource")],
            [("SYNC", {"items": [body("a", 2)]}), ("ADDED", body("c"))],
        ]
    )
    task = asyncio.create_task(follow_module.follow(apiserver, ["ns"], controller))  # type: ignore[arg-type]
    try:
        await wait_until(lambda: ("ns", "c") in controller.workers, interval=0.01, message="c observed")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert apiserver.calls == 3  # listed again after each failure
    assert set(controller.workers) == {("ns", "a"), ("ns", "c")}
    assert controller.workers[("ns", "a")].body["spec"] == {"generation": 2}  # the change after the failure
    assert "managedFields" not in controller.workers[("ns", "a")].body["metadata"]
    await controller.close()
