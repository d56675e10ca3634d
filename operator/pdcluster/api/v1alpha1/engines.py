"""The engines: their image and flags, the KV transfer, RDMA, network policy, tracing, and one pool (`RoleSpec`)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field, model_validator

from pdcluster import constants as C
from pdcluster import images
from pdcluster.api.base import FreeForm, Model, Port, Quantity, StringMap, cel
from pdcluster.api.v1alpha1.common import (
    EnvVar,
    ReadinessProbe,
    Resources,
    SecretKeyRef,
    StartupProbe,
    Toleration,
    section,
)


class EngineSpec(Model):
    """How engine pods (both roles) are launched."""

    @model_validator(mode="before")
    @classmethod
    def _simulator_image(cls, data: Any) -> Any:
        """An engine that runs the simulator and names no image runs the simulator's."""
        if isinstance(data, dict) and "image" not in data:
            command = data.get("command") or []
            if command and command[0] == images.ENGINE_SIM_COMMAND:
                return {**data, "image": images.default(images.ENGINE_SIM)}
        return data

    image: str = Field(
        default_factory=images.factory(images.ENGINE),
        min_length=1,
        exclude_if=images.is_default(images.ENGINE),
        description="Engine image (vLLM with Mooncake). Unset: the operator's default (chart value "
        "`images.engine`), or its engine simulator image (`images.engineSim`) when `command` runs the "
        "simulator.",
    )
    image_pull_policy: str = Field(
        "IfNotPresent", json_schema_extra={"enum": ["Always", "IfNotPresent", "Never"]}
    )
    command: list[str] = Field(
        default_factory=lambda: ["vllm", "serve"],
        min_length=1,
        description="Entrypoint; the engine simulator uses `[pdcluster-engine-sim, serve]` with the same arguments.",
    )
    port: Port = Field(C.ENGINE_PORT, description="OpenAI-compatible HTTP port.")
    args: list[str] = Field(default_factory=list, description="Extra engine arguments for both roles.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment for both roles.")
    hf_token_secret: SecretKeyRef | None = Field(
        None, description="Secret holding a Hugging Face token (HF_TOKEN)."
    )
    api_key_secret: SecretKeyRef | None = Field(
        None,
        description="Secret holding an API key the engines require (VLLM_API_KEY) on their /v1 routes; "
        "the router sends it. Other pods in the namespace then cannot use the engines directly.",
    )
    shm_size: Quantity = Field("16Gi", description="Size of the in-memory /dev/shm volume.")
    python_hash_seed: int = Field(
        0, ge=0, description="PYTHONHASHSEED, identical on both roles so block hashes agree."
    )
    startup_probe: StartupProbe = section(StartupProbe)
    readiness_probe: ReadinessProbe = section(ReadinessProbe)
    termination_grace_period_seconds: int = Field(
        120,
        ge=0,
        description="Time a draining engine gets to finish its in-flight requests: a 5 s preStop sleep while "
        "routers stop sending to it, then vLLM's `--shutdown-timeout` for the rest, less 2 s.",
    )


class KVConnector(StrEnum):
    mooncake = "mooncake"


class KVProtocol(StrEnum):
    rdma = "rdma"
    tcp = "tcp"


class KVTransferSpec(Model):
    """KV-cache transfer between prefill and decode (vLLM's MooncakeConnector)."""

    model_config = Model.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                cel("self.rpcPortMin <= self.rpcPortMax", "rpcPortMin must be <= rpcPortMax", ".rpcPortMin")
            ]
        }
    }

    connector: KVConnector = Field(KVConnector.mooncake, description="KV connector; `mooncake` is supported.")
    protocol: KVProtocol | None = Field(
        None, description="Transfer protocol; defaults to `rdma` when `rdma.mode` is set, otherwise `tcp`."
    )
    devices: str | None = Field(
        None, description="Mooncake `device_name`, e.g. `mlx5_0,mlx5_1`; defaults to `rdma.hcas`."
    )
    bootstrap_port: Port = Field(
        C.BOOTSTRAP_PORT, description="VLLM_MOONCAKE_BOOTSTRAP_PORT on prefill pods."
    )
    # Mooncake's transfer engine binds its handshake RPC port at random in this range
    # (MC_MIN_RPC_PORT / MC_MAX_RPC_PORT, 15000-17000 by default: Mooncake config.cpp);
    # rendered always, so that a NetworkPolicy or firewall can admit exactly it.
    rpc_port_min: Port = Field(15000, description="`MC_MIN_RPC_PORT`: lowest transfer-engine RPC port.")
    rpc_port_max: Port = Field(17000, description="`MC_MAX_RPC_PORT`: highest transfer-engine RPC port.")


