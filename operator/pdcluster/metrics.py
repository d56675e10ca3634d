"""The operator's own Prometheus metrics (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from pdcluster import observability as O

RECONCILES = Counter(O.OPERATOR_RECONCILES, "Reconciles of PDClusters by result", ["result"])
RECONCILE_SECONDS = Histogram(
    O.OPERATOR_RECONCILE_SECONDS,
    "Time one reconcile takes",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
DECISIONS = Counter(
    O.OPERATOR_DECISIONS, "Autoscaling decisions by action", ["pdcluster_namespace", "pdcluster", "action"]
)
DESIRED_REPLICAS = Gauge(
    O.OPERATOR_DESIRED_REPLICAS,
    "Replicas the operator wants per role",
    ["pdcluster_namespace", "pdcluster", "role"],
)


def observe_reconcile(result: str, seconds: float) -> None:
    RECONCILES.labels(result).inc()
    RECONCILE_SECONDS.observe(seconds)
