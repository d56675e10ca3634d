"""Fake nodes shaped like a GPU cluster's: GPU nodes with NVIDIA/RDMA labels, resources
and taint, plus untainted CPU nodes for routers, the Mooncake master and the operator.

kwok plays every node annotated kwok.x-k8s.io/node=fake; it keeps the capacity and
addresses written here and hands out pod IPs from each node's spec.podCIDR, so every
pod gets a 127.1.<node>.<n> address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"
POD_NETWORK = "127.1"  # pod IPs: 127.1.<node index>.<n>
NODE_NETWORK = "127.3.0"  # node (host) IPs: 127.3.0.<node index + 1>


@dataclass(frozen=True)
class NodePool:
    gpu_nodes: int = 4
    gpus_per_node: int = 8
    rdma_resource: str = "rdma/rdma_shared_device_a"
    rdma_per_node: int = 1
    gpu_product: str = "NVIDIA-H200"
    gpu_memory_mib: int = 143771
    cpu_nodes: int = 2

    def __post_init__(self) -> None:
        if self.gpu_nodes + self.cpu_nodes > 250:
            raise ValueError("at most 250 nodes: each takes a /24 of 127.1.0.0/16")


def node_names(pool: NodePool) -> list[str]:
    return [f"gpu-{i}" for i in range(pool.gpu_nodes)] + [f"cpu-{i}" for i in range(pool.cpu_nodes)]


def _node(name: str, index: int, labels: dict[str, str], resources: dict[str, str],
          taints: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                **labels,
            },
        },
        "spec": {"podCIDR": f"{POD_NETWORK}.{index}.0/24", "taints": taints},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [
                {"type": "InternalIP", "address": f"{NODE_NETWORK}.{index + 1}"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux"},
        },
    }


def manifests(pool: NodePool) -> list[dict[str, Any]]:
    nodes = []
    for i in range(pool.gpu_nodes):
        resources = {
            "cpu": "192",
            "memory": "2Ti",
            "ephemeral-storage": "30Ti",
            "pods": "110",
            GPU_RESOURCE: str(pool.gpus_per_node),
        }
        if pool.rdma_per_node:
            resources[pool.rdma_resource] = str(pool.rdma_per_node)
        labels = {
            "node.kubernetes.io/instance-type": f"gpu-{pool.gpus_per_node}x-{pool.gpu_product.split('-')[-1].lower()}",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": pool.gpu_product,
            "nvidia.com/gpu.count": str(pool.gpus_per_node),
            "nvidia.com/gpu.memory": str(pool.gpu_memory_mib),
        }
        if pool.rdma_per_node:
            labels["feature.node.kubernetes.io/rdma.available"] = "true"
        taint = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
        nodes.append(_node(f"gpu-{i}", i, labels, resources, [taint]))
    for j in range(pool.cpu_nodes):
        resources = {"cpu": "32", "memory": "128Gi", "ephemeral-storage": "1Ti", "pods": "110"}
        labels = {"node.kubernetes.io/instance-type": "cpu-32"}
        nodes.append(_node(f"cpu-{j}", pool.gpu_nodes + j, labels, resources, []))
    return nodes