class RDMAMode(StrEnum):
    none = "none"
    shared_device_plugin = "sharedDevicePlugin"
    sriov = "sriov"
    host_network = "hostNetwork"


class RDMASpec(Model):
    """How engine pods reach the RDMA fabric."""

    mode: RDMAMode = Field(
        RDMAMode.none, description="`sharedDevicePlugin`, `sriov` (Multus), `hostNetwork` or `none`."
    )
    resource_name: str = Field(
        "rdma/rdma_shared_device_a", description="Extended resource requested per engine pod."
    )
    resource_count: int = Field(1, ge=1, description="How many of `resourceName` each engine pod requests.")
    networks: list[str] = Field(
        default_factory=list, description="Multus NetworkAttachmentDefinitions for `sriov` mode."
    )
    gid_index: int | None = Field(
        None, ge=0, description="RoCE GID index (NCCL_IB_GID_INDEX, MC_GID_INDEX); 3 is typical for RoCEv2."
    )
    hcas: list[str] = Field(
        default_factory=list,
        description="HCA names as the pod sees them, e.g. `[mlx5_0, mlx5_1]` (an SR-IOV VF has its own name, "
        "not its PF's); empty: Mooncake uses every device it finds.",
    )
    traffic_class: int | None = Field(
        None,
        ge=0,
        le=255,
        description="RoCE traffic class (`MC_IB_TC`, `NCCL_IB_TC`), as the fabric's QoS sets it.",
    )
    service_level: int | None = Field(
        None, ge=0, le=15, description="InfiniBand service level (`MC_IB_SL`, `NCCL_IB_SL`)."
    )


_ROLE_RULES = [
    cel("self.minReplicas <= self.replicas", "minReplicas must be <= replicas", ".minReplicas"),
    cel("self.replicas <= self.maxReplicas", "replicas must be <= maxReplicas", ".replicas"),
    cel(
        "!has(self.gpusPerPod) || self.gpusPerPod >= self.tensorParallelSize * self.pipelineParallelSize * self.dataParallelSize",
        "gpusPerPod must be at least tensorParallelSize x pipelineParallelSize x dataParallelSize",
        ".gpusPerPod",
    ),
    cel(
        "!has(self.gpusPerNode) || self.tensorParallelSize * self.pipelineParallelSize <= self.gpusPerNode"
        " || (self.tensorParallelSize * self.pipelineParallelSize) % self.gpusPerNode == 0",
        "tensorParallelSize x pipelineParallelSize must be a multiple of gpusPerNode (vLLM puts as many ranks "
        "on every node)",
        ".gpusPerNode",
    ),
    cel(
        "!has(self.gpusPerNode) || self.tensorParallelSize * self.pipelineParallelSize <= self.gpusPerNode"
        " || (self.dataParallelSize == 1 && !has(self.gpusPerPod))",
        "a role spanning nodes (tensorParallelSize x pipelineParallelSize above gpusPerNode) takes neither "
        "dataParallelSize nor gpusPerPod",
        ".gpusPerNode",
    ),
]


