"""The local Kubernetes control plane for integration tests and the demo."""

from __future__ import annotations

from localcluster.cluster import State, down, load_state, restart, start_component, status, stop_component, up
from localcluster.nodes import NodePool

__all__ = ["NodePool", "State", "down", "load_state", "restart", "start_component", "status", "stop_component", "up"]
