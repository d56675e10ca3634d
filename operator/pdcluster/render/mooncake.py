"""The Mooncake master (with its optional HTTP metadata server) and optional store pods.

Flags and ports follow Mooncake's deployment guide (docs/source/deployment/
mooncake-store-deployment-guide.md): RPC 50051, metrics and /health on 9003, HTTP
metadata 8080. Clients are configured through the documented MOONCAKE_* environment,
rendered once into a ConfigMap that engine and store pods load with envFrom; each pod
adds its own MOONCAKE_LOCAL_HOSTNAME (the default, localhost, is wrong in a pod).
"""

from __future__ import annotations

import math
from typing import Any

from pdcluster import constants as C
from pdcluster.api.base import quantity
from pdcluster.api.v1alpha1 import PDClusterSpec, Resources
from pdcluster.render.names import (
    Owner,
    env_field,
    labels,
    metadata,
    restricted_container,
    restricted_pod,
    scrape_annotations,
    selector,
)


def config_map_name(owner: Owner) -> str:
    return owner.child("mooncake")


def master_address(spec: PDClusterSpec, owner: Owner) -> str:
    return f"{owner.child(C.ROLE_MOONCAKE_MASTER)}:{spec.mooncake.rpc_port}"


def _size(value: int | str) -> str:
    """Bytes, as Mooncake parses sizes (plain counts or '10gb', not Kubernetes' 'Gi'),
    rounded up as Kubernetes rounds a quantity's value. The CRD admits only quantities."""
    size = quantity(value)
    return str(math.ceil(size)) if size is not None else str(value)


def config_map(spec: PDClusterSpec, owner: Owner) -> dict[str, Any]:
    m = spec.mooncake
    host = owner.child(C.ROLE_MOONCAKE_MASTER)
    metadata_server = (
        f"http://{host}:{m.http_metadata_port}/metadata" if m.http_metadata_server else "P2PHANDSHAKE"
    )
    data = {
        "MOONCAKE_MASTER": master_address(spec, owner),
        "MOONCAKE_TE_META_DATA_SERVER": metadata_server,
        "MOONCAKE_PROTOCOL": spec.kv_protocol.value,
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": _size(m.store.global_segment_size),
        "MOONCAKE_LOCAL_BUFFER_SIZE": _size(m.store.local_buffer_size),
    }
    devices = spec.kv_transfer.devices or ",".join(spec.rdma.hcas)
    if devices:
        data["MOONCAKE_DEVICE"] = devices
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, C.ROLE_MOONCAKE_MASTER, name=config_map_name(owner)),
        "data": data,
    }


def _resources(res: Resources | None) -> dict[str, Any]:
    return res.wire() if res else {}


def master_args(spec: PDClusterSpec) -> list[str]:
    m = spec.mooncake
    args = [
        "--rpc_address=$(POD_IP)",
        f"--rpc_port={m.rpc_port}",
        f"--metrics_port={m.metrics_port}",
        f"--default_kv_lease_ttl={m.lease_ttl_ms}",
        f"--eviction_high_watermark_ratio={m.eviction_high_watermark_percent / 100:g}",
        f"--eviction_ratio={m.eviction_percent / 100:g}",
    ]
    if m.http_metadata_server:
        args += [
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=$(POD_IP)",
            f"--http_metadata_server_port={m.http_metadata_port}",
        ]
    return args


