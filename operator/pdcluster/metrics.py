"""The operator's own Prometheus metrics (served on --metrics-port)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

from pdcluster import __version__
from pdcluster import constants as C
from pdcluster import observability as O
from pdcluster.control.cause import Cause

RECONCILES = Counter(O.OPERATOR_RECONCILES, "Reconciles of PDClusters by result", ["result"])
RECONCILE_SECONDS = Histogram(
    O.OPERATOR_RECONCILE_SECONDS,
    "Time one reconcile takes",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
DECISION_ACTIONS = ("scale", "hold", "recommend")
DECISIONS = Counter(
    O.OPERATOR_DECISIONS,
    "Autoscaling decisions by action and cause",
    ["pdcluster_namespace", "pdcluster", "action", "cause"],
)
BUILD_INFO = Gauge(O.BUILD_INFO, "The running build: always 1", ["version", "component"])
BUILD_INFO.labels(__version__, "operator").set(1)
DESIRED_REPLICAS = Gauge(
    O.OPERATOR_DESIRED_REPLICAS,
    "Replicas the operator wants per role",
    ["pdcluster_namespace", "pdcluster", "role"],
)


def observe_reconcile(result: str, seconds: float) -> None:
    RECONCILES.labels(result).inc()
    RECONCILE_SECONDS.observe(seconds)


def forget(namespace: str, name: str) -> None:
    """Drop a deleted PDCluster's series, so that churn does not grow the exposition."""
    for role in (*C.ENGINE_ROLES, C.ROLE_COLOCATED, C.ROLE_FLEXIBLE):
        with contextlib.suppress(KeyError):
            DESIRED_REPLICAS.remove(namespace, name, role)
    for action in DECISION_ACTIONS:
        for cause in Cause:
            with contextlib.suppress(KeyError):
                DECISIONS.remove(namespace, name, action, cause.value)