class NetworkPolicySpec(Model):
    """NetworkPolicies admitting exactly the traffic the cluster's pods need (off: none)."""

    enabled: bool = Field(False, description="Render one NetworkPolicy per component.")
    scrape_from: list[FreeForm] = Field(
        default_factory=list,
        description="NetworkPolicyPeers that may scrape metrics (e.g. Prometheus's namespace); they reach "
        "the engines' API port too, which serves /metrics.",
    )


class TracingSpec(Model):
    """OpenTelemetry traces of each request: the router's spans (admission, prefill, KV
    hand-off, decode, streaming) and the engines' own (vLLM --otlp-traces-endpoint), one
    trace per request through W3C traceparent, sent over OTLP/HTTP."""

    model_config = Model.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                cel("!self.enabled || has(self.endpoint)", "tracing needs an endpoint", ".endpoint")
            ]
        }
    }

    enabled: bool = Field(False, description="Trace requests (off: no spans, no traceparent).")
    endpoint: str | None = Field(
        None,
        pattern=r"^https?://[^/\s]+$",
        description="The OTLP/HTTP receiver's base URL, e.g. http://otel-collector.observability:4318; "
        "spans go to <endpoint>/v1/traces.",
    )
    sample_percent: int = Field(
        100, ge=0, le=100, description="Share of requests traced; a client's sampled traceparent is followed."
    )
    headers_secret: SecretKeyRef | None = Field(
        None,
        description="Secret key holding the headers every export sends, for a collector behind auth, as "
        "`OTEL_EXPORTER_OTLP_HEADERS` writes them: `key=value` pairs joined by commas, values "
        "percent-encoded (e.g. `authorization=Bearer%20abc`). The router and the engines get it as "
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS.",
    )

    @property
    def traces_url(self) -> str:
        return f"{self.endpoint}/v1/traces"


class RoleSpec(Model):
    """One engine pool (prefill, decode, or colocated): a StatefulSet of identical vLLM pods."""

    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": _ROLE_RULES}}

    replicas: int = Field(
        1, ge=0, description="Pods when autoscaling is off; the starting point when it is on."
    )
    min_replicas: int = Field(1, ge=0, description="Lower bound for the autoscaler.")
    max_replicas: int = Field(8, ge=1, description="Upper bound for the autoscaler.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="`--tensor-parallel-size`.")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="`--pipeline-parallel-size`.")
    data_parallel_size: int = Field(1, ge=1, le=64, description="`--data-parallel-size` inside one pod.")
    gpus_per_pod: int | None = Field(None, ge=0, description="GPUs per pod; defaults to TP x PP x DP.")
    gpus_per_node: int | None = Field(
        None,
        ge=1,
        le=64,
        description="GPUs one node has for this role. When TP x PP exceeds it, each replica is a group of "
        "TP x PP / gpusPerNode pods, one per node, run as a LeaderWorkerSet (leaderworkerset.x-k8s.io must be "
        "installed) with vLLM's multi-node flags; replicas, bounds and the GPU budget count groups, and the "
        "router sends to each group's leader. Unset: one pod per replica.",
    )
    gpu_resource_name: str = Field("nvidia.com/gpu", description="Extended resource name for GPUs.")
    resources: Resources | None = Field(None, description="CPU/memory requests and limits.")
    node_selector: StringMap | None = None
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: FreeForm | None = Field(None, description="Pod affinity, as in a Pod spec.")
    topology_spread_constraints: list[FreeForm] = Field(default_factory=list)
    priority_class_name: str | None = None
    args: list[str] = Field(default_factory=list, description="Extra engine arguments for this role.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment for this role.")
    pod_annotations: StringMap | None = None
    pod_labels: StringMap | None = None

    @property
    def gpus(self) -> int:
        """GPUs one replica holds (a whole group when the role spans nodes)."""
        if self.gpus_per_pod is not None:
            return self.gpus_per_pod
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def nodes(self) -> int:
        """Pods (nodes) per replica: more than one when TP x PP exceeds gpusPerNode."""
        model = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.gpus_per_node is None or model <= self.gpus_per_node:
            return 1
        return model // self.gpus_per_node
