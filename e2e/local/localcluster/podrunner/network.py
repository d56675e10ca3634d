"""Service endpoints and per-pod hosts files, computed from Pods and Services. Pure.

The apiserver refuses loopback addresses in EndpointSlices (ValidateEndpointIP in
pkg/apis/core/validation), so the endpoint slice controller cannot publish our 127.x
pods; endpoints are derived here the way that controller derives them (selector, pod
IP, Ready condition, publishNotReadyAddresses, named target ports).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]
CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True)
class Endpoint:
    ip: str
    port: int
    pod: str
    ready: bool


def is_ready(pod: Obj) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def is_headless(service: Obj) -> bool:
    return service["spec"].get("clusterIP") == "None"


def _selects(service: Obj, pod: Obj) -> bool:
    selector = service["spec"].get("selector")
    if not selector or pod["metadata"]["namespace"] != service["metadata"]["namespace"]:
        return False
    labels = pod["metadata"].get("labels", {})
    return all(labels.get(k) == v for k, v in selector.items())


def _target_port(service_port: Obj, pod: Obj) -> int | None:
    target = service_port.get("targetPort", service_port["port"])
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in pod["spec"].get("containers", []):
        for port in container.get("ports", []):
            if port.get("name") == target:
                return int(port["containerPort"])
    return None


def _serves(service: Obj, pod: Obj) -> bool:
    """Ready pods, or all running ones with publishNotReadyAddresses; never terminating
    or finished ones."""
    status = pod.get("status", {})
    if not status.get("podIP") or pod["metadata"].get("deletionTimestamp"):
        return False
    if status.get("phase") in ("Succeeded", "Failed"):
        return False
    return is_ready(pod) or bool(service["spec"].get("publishNotReadyAddresses"))


def endpoints(service: Obj, service_port: Obj, pods: list[Obj]) -> list[Endpoint]:
    result = []
    for pod in pods:
        if _selects(service, pod) and _serves(service, pod):
            port = _target_port(service_port, pod)
            if port is not None:
                result.append(Endpoint(pod["status"]["podIP"], port, pod["metadata"]["name"], is_ready(pod)))
    return sorted(result, key=lambda e: e.pod)


def _names(name: str, namespace: str, own_namespace: str) -> list[str]:
    names = [f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{name}.{namespace}.svc", f"{name}.{namespace}"]
    return names + ([name] if namespace == own_namespace else [])


def pod_hostname(pod: Obj) -> str:
    return (pod["spec"].get("hostname") or pod["metadata"]["name"])[:63]


def hosts_file(pod: Obj, services: list[Obj], pods: list[Obj]) -> str:
    """What cluster DNS would answer, as a hosts file: ClusterIP Services, the ready pods
    of headless Services, and <hostname>.<subdomain> pod records."""
    own_ns = pod["metadata"]["namespace"]
    hostname = pod_hostname(pod)
    own = [hostname]
    if subdomain := pod["spec"].get("subdomain"):
        own.insert(0, f"{hostname}.{subdomain}.{own_ns}.svc.{CLUSTER_DOMAIN}")
    lines = [
        "# Kubernetes-managed hosts file (local cluster pod runner).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    # A pod that is being torn down may already have lost its IP in the status.
    if pod_ip := pod.get("status", {}).get("podIP"):
        lines.append(f"{pod_ip}\t{' '.join(own)}")
    for svc in sorted(services, key=lambda s: (s["metadata"]["namespace"], s["metadata"]["name"])):
        meta = svc["metadata"]
        names = _names(meta["name"], meta["namespace"], own_ns)
        if not is_headless(svc):
            if ip := svc["spec"].get("clusterIP"):
                lines.append(f"{ip}\t{' '.join(names)}")
            continue
        for member in pods:
            if not (_selects(svc, member) and _serves(svc, member)):
                continue
            ip = member["status"]["podIP"]
            lines.append(f"{ip}\t{' '.join(names)}")
            if member["spec"].get("hostname") and member["spec"].get("subdomain") == meta["name"]:
                pod_name = f"{pod_hostname(member)}.{meta['name']}"
                lines.append(f"{ip}\t{' '.join(_names(pod_name, meta['namespace'], own_ns))}")
    return "\n".join(lines) + "\n"
