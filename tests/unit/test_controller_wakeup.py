"""A worker wakes at least every autoscaling interval: the control law's timers (a
scale-down wanted for the stabilization window) assume it runs that often, and discard
themselves after a longer gap."""

from __future__ import annotations

from pdcluster.controller import wake_after


def auto(**fields: object) -> dict:
    return {"spec": {"autoscaling": fields}}


def test_resync_without_autoscaling() -> None:
    assert wake_after({"spec": {}}, 30.0) == 30.0
    assert wake_after(auto(enabled=False, intervalSeconds=10), 30.0) == 30.0


def test_autoscaling_interval_when_shorter() -> None:
    assert wake_after(auto(enabled=True, intervalSeconds=10), 30.0) == 10.0
    assert wake_after(auto(enabled=True, intervalSeconds=60), 30.0) == 30.0
    assert wake_after(auto(enabled=True), 30.0) == 30.0
