"""The operator's own metrics: a deleted PDCluster leaves no series behind."""

from prometheus_client import generate_latest

from pdcluster import metrics


def _exposed(name: str) -> bool:
    return f'pdcluster="{name}"' in generate_latest().decode()


def test_forget_drops_every_series_of_a_cluster() -> None:
    metrics.DESIRED_REPLICAS.labels("ns", "gone", "prefill").set(2)
    metrics.DESIRED_REPLICAS.labels("ns", "gone", "decode").set(3)
    metrics.DESIRED_REPLICAS.labels("ns", "gone", "colocated").set(4)  # it was colocated once
    for action in metrics.DECISION_ACTIONS:
        metrics.DECISIONS.labels("ns", "gone", action, "WithinTargets").inc()
    metrics.DECISIONS.labels("ns", "gone", "scale", "TTFTOverTarget").inc()
    metrics.DESIRED_REPLICAS.labels("ns", "kept", "prefill").set(1)
    assert _exposed("gone")

    metrics.forget("ns", "gone")

    assert not _exposed("gone")
    assert _exposed("kept")
    metrics.forget("ns", "gone")  # twice, or never observed: nothing to remove, no error
    metrics.forget("ns", "kept")