def master_deployment(spec: PDClusterSpec, owner: Owner, replicas: int) -> dict[str, Any]:
    m = spec.mooncake
    role = C.ROLE_MOONCAKE_MASTER
    ports = [
        {"name": "rpc", "containerPort": m.rpc_port, "protocol": "TCP"},
        {"name": "metrics", "containerPort": m.metrics_port, "protocol": "TCP"},
    ]
    if m.http_metadata_server:
        ports.append({"name": "metadata", "containerPort": m.http_metadata_port, "protocol": "TCP"})

    def health(failures: int, delay: int = 0) -> dict[str, Any]:
        return {
            "httpGet": {"path": "/health", "port": "metrics"},
            "initialDelaySeconds": delay,
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": failures,
        }

    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, role),
        "spec": {
            "replicas": replicas,
            # One master owns the metadata; never run two side by side during a rollout.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(owner, role)},
            "template": {
                "metadata": {
                    "labels": labels(owner, role),
                    "annotations": scrape_annotations(m.metrics_port),
                },
                "spec": {
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "securityContext": restricted_pod(),
                    "containers": [
                        {
                            "name": "master",
                            "image": m.image or spec.engine.image,
                            "imagePullPolicy": spec.engine.image_pull_policy,
                            "command": ["mooncake_master"],
                            "args": master_args(spec),
                            "env": [env_field("POD_IP", "status.podIP")],
                            "ports": ports,
                            "readinessProbe": health(3),
                            "livenessProbe": health(6, delay=10),
                            "resources": _resources(m.resources),
                            "securityContext": restricted_container(),
                        }
                    ],
                },
            },
        },
    }


def master_service(spec: PDClusterSpec, owner: Owner) -> dict[str, Any]:
    m = spec.mooncake
    role = C.ROLE_MOONCAKE_MASTER
    ports = [
        {"name": "rpc", "port": m.rpc_port, "targetPort": "rpc", "protocol": "TCP"},
        {"name": "metrics", "port": m.metrics_port, "targetPort": "metrics", "protocol": "TCP"},
    ]
    if m.http_metadata_server:
        ports.append(
            {"name": "metadata", "port": m.http_metadata_port, "targetPort": "metadata", "protocol": "TCP"}
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, role),
        "spec": {"selector": selector(owner, role), "ports": ports},
    }


def store_statefulset(spec: PDClusterSpec, owner: Owner, replicas: int) -> dict[str, Any]:
    s = spec.mooncake.store
    role = C.ROLE_MOONCAKE_STORE
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(owner, role),
        "spec": {
            "replicas": replicas,
            "serviceName": owner.child(role),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(owner, role)},
            "template": {
                "metadata": {"labels": labels(owner, role)},
                "spec": {
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "securityContext": restricted_pod(),
                    "containers": [
                        {
                            "name": "store",
                            "image": spec.mooncake.image or spec.engine.image,
                            "imagePullPolicy": spec.engine.image_pull_policy,
                            "command": [
                                "python3",
                                "-m",
                                "mooncake.mooncake_store_service",
                                f"--port={s.port}",
                            ],
                            "env": [
                                env_field("POD_IP", "status.podIP"),
                                {"name": "MOONCAKE_LOCAL_HOSTNAME", "value": "$(POD_IP)"},
                            ],
                            "envFrom": [{"configMapRef": {"name": config_map_name(owner)}}],
                            "ports": [{"name": "store", "containerPort": s.port, "protocol": "TCP"}],
                            "readinessProbe": {"tcpSocket": {"port": "store"}, "periodSeconds": 5},
                            "resources": _resources(s.resources),
                            "securityContext": restricted_container(read_only_root=False),
                        }
                    ],
                },
            },
        },
    }


def store_service(spec: PDClusterSpec, owner: Owner) -> dict[str, Any]:
    role = C.ROLE_MOONCAKE_STORE
    port = spec.mooncake.store.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, role),
        "spec": {
            "clusterIP": "None",
            "selector": selector(owner, role),
            "ports": [{"name": "store", "port": port, "targetPort": "store", "protocol": "TCP"}],
        },
    }


def build_mooncake(spec: PDClusterSpec, owner: Owner, *, suspended: bool) -> list[dict[str, Any]]:
    objects = [
        config_map(spec, owner),
        master_deployment(spec, owner, 0 if suspended else 1),
        master_service(spec, owner),
    ]
    if spec.mooncake.store.replicas > 0:
        replicas = 0 if suspended else spec.mooncake.store.replicas
        objects += [store_statefulset(spec, owner, replicas), store_service(spec, owner)]
    return objects
