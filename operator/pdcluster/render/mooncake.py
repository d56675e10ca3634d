"""The Mooncake master (with its HTTP metadata server when a store needs it), the store's
client configuration and optional store pods.

Flags and ports follow Mooncake's deployment guide (docs/source/deployment/
mooncake-store-deployment-guide.md): RPC 50051, metrics and /health on 9003, HTTP
metadata 8080. Store clients read a JSON file, not the environment: engines through
vLLM's MOONCAKE_CONFIG_PATH (vllm/distributed/mooncake_store.py: MooncakeStoreConfig),
store pods through `mooncake_store_service --config` (mooncake/mooncake_config.py:
MooncakeConfig.from_file). One ConfigMap holds both files.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pdcluster import constants as C
from pdcluster.api.base import quantity
from pdcluster.api.v1alpha1 import PDClusterSpec, Resources
from pdcluster.render import rdma
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

CONFIG_DIR = "/etc/mooncake"
ENGINE_CONFIG = "engine.json"
STORE_CONFIG = "store.json"
CONFIG_VOLUME = "mooncake-config"
SSD_VOLUME = "ssd"
SSD_DIR = "/var/lib/mooncake/ssd"


# vLLM's own images up to 0.32 end the API server on the first KV hand-off under
# MultiConnector (vllm-project/vllm#43828, fixed by #43836); images/engine carries the fix.
_MULTICONNECTOR_BUG = re.compile(r"(^|/)vllm/vllm-openai:v?0\.(\d|[12]\d|3[0-2])(\.|$)")


def store_breaks_engine_image(spec: PDClusterSpec) -> bool:
    """The store is on (MultiConnector) and the engine image is one known to crash with it."""
    return spec.mooncake.store.enabled and bool(_MULTICONNECTOR_BUG.search(spec.engine.image))


def config_map_name(owner: Owner) -> str:
    return owner.child("mooncake")


def master_address(spec: PDClusterSpec, owner: Owner) -> str:
    ha = spec.mooncake.high_availability
    if ha.enabled:  # clients read the leader from etcd (client_service.cpp: ConnectToMaster)
        return "etcd://" + ";".join(ha.etcd_endpoints)
    return f"{owner.child(C.ROLE_MOONCAKE_MASTER)}:{spec.mooncake.rpc_port}"


def cluster_id(owner: Owner) -> str:
    """The masters' `--cluster_id`: their keys in etcd live under it, so PDClusters can
    share one etcd."""
    return f"pdcluster.{owner.namespace}.{owner.name}"


def client_env(spec: PDClusterSpec, owner: Owner) -> list[dict[str, Any]]:
    """What a store client needs besides its JSON under HA: the cluster id under which it
    finds the leader (MC_STORE_CLUSTER_ID) and its peers' segments (MC_METADATA_CLUSTER_ID)."""
    if not spec.mooncake.high_availability.enabled:
        return []
    return [
        {"name": "MC_STORE_CLUSTER_ID", "value": cluster_id(owner)},
        {"name": "MC_METADATA_CLUSTER_ID", "value": cluster_id(owner)},
    ]


def _bytes(value: int | str) -> int:
    """A quantity in bytes, rounded up as Kubernetes rounds a quantity's value: both
    readers take a plain count (neither parses Kubernetes' "Gi"). The CRD admits only
    quantities."""
    size = quantity(value)
    if size is None:
        raise ValueError(f"not a quantity: {value!r}")
    return math.ceil(size)


def _client(spec: PDClusterSpec, owner: Owner, segment: int | str, buffer: int | str) -> dict[str, Any]:
    m = spec.mooncake
    host = owner.child(C.ROLE_MOONCAKE_MASTER)
    if m.high_availability.enabled:
        metadata_server = master_address(spec, owner)  # in etcd: it outlives any master
    elif m.serves_metadata:
        metadata_server = f"http://{host}:{m.http_metadata_port}/metadata"
    else:
        metadata_server = "P2PHANDSHAKE"
    return {
        "metadata_server": metadata_server,
        "master_server_address": master_address(spec, owner),
        "protocol": spec.kv_protocol.value,
        "device_name": spec.kv_transfer.devices or ",".join(spec.rdma.hcas),
        "global_segment_size": _bytes(segment),
        "local_buffer_size": _bytes(buffer),
    }


