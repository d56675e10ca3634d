"""Fake nodes shaped like a GPU cluster's: GPU nodes with NVIDIA/RDMA labels, resources
and taint, plus untainted CPU nodes for routers, the Mooncake master and the operator.

kwok plays every node annotated kwok.x-k8s.io/node=fake; it keeps the capacity and
addresses written here and hands out pod IPs from each node's spec.podCIDR, so every
pod gets a 127.<1 + 3k>.<node>.<n> address, k being the cluster's address slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"
# Each running cluster has an address slot k, so that several can run side by side:
# pods 127.<1+3k>.<node>.<n>, Services 127.<2+3k>.0.0/16, nodes 127.<3+3k>.0.<node+1>.
MAX_SLOTS = 20


def pod_network(slot: int) -> str:
    return f"127.{1 + 3 * slot}"


def service_cidr(slot: int) -> str:
    return f"127.{2 + 3 * slot}.0.0/16"


def kubernetes_service_ip(slot: int) -> str:
    """The first address of the Service range, which the apiserver gives `kubernetes`."""
    return f"127.{2 + 3 * slot}.0.1"


def node_network(slot: int) -> str:
    return f"127.{3 + 3 * slot}.0"


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
            raise ValueError("at most 250 nodes: each takes a /24 of the pod network")


def node_names(pool: NodePool) -> list[str]:
    return [f"gpu-{i}" for i in range(pool.gpu_nodes)] + [f"cpu-{i}" for i in range(pool.cpu_nodes)]


def _node(name: str, index: int, slot: int, labels: dict[str, str], resources: dict[str, str],
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
        "spec": {"podCIDR": f"{pod_network(slot)}.{index}.0/24", "taints": taints},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [
                {"type": "InternalIP", "address": f"{node_network(slot)}.{index + 1}"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux"},
        },
    }


def manifests(pool: NodePool, slot: int = 0) -> list[dict[str, Any]]:
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
        nodes.append(_node(f"gpu-{i}", i, slot, labels, resources, [taint]))
    for j in range(pool.cpu_nodes):
        resources = {"cpu": "32", "memory": "128Gi", "ephemeral-storage": "1Ti", "pods": "110"}
        labels = {"node.kubernetes.io/instance-type": "cpu-32"}
        nodes.append(_node(f"cpu-{j}", pool.gpu_nodes + j, slot, labels, resources, []))
    return nodes
