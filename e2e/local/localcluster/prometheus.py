"""Prometheus configuration: the prometheus.io/* annotation convention and the project's
pdcluster/role labels, relabelled from the meta labels of Kubernetes pod discovery.

The targets come from the pod runner over HTTP service discovery (Debian's prometheus
has no Kubernetes discovery built in; see podrunner/discovery.py); on a real cluster the
same relabel_configs go under `kubernetes_sd_configs: [{role: pod}]`."""

from __future__ import annotations

from typing import Any


def _label_meta(label: str) -> str:
    """Prometheus' meta label for a pod label: every non-alphanumeric becomes '_'."""
    return "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in label)


def config(*, targets_url: str, scrape_interval: str) -> dict[str, Any]:
    relabel = [
        {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "action": "keep", "regex": "true"},
        {"source_labels": ["__meta_kubernetes_pod_phase"], "action": "drop", "regex": "Pending|Succeeded|Failed"},
        {
            "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"],
            "regex": "(.+)",
            "target_label": "__metrics_path__",
        },
        {
            "source_labels": ["__meta_kubernetes_pod_ip", "__meta_kubernetes_pod_annotation_prometheus_io_port"],
            "regex": "(.+);([0-9]+)",
            "replacement": "$1:$2",
            "target_label": "__address__",
        },
        {"source_labels": [_label_meta("pdcluster.io/cluster")], "target_label": "pdcluster"},
        {"source_labels": [_label_meta("pdcluster.io/role")], "target_label": "role"},
        # A flexible engine's series go under the role it acts as now (when it has one).
        {"source_labels": [_label_meta("pdcluster.io/acting-role")], "regex": "(.+)", "target_label": "role"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]
    return {
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [
            {
                "job_name": "pods",
                "http_sd_configs": [{"url": targets_url, "refresh_interval": "1s"}],
                "relabel_configs": relabel,
            }
        ],
    }