def config_map(spec: PDClusterSpec, owner: Owner) -> dict[str, Any]:
    s = spec.mooncake.store
    files = {}
    if s.enabled:
        # Embedded: each engine's segment holds blocks; they leave the store with it.
        files[ENGINE_CONFIG] = {
            "mode": "embedded",
            **_client(spec, owner, s.engine_segment_size, s.engine_buffer_size),
        }
        if s.ssd.enabled:
            files[ENGINE_CONFIG]["enable_offload"] = True  # loads may come from SSD: stage them
    if s.replicas > 0:
        # A placeholder host: each store pod passes its own IP (-Dlocal_hostname).
        files[STORE_CONFIG] = {
            "local_hostname": "localhost",
            **_client(spec, owner, s.global_segment_size, s.local_buffer_size),
        }
        if s.ssd.enabled:
            files[STORE_CONFIG] |= {"enable_ssd_offload": True, "ssd_offload_path": SSD_DIR}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, C.ROLE_MOONCAKE_MASTER, name=config_map_name(owner)),
        "data": {name: json.dumps(body, indent=2, sort_keys=True) + "\n" for name, body in files.items()},
    }


def config_volume(owner: Owner) -> dict[str, Any]:
    return {"name": CONFIG_VOLUME, "configMap": {"name": config_map_name(owner)}}


def config_mount() -> dict[str, Any]:
    return {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True}


def _resources(res: Resources | None) -> dict[str, Any]:
    return res.wire() if res else {}


def master_args(spec: PDClusterSpec, owner: Owner) -> list[str]:
    m = spec.mooncake
    args = [
        "--rpc_address=$(POD_IP)",
        f"--rpc_port={m.rpc_port}",
        f"--metrics_port={m.metrics_port}",
        f"--default_kv_lease_ttl={m.lease_ttl_ms}",
        f"--eviction_high_watermark_ratio={m.eviction_high_watermark_percent / 100:g}",
        f"--eviction_ratio={m.eviction_percent / 100:g}",
    ]
    if m.store.ssd.enabled:
        args += ["--enable_offload=true", "--offload_on_evict=true", "--promotion_on_hit=true"]
    if m.high_availability.enabled:
        # Only the leader opens the RPC port; a standby answers HTTP 503 and /leader.
        args += [
            "--enable_ha=true",
            "--ha_backend_type=etcd",
            "--ha_backend_connstring=" + ";".join(m.high_availability.etcd_endpoints),
            f"--cluster_id={cluster_id(owner)}",
        ]
    if m.serves_metadata:
        args += [
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=$(POD_IP)",
            f"--http_metadata_server_port={m.http_metadata_port}",
        ]
    return args


def _master_strategy(spec: PDClusterSpec) -> dict[str, Any]:
    if spec.mooncake.high_availability.enabled:
        # One master at a time: a standby leads while each restarts.
        return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    # A lone master owns the metadata; never run two side by side during a rollout.
    return {"type": "Recreate"}


def master_deployment(spec: PDClusterSpec, owner: Owner, replicas: int) -> dict[str, Any]:
    m = spec.mooncake
    role = C.ROLE_MOONCAKE_MASTER
    ports = [
        {"name": "rpc", "containerPort": m.rpc_port, "protocol": "TCP"},
        {"name": "metrics", "containerPort": m.metrics_port, "protocol": "TCP"},
    ]
    if m.serves_metadata:
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
            "strategy": _master_strategy(spec),
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
                            "image": m.image,
                            "imagePullPolicy": spec.engine.image_pull_policy,
                            "command": ["mooncake_master"],
                            "args": master_args(spec, owner),
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
    if m.serves_metadata:
        ports.append(
            {"name": "metadata", "port": m.http_metadata_port, "targetPort": "metadata", "protocol": "TCP"}
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, role),
        "spec": {"selector": selector(owner, role), "ports": ports},
    }


