"""Prometheus targets for the cluster's pods, served over HTTP service discovery.

Debian's prometheus is built without Kubernetes discovery (no kubernetes_sd_configs), so
the pod runner publishes what `kubernetes_sd_configs: [{role: pod}]` would: one target
per container port (one per pod without ports) carrying the same __meta_kubernetes_pod_*
labels, and the relabelling written for a real cluster works unchanged. Pure.
"""

from __future__ import annotations

import re
from typing import Any

Obj = dict[str, Any]
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def _sanitize(name: str) -> str:
    return _INVALID.sub("_", name)


def _pod_labels(pod: Obj) -> dict[str, str]:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    ready = next((c["status"] for c in status.get("conditions", []) if c["type"] == "Ready"), "unknown")
    labels = {
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_ip": status.get("podIP", ""),
        "__meta_kubernetes_pod_ready": ready.lower(),
        "__meta_kubernetes_pod_phase": status.get("phase", ""),
        "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
        "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
        "__meta_kubernetes_pod_uid": meta.get("uid", ""),
    }
    if owner := next((o for o in meta.get("ownerReferences", []) if o.get("controller")), None):
        labels["__meta_kubernetes_pod_controller_kind"] = owner["kind"]
        labels["__meta_kubernetes_pod_controller_name"] = owner["name"]
    for kind, values in (("label", meta.get("labels", {})), ("annotation", meta.get("annotations", {}))):
        for key, value in values.items():
            labels[f"__meta_kubernetes_pod_{kind}_{_sanitize(key)}"] = value
            labels[f"__meta_kubernetes_pod_{kind}present_{_sanitize(key)}"] = "true"
    return labels


def pod_targets(pods: list[Obj]) -> list[Obj]:
    """Target groups in the HTTP SD format ([{"targets": [...], "labels": {...}}])."""
    groups = []
    for pod in sorted(pods, key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"])):
        ip = pod.get("status", {}).get("podIP")
        if not ip:
            continue
        base = _pod_labels(pod)
        for init, containers in ((False, pod["spec"]["containers"]), (True, pod["spec"].get("initContainers", []))):
            for c in containers:
                container = {
                    **base,
                    "__meta_kubernetes_pod_container_name": c["name"],
                    "__meta_kubernetes_pod_container_image": c["image"],
                    "__meta_kubernetes_pod_container_init": str(init).lower(),
                }
                ports = c.get("ports", [])
                if not ports and not init:
                    groups.append({"targets": [ip], "labels": container})
                for p in ports:
                    groups.append({"targets": [f"{ip}:{p['containerPort']}"], "labels": {
                        **container,
                        "__meta_kubernetes_pod_container_port_name": p.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(p["containerPort"]),
                        "__meta_kubernetes_pod_container_port_protocol": p.get("protocol", "TCP"),
                    }})
    return groups
