"""What a pod needs to reach the RDMA fabric, in each `spec.rdma.mode`: engines and
store pods both move KV over it, so both get the same pieces."""

from __future__ import annotations

from typing import Any

from pdcluster.api.v1alpha1 import PDClusterSpec, RDMAMode

INFINIBAND_VOLUME = "infiniband"
MULTUS_NETWORKS = "k8s.v1.cni.cncf.io/networks"


def env(spec: PDClusterSpec) -> list[dict[str, Any]]:
    """Point NCCL, UCX and Mooncake at the same HCAs and GID."""
    if spec.rdma.mode == RDMAMode.none:
        return []
    out = []
    if spec.rdma.hcas:
        out.append({"name": "NCCL_IB_HCA", "value": ",".join(spec.rdma.hcas)})
        out.append({"name": "UCX_NET_DEVICES", "value": ",".join(f"{h}:1" for h in spec.rdma.hcas)})
    if spec.rdma.gid_index is not None:
        out.append({"name": "NCCL_IB_GID_INDEX", "value": str(spec.rdma.gid_index)})
        out.append({"name": "MC_GID_INDEX", "value": str(spec.rdma.gid_index)})
    # QoS of the RDMA traffic: Mooncake (config.cpp) and NCCL read their own names.
    if spec.rdma.traffic_class is not None:
        out += [{"name": n, "value": str(spec.rdma.traffic_class)} for n in ("MC_IB_TC", "NCCL_IB_TC")]
    if spec.rdma.service_level is not None:
        out += [{"name": n, "value": str(spec.rdma.service_level)} for n in ("MC_IB_SL", "NCCL_IB_SL")]
    return out


def transfer_env(spec: PDClusterSpec) -> list[dict[str, Any]]:
    """The transfer engine's RPC port range, in every mode (TCP included)."""
    kv = spec.kv_transfer
    return [
        {"name": "MC_MIN_RPC_PORT", "value": str(kv.rpc_port_min)},
        {"name": "MC_MAX_RPC_PORT", "value": str(kv.rpc_port_max)},
    ]


def extended_resources(spec: PDClusterSpec) -> dict[str, int]:
    if spec.rdma.mode in (RDMAMode.shared_device_plugin, RDMAMode.sriov):
        return {spec.rdma.resource_name: spec.rdma.resource_count}
    return {}


def capabilities(spec: PDClusterSpec) -> list[str]:
    """Registering memory with the NIC pins it: RDMA needs IPC_LOCK. On the host's own
    devices (/dev/infiniband) opening them also needs SYS_RESOURCE (Mooncake's
    rbg-integration.md; with IPC_LOCK alone the open fails, apache/brpc#2298)."""
    if spec.rdma.mode == RDMAMode.none:
        return []
    return ["IPC_LOCK", "SYS_RESOURCE"] if spec.rdma.mode == RDMAMode.host_network else ["IPC_LOCK"]


def mounts(spec: PDClusterSpec) -> list[dict[str, Any]]:
    if spec.rdma.mode == RDMAMode.host_network:
        return [{"name": INFINIBAND_VOLUME, "mountPath": "/dev/infiniband"}]
    return []


def annotations(spec: PDClusterSpec) -> dict[str, str]:
    if spec.rdma.mode == RDMAMode.sriov:
        return {MULTUS_NETWORKS: ",".join(spec.rdma.networks)}
    return {}


def pod_fields(spec: PDClusterSpec) -> dict[str, Any]:
    """Pod-level fields; the volume goes with `mounts`."""
    if spec.rdma.mode != RDMAMode.host_network:
        return {}
    return {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}


def volumes(spec: PDClusterSpec) -> list[dict[str, Any]]:
    if spec.rdma.mode == RDMAMode.host_network:
        return [{"name": INFINIBAND_VOLUME, "hostPath": {"path": "/dev/infiniband", "type": "Directory"}}]
    return []
