"""Event de-duplication: repeats are held back, and what it remembers stays bounded."""

import asyncio
from typing import Any

from pdcluster.io import events


class FakeKube:
    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.created.append(obj)
        return obj


def owner(uid: str) -> dict[str, Any]:
    return {"metadata": {"name": f"c-{uid}", "namespace": "ns", "uid": uid, "resourceVersion": "1"}}


def test_a_repeat_is_posted_once_per_period(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(events.time, "monotonic", lambda: clock[0])
    kube = FakeKube()
    recorder = events.EventRecorder(kube)  # type: ignore[arg-type]
    asyncio.run(recorder.warning(owner("a"), "Degraded", "x"))
    asyncio.run(recorder.warning(owner("a"), "Degraded", "x"))
    asyncio.run(recorder.warning(owner("a"), "Degraded", "y"))
    assert [e["message"] for e in kube.created] == ["x", "y"]
    clock[0] += events.REPEAT_AFTER_SECONDS
    asyncio.run(recorder.warning(owner("a"), "Degraded", "x"))
    assert [e["message"] for e in kube.created] == ["x", "y", "x"]


def test_memory_is_bounded_under_churn(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(events.time, "monotonic", lambda: clock[0])
    recorder = events.EventRecorder(FakeKube())  # type: ignore[arg-type]

    async def churn() -> None:
        for i in range(20 * events.PRUNE_AT):
            clock[0] += 1.0  # one new PDCluster a second, each with its own event
            await recorder.normal(owner(str(i)), "Created", "created")

    asyncio.run(churn())
    # Only the keys of the last repeat period are kept, give or take one pruning round.
    assert len(recorder._last) <= 2 * max(events.PRUNE_AT, events.REPEAT_AFTER_SECONDS)