def _ssd(spec: PDClusterSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The SSD tier on a store pod: its volume or its claim template, as ([volumes], [claim templates])."""
    ssd = spec.mooncake.store.ssd
    if not ssd.enabled:
        return [], []
    if ssd.storage_class_name:
        claim = {
            "metadata": {"name": SSD_VOLUME},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": ssd.storage_class_name,
                "resources": {"requests": {"storage": ssd.size}},
            },
        }
        return [], [claim]
    if ssd.host_path:
        return [{"name": SSD_VOLUME, "hostPath": {"path": ssd.host_path, "type": "DirectoryOrCreate"}}], []
    return [{"name": SSD_VOLUME, "emptyDir": {"sizeLimit": ssd.size}}], []


def _store_security(spec: PDClusterSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) security contexts of a store pod. Off RDMA: the restricted
    profile. On RDMA it pins memory for the NIC, as engines do, and a capability takes
    effect only for root (Kubernetes grants no ambient capabilities): root with nothing
    but IPC_LOCK."""
    caps = rdma.capabilities(spec)
    if not caps:
        return restricted_pod(), restricted_container(read_only_root=False)
    pod = {
        "runAsNonRoot": False,
        "runAsUser": 0,
        "runAsGroup": 0,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": False,
        "capabilities": {"drop": ["ALL"], "add": caps},
    }
    return pod, container


def _store_resources(spec: PDClusterSpec) -> dict[str, Any]:
    out = _resources(spec.mooncake.store.resources)
    extended = rdma.extended_resources(spec)
    if extended:  # extended resources: requests equal limits
        out = {k: {**out.get(k, {}), **extended} for k in ("requests", "limits")}
    return out


def _template_metadata(spec: PDClusterSpec, owner: Owner, role: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": labels(owner, role)}
    if rdma.annotations(spec):
        meta["annotations"] = rdma.annotations(spec)
    return meta


def store_statefulset(spec: PDClusterSpec, owner: Owner, replicas: int) -> dict[str, Any]:
    s = spec.mooncake.store
    role = C.ROLE_MOONCAKE_STORE
    volumes, claims = _ssd(spec)
    mounts = [config_mount(), *rdma.mounts(spec)]
    if s.ssd.enabled:
        mounts.append({"name": SSD_VOLUME, "mountPath": SSD_DIR})
    pod_security, container_security = _store_security(spec)
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(owner, role),
        "spec": {
            "replicas": replicas,
            "serviceName": owner.child(role),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(owner, role)},
            "template": {
                "metadata": _template_metadata(spec, owner, role),
                "spec": {
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security,
                    "containers": [
                        {
                            "name": "store",
                            "image": spec.mooncake.image,
                            "imagePullPolicy": spec.engine.image_pull_policy,
                            "command": [
                                "python3",
                                "-m",
                                "mooncake.mooncake_store_service",
                                f"--config={CONFIG_DIR}/{STORE_CONFIG}",
                                "-Dlocal_hostname=$(POD_IP)",
                                f"--port={s.port}",
                            ],
                            "env": [
                                env_field("POD_IP", "status.podIP"),
                                *client_env(spec, owner),
                                *rdma.env(spec),
                                *rdma.transfer_env(spec),
                            ],
                            "ports": [{"name": "store", "containerPort": s.port, "protocol": "TCP"}],
                            "volumeMounts": mounts,
                            "readinessProbe": {"tcpSocket": {"port": "store"}, "periodSeconds": 5},
                            "resources": _store_resources(spec),
                            "securityContext": container_security,
                        }
                    ],
                    "volumes": [config_volume(owner), *volumes, *rdma.volumes(spec)],
                    **rdma.pod_fields(spec),
                },
            },
        },
    }
    if claims:
        sts["spec"]["volumeClaimTemplates"] = claims
    return sts


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
    masters = 0 if suspended else spec.mooncake.master_replicas
    objects = [master_deployment(spec, owner, masters), master_service(spec, owner)]
    if spec.mooncake.has_store_clients:
        objects.append(config_map(spec, owner))  # read by store clients only
    if spec.mooncake.store.replicas > 0:
        replicas = 0 if suspended else spec.mooncake.store.replicas
        objects += [store_statefulset(spec, owner, replicas), store_service(spec, owner)]
    return objects
