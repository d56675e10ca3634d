"""PDCluster v1alpha1: the single source of truth for the CRD, the docs and the code.

One PDCluster is one model served by a prefill pool and a decode pool (vLLM with the
MooncakeConnector), a Mooncake master, and a PD-aware router. Replica counts in the
spec are the starting point; when autoscaling is on, the operator's decision (kept in
status) takes over without ever writing to the spec.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator
from pydantic.alias_generators import to_camel

from pdcluster import constants as C
from pdcluster.api.base import FreeForm, Model, Port, Quantity, StringMap, cel


def section(factory, description: str | None = None):
    """A nested object that is always present. Its CRD default is the object with all of
    its own defaults, so the stored object (and every CEL rule reading it) sees the same
    values the models use, even when the user leaves the whole section out."""
    return Field(
        default_factory=factory, description=description, json_schema_extra={"default": factory().wire()}
    )


class EnvVar(Model):
    """A container environment variable, as in a Pod spec."""

    name: str = Field(min_length=1, description="Variable name.")
    value: str | None = Field(None, description="Literal value.")
    value_from: FreeForm | None = Field(
        None, description="Source for the value (secretKeyRef, fieldRef, ...)."
    )


class Toleration(Model):
    """A pod toleration, as in a Pod spec."""

    key: str | None = None
    operator: str | None = Field(None, json_schema_extra={"enum": ["Exists", "Equal"]})
    value: str | None = None
    effect: str | None = Field(
        None, json_schema_extra={"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]}
    )
    toleration_seconds: int | None = None


class Resources(Model):
    """Container resource requests and limits. GPUs and RDMA devices are added by the operator."""

    requests: dict[str, Quantity] | None = None
    limits: dict[str, Quantity] | None = None


class SecretKeyRef(Model):
    """A key in a Secret in the PDCluster's namespace."""

    name: str = Field(min_length=1, description="Secret name.")
    key: str = Field("token", description="Key within the Secret.")


class Probe(Model):
    """Timing for the engine's HTTP probes on /health."""

    initial_delay_seconds: int = Field(0, ge=0)
    period_seconds: int = Field(10, ge=1)
    timeout_seconds: int = Field(5, ge=1)
    failure_threshold: int = Field(3, ge=1)


class StartupProbe(Probe):
    """Startup probe timing: loading weights and capturing CUDA graphs can take many minutes."""

    failure_threshold: int = Field(180, ge=1)


class ReadinessProbe(Probe):
    """Readiness probe timing: a pod leaves the router's backends when it fails."""

    period_seconds: int = Field(5, ge=1)


class ModelSpec(Model):
    """The model every engine serves."""

    name: str = Field(
        min_length=1, description="Model name or path passed to `vllm serve` (e.g. a Hugging Face id)."
    )
    served_model_name: str | None = Field(
        None, description="Name clients use in requests; defaults to `name`."
    )
    max_model_len: int | None = Field(None, ge=1, description="`--max-model-len`; engine default when unset.")


class EngineSpec(Model):
    """How engine pods (both roles) are launched."""

    image: str = Field(
        "vllm/vllm-openai:v0.32.0", min_length=1, description="Engine image (vLLM with Mooncake)."
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


class StoreSSDSpec(Model):
    """An SSD tier on the store pods: blocks the master evicts from DRAM move to it
    (`--offload_on_evict`), and a hit moves them back (`--promotion_on_hit`)."""

    enabled: bool = Field(False, description="Offload evicted blocks to SSD on each store pod.")
    size: Quantity = Field("1Ti", description="SSD space per store pod (the volume's size).")
    storage_class_name: str | None = Field(
        None,
        description="A PersistentVolumeClaim per store pod of this StorageClass (local NVMe, say); "
        "without one, `hostPath` or else an emptyDir of `size`.",
    )
    host_path: str | None = Field(
        None, pattern=r"^/.*", description="A directory on the node (its NVMe) instead of a volume claim."
    )


_STORE_RULES = [
    cel(
        "!self.enabled || quantity(string(self.engineBufferSize)).isGreaterThan(quantity('0'))",
        "mooncake.store.engineBufferSize must be above 0 when the store is enabled (vLLM's"
        " MooncakeStoreConnector refuses a local buffer of 0)",
        ".engineBufferSize",
    ),
    cel(
        "!self.enabled || quantity(string(self.engineSegmentSize)).isGreaterThan(quantity('0'))",
        "mooncake.store.engineSegmentSize must be above 0 when the store is enabled (each engine"
        " contributes memory to the store it writes to)",
        ".engineSegmentSize",
    ),
    cel(
        "!self.ssd.enabled || self.replicas > 0",
        "mooncake.store.ssd needs store pods (mooncake.store.replicas > 0): they hold the SSD tier",
        ".ssd.enabled",
    ),
    cel(
        "!has(self.ssd.storageClassName) || !has(self.ssd.hostPath)",
        "mooncake.store.ssd takes a storageClassName or a hostPath, not both",
        ".ssd.hostPath",
    ),
]


class MooncakeStoreSpec(Model):
    """The Mooncake store: engines share prefix KV blocks through it (global prefix
    reuse), and optional store pods add DRAM to it."""

    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": _STORE_RULES}}

    enabled: bool = Field(
        False,
        description="Engines use the store: vLLM's MultiConnector runs MooncakeConnector (the prefill -> "
        "decode hand-off) and MooncakeStoreConnector (prefix blocks to and from the store); prefill "
        "writes the blocks it computes, and both roles load the longest stored prefix of a prompt.",
    )
    engine_segment_size: Quantity = Field(
        "4Gi", description="Host memory each engine contributes to the store (its global segment)."
    )
    engine_buffer_size: Quantity = Field(
        "1Gi", description="Host memory each engine stages store transfers in (its local buffer); above 0."
    )
    replicas: int = Field(0, ge=0, description="Store pods; 0 runs none.")
    global_segment_size: Quantity = Field("4Gi", description="Memory each store pod contributes to the pool.")
    local_buffer_size: Quantity = Field(0, description="Local transfer buffer per store pod.")
    port: Port = Field(8088, description="Store service port.")
    resources: Resources | None = None
    ssd: StoreSSDSpec = section(StoreSSDSpec)


EtcdEndpoint = Annotated[str, Field(pattern=r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}$")]


class MasterHASpec(Model):
    """Standby masters that take over when the leader dies, elected through etcd
    (`--enable_ha --ha_backend_type=etcd`): Mooncake's published wheel builds no
    Kubernetes backend ("K8s Lease is not enabled in compilation"). Store clients then
    find the leader, and each other's segments, in etcd. A failover keeps the store
    answering after a few seconds, not its contents: the new leader starts empty."""

    enabled: bool = Field(False, description="Run `replicas` masters, one leading.")
    replicas: int = Field(2, ge=2, le=5, description="Masters, the leader and its standbys.")
    etcd_endpoints: list[EtcdEndpoint] = Field(
        default_factory=list,
        description="`host:port` of each etcd member the masters elect through and the store's clients "
        "read the leader from. Keys live under this PDCluster's own cluster id, so PDClusters can share "
        "one etcd.",
    )


_MOONCAKE_RULES = [
    cel(
        "!self.highAvailability.enabled || size(self.highAvailability.etcdEndpoints) > 0",
        "mooncake.highAvailability needs etcdEndpoints: the masters elect their leader through etcd",
        ".highAvailability.etcdEndpoints",
    ),
    cel(
        "!self.highAvailability.enabled || !self.httpMetadataServer",
        "mooncake.httpMetadataServer cannot be used with highAvailability: a master's metadata server "
        "dies with it, so store clients keep their metadata in etcd instead",
        ".httpMetadataServer",
    ),
]


class MooncakeSpec(Model):
    """The Mooncake master (and optional store pods)."""

    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": _MOONCAKE_RULES}}

    image: str = Field(
        C.DEFAULT_MOONCAKE_IMAGE,
        min_length=1,
        description="Image of the master and store pods: Mooncake's wheel (`mooncake_master`, "
        "`mooncake.mooncake_store_service`), as images/mooncake builds it.",
    )
    rpc_port: Port = Field(50051)
    metrics_port: Port = Field(9003)
    http_metadata_server: bool = Field(False, description="Run the master's HTTP metadata server.")
    http_metadata_port: Port = Field(8080)
    lease_ttl_ms: int = Field(10000, ge=1, description="`--default_kv_lease_ttl` in milliseconds.")
    eviction_high_watermark_percent: int = Field(
        90, ge=1, le=100, description="`--eviction_high_watermark_ratio` x 100."
    )
    eviction_percent: int = Field(5, ge=1, le=100, description="`--eviction_ratio` x 100.")
    resources: Resources | None = None
    store: MooncakeStoreSpec = section(MooncakeStoreSpec)
    high_availability: MasterHASpec = section(MasterHASpec)

    @property
    def has_store_clients(self) -> bool:
        return self.store.enabled or self.store.replicas > 0

    @property
    def serves_metadata(self) -> bool:
        """Store clients find each other's segments through the master's HTTP metadata
        server, so the store turns it on; under HA they use etcd instead."""
        if self.high_availability.enabled:
            return False
        return self.http_metadata_server or self.has_store_clients

    @property
    def master_replicas(self) -> int:
        return self.high_availability.replicas if self.high_availability.enabled else 1


class RouterPolicy(StrEnum):
    least_loaded = "least-loaded"
    prefix_aware = "prefix-aware"
    precise_prefix = "precise-prefix"


class AdmissionSpec(Model):
    """SLO-based early rejection in the router."""

    enabled: bool = Field(True, description="Reject requests predicted to miss the TTFT target.")
    ttft_target_ms: int | None = Field(
        None, ge=1, description="TTFT target; defaults to `autoscaling.slo.ttftMs`."
    )
    reject_factor_percent: int = Field(
        200, ge=100, description="Reject when predicted TTFT exceeds the target by this factor (200 = 2x)."
    )


class StoreHitsSpec(Model):
    """Prompt hits: with `mooncake.store.enabled`, the router asks the store how much of a
    prompt it holds (the engines' own block keys) and sends a prompt that leaves little to
    compute straight to decode, which loads the stored prefix: no prefill at all."""

    enabled: bool = Field(
        True,
        description="Look prompts up in the store. Needs one tensorParallelSize for both roles (the store's "
        "default key layout); otherwise prefill still reuses stored prefixes but every prompt goes to prefill.",
    )
    max_computed_tokens: int = Field(
        512,
        ge=0,
        description="Straight to decode when at most this many of a prompt's tokens are not stored "
        "(decode computes them itself, between its decode steps).",
    )
    lookup_timeout_ms: int = Field(
        100,
        ge=1,
        le=10000,
        description="What a lookup may add to a request; past it, the prompt goes to prefill. Also bounds "
        "the precise-prefix policy's call for a prompt's tokens; past it, that policy guesses.",
    )


class RetrySpec(Model):
    """What the router does when an engine fails a request: another attempt on engines not
    tried before for it, and a stream whose decode engine dies goes on from another."""

    max_attempts: int = Field(
        3,
        ge=1,
        le=10,
        description="Attempts per request. With no prefill engine left to try, the last goes to decode "
        "alone, which computes the prompt itself.",
    )
    prefill_timeout_seconds: int = Field(
        120, ge=1, description="A prefill that has not answered by then is abandoned and tried elsewhere."
    )
    resume_streams: bool = Field(
        True,
        description="Resume a stream on another decode engine when its engine dies mid-answer: the prompt "
        "and the tokens already sent make the rest (loaded from the Mooncake store when it holds the prefix). "
        "Streams with stop strings, echo, logprobs, tools or structured output are not resumable.",
    )


class KvProbeSpec(Model):
    """KV hand-off verification: the router sends a one-token request through each
    prefill -> decode pair before it takes traffic and then at intervals, and checks on
    decode's counters that the prompt's KV arrived rather than being recomputed. A pair
    that fails takes no traffic and is named in the KVTransfer condition."""

    enabled: bool = Field(True)
    interval_seconds: int = Field(
        60, ge=5, le=3600, description="Failed pairs and a sample of the others are probed again this often."
    )
    prompt_tokens: int = Field(64, ge=1, le=8192, description="Prompt length of a probe, in tokens.")


class RouterSpec(Model):
    """The OpenAI-compatible, PD-aware router in front of the pools."""

    replicas: int = Field(1, ge=0)
    image: str = Field(C.DEFAULT_ROUTER_IMAGE, min_length=1)
    image_pull_policy: str = Field(
        "IfNotPresent", json_schema_extra={"enum": ["Always", "IfNotPresent", "Never"]}
    )
    port: Port = Field(C.ROUTER_PORT, description="OpenAI-compatible HTTP port; also serves /metrics.")
    policy: RouterPolicy = Field(
        RouterPolicy.prefix_aware,
        description="How a prefill (or colocated) engine is picked: least-loaded; prefix-aware, on the "
        "router's guess of each engine's prefix cache from its own dispatches; precise-prefix, on what the "
        "engines' caches hold as their KV events say (vLLM --kv-events-config over ZMQ, rendered on those "
        "engines), guessing where an engine's events are not flowing.",
    )
    admission: AdmissionSpec = section(AdmissionSpec)
    store_hits: StoreHitsSpec = section(StoreHitsSpec)
    retries: RetrySpec = section(RetrySpec)
    kv_probe: KvProbeSpec = section(KvProbeSpec)
    request_timeout_seconds: int = Field(
        600,
        ge=1,
        description="Seconds per request, streams and retries included; prefill engines keep KV for a decode "
        "that never pulls it for as long (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT).",
    )
    api_key_secret: SecretKeyRef | None = Field(
        None, description="When set, clients must send this key as a Bearer token."
    )
    service_type: str = Field(
        "ClusterIP", json_schema_extra={"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}
    )
    resources: Resources | None = None


class Quantile(StrEnum):
    p50 = "p50"
    p90 = "p90"
    p95 = "p95"
    p99 = "p99"

    @property
    def fraction(self) -> float:
        """0.9 for p90: what histogram_quantile takes."""
        return int(self.value[1:]) / 100


class SLOSpec(Model):
    """Latency targets the autoscaler keeps."""

    ttft_ms: int = Field(500, ge=1, description="Time-to-first-token target.")
    itl_ms: int = Field(25, ge=1, description="Inter-token latency target.")
    quantile: Quantile = Field(Quantile.p90, description="Quantile both targets apply to.")


class AutoscalingMode(StrEnum):
    auto = "auto"
    recommend = "recommend"
    external = "external"


_AUTOSCALING_RULES = [
    cel(
        "self.scaleDownStabilizationSeconds >= self.scaleUpStabilizationSeconds",
        "scaleDownStabilizationSeconds must be >= scaleUpStabilizationSeconds (scale down slower than up)",
    ),
]


class AutoscalingSpec(Model):
    """Rebalancing prefill:decode from Prometheus TTFT/ITL within a GPU budget."""

    model_config = Model.model_config | {
        "json_schema_extra": {"x-kubernetes-validations": _AUTOSCALING_RULES}
    }

    enabled: bool = Field(False)
    mode: AutoscalingMode = Field(
        AutoscalingMode.auto,
        description="`auto` applies the control law's decisions; `recommend` only records them; `external` takes "
        "replicas from the PDRoleScalers `<name>-prefill` and `<name>-decode`, which HPA or KEDA scale through "
        "their /scale subresource.",
    )
    slo: SLOSpec = section(SLOSpec)
    gpu_budget: int | None = Field(
        None,
        ge=1,
        description="Most GPUs the engine pools may hold (prefill plus decode, or the colocated pool); "
        "unbounded when unset.",
    )
    interval_seconds: int = Field(30, ge=5, le=3600, description="How often the control law runs.")
    window_seconds: int = Field(120, ge=15, le=3600, description="PromQL rate window.")
    scale_up_stabilization_seconds: int = Field(0, ge=0, description="A scale-up must be wanted this long.")
    scale_down_stabilization_seconds: int = Field(
        300, ge=0, description="A scale-down must be wanted this long."
    )
    cooldown_seconds: int = Field(60, ge=0, description="No new change this soon after the last one.")
    max_step: int = Field(2, ge=1, description="Most replicas one role moves per decision.")
    tolerance_percent: int = Field(10, ge=0, le=100, description="Hysteresis band around the SLO targets.")
    scale_up_timeout_seconds: int = Field(
        600, ge=30, description="Give up on a scale-up whose pods never become ready (e.g. no free GPUs)."
    )
    prometheus_url: str | None = Field(
        None, description="Prometheus base URL; defaults to the operator's setting."
    )
    profile: str | None = Field(
        None,
        min_length=1,
        description="A latency profile shipped with the operator (`pdctl plan --help` lists them), the prior of "
        "the capacity model. Unset: the model is learned from the engines' own metrics alone.",
    )
    profile_config_map: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="A ConfigMap in the cluster's namespace whose `profile.json` holds a latency profile, as "
        "`pdctl profile` writes it; used as the prior instead of `profile`.",
    )
    ttft_includes_prefill: bool = Field(
        True,
        description="When false, `slo.ttftMs` bounds TTFT minus the prompt's own prefill time (queueing, KV "
        "transfer, first decode step): for long prompts whose prefill alone exceeds any fixed target.",
    )


class ServingMode(StrEnum):
    """How engines share the work of a request."""

    disaggregated = "disaggregated"
    colocated = "colocated"
    flexible = "flexible"


# What one flexible engine configuration is made of: `prefill` and `decode` must agree on
# them in flexible mode (scalars here, in the CRD; the rest in `_check_flexible`).
_FLEXIBLE_SCALARS = ("tensorParallelSize", "pipelineParallelSize", "dataParallelSize", "gpusPerPod", "gpuResourceName")
_FLEXIBLE_FIELDS = (
    "args", "env", "resources", "node_selector", "tolerations", "affinity", "topology_spread_constraints",
    "priority_class_name", "pod_annotations", "pod_labels",
)  # fmt: skip


def _flexible_rules() -> list[dict[str, str]]:
    flexible = "!has(self.mode) || self.mode != 'flexible'"
    rules = [
        cel(
            f"{flexible} || (has(self.prefill.{f}) == has(self.decode.{f})"
            f" && (!has(self.prefill.{f}) || self.prefill.{f} == self.decode.{f}))",
            f"mode flexible runs one engine configuration: prefill.{f} and decode.{f} must be equal",
            f".decode.{f}",
        )
        for f in _FLEXIBLE_SCALARS
    ]
    rules += [
        cel(
            f"{flexible} || !has(self.{role}.gpusPerNode)",
            f"mode flexible does not run multi-node groups: unset {role}.gpusPerNode",
            f".{role}.gpusPerNode",
        )
        for role in ("prefill", "decode")
    ]
    rules.append(
        cel(
            f"{flexible} || !self.autoscaling.enabled",
            "mode flexible is not autoscaled yet: set autoscaling.enabled false and size it by "
            "prefill.replicas and decode.replicas",
            ".autoscaling.enabled",
        )
    )
    return rules


def _cluster_rules() -> list[dict[str, str]]:
    gpus = "(has(self.{r}.gpusPerPod) ? self.{r}.gpusPerPod : self.{r}.tensorParallelSize * self.{r}.pipelineParallelSize * self.{r}.dataParallelSize)"
    floor = f"self.prefill.minReplicas * {gpus.format(r='prefill')} + self.decode.minReplicas * {gpus.format(r='decode')}"
    colocated_floor = f"self.colocated.minReplicas * {gpus.format(r='colocated')}"
    return [
        cel(
            "!has(self.kvTransfer.protocol) || self.kvTransfer.protocol != 'rdma' || self.rdma.mode != 'none'",
            "kvTransfer.protocol rdma needs rdma.mode other than none",
            ".kvTransfer.protocol",
        ),
        cel(
            "self.rdma.mode != 'sriov' || (has(self.rdma.networks) && size(self.rdma.networks) > 0)",
            "rdma.mode sriov needs at least one Multus network in rdma.networks",
            ".rdma.networks",
        ),
        cel(
            # vLLM's MooncakeConnector maps KV heads between the two TP layouts only when
            # one size divides the other (mooncake_connector.py, TpKVTopology).
            "self.prefill.tensorParallelSize % self.decode.tensorParallelSize == 0"
            " || self.decode.tensorParallelSize % self.prefill.tensorParallelSize == 0",
            "prefill and decode tensorParallelSize must divide one another (MooncakeConnector)",
            ".prefill.tensorParallelSize",
        ),
        cel(
            f"!has(self.autoscaling.gpuBudget) || (has(self.mode) && self.mode == 'colocated')"
            f" || self.autoscaling.gpuBudget >= {floor}",
            "autoscaling.gpuBudget must cover the GPUs of prefill.minReplicas and decode.minReplicas",
            ".autoscaling.gpuBudget",
        ),
        cel(
            "!has(self.autoscaling.gpuBudget) || !has(self.mode) || self.mode != 'colocated'"
            f" || self.autoscaling.gpuBudget >= {colocated_floor}",
            "autoscaling.gpuBudget must cover the GPUs of colocated.minReplicas",
            ".autoscaling.gpuBudget",
        ),
        *_flexible_rules(),
    ]


class PDClusterSpec(Model):
    """Desired state of a disaggregated prefill/decode serving cluster."""

    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": _cluster_rules()}}

    model: ModelSpec
    mode: ServingMode = Field(
        ServingMode.disaggregated,
        description="`disaggregated`: a prefill and a decode pool, KV handed from one to the other. "
        "`colocated`: one pool of engines that each serve requests whole (chunked prefill, no KV "
        "connector), sized by `colocated` (and by the control law on TTFT, ITL and KV cache usage when "
        "autoscaling is on); for short, uniform prompts. `flexible`: one pool of prefill.replicas + "
        "decode.replicas engines of one configuration (the two sections must agree on it), each started as "
        "both KV producer and consumer; the router makes each engine prefill or decode, and moves an engine "
        "between the roles in seconds, without a restart. Changing it replaces the pools.",
    )
    engine: EngineSpec = section(EngineSpec)
    kv_transfer: KVTransferSpec = section(KVTransferSpec)
    rdma: RDMASpec = section(RDMASpec)
    prefill: RoleSpec = section(RoleSpec)
    decode: RoleSpec = section(RoleSpec)
    colocated: RoleSpec = section(RoleSpec)
    mooncake: MooncakeSpec = section(MooncakeSpec)
    router: RouterSpec = section(RouterSpec)
    autoscaling: AutoscalingSpec = section(AutoscalingSpec)
    network_policy: NetworkPolicySpec = section(NetworkPolicySpec)
    tracing: TracingSpec = section(TracingSpec)
    suspend: bool = Field(
        False,
        description="Scale every workload to zero and drop the roles' disruption budgets (they would guard no pod); keep everything else.",
    )
    paused: bool = Field(False, description="Stop applying changes to children; status keeps being reported.")

    @model_validator(mode="after")
    def _check_flexible(self) -> PDClusterSpec:
        """In flexible mode every engine is one pod configuration: what the CRD cannot
        compare cheaply (lists and objects) is compared here."""
        if self.mode != ServingMode.flexible:
            return self
        differ = [f for f in _FLEXIBLE_FIELDS if getattr(self.prefill, f) != getattr(self.decode, f)]
        if differ:
            raise ValueError(
                "mode flexible runs one engine configuration: prefill and decode differ in "
                + ", ".join(to_camel(f) for f in differ)
            )
        if self.autoscaling.enabled:  # as the CRD says, for a spec that did not pass through it
            raise ValueError("mode flexible is not autoscaled yet: set autoscaling.enabled false")
        return self

    def role(self, name: str) -> RoleSpec:
        """An engine role's spec; a name that is no engine role is a bug, not decode."""
        if name == C.ROLE_FLEXIBLE:
            return self.flexible_pool
        roles = {C.ROLE_PREFILL: self.prefill, C.ROLE_DECODE: self.decode, C.ROLE_COLOCATED: self.colocated}
        if name not in roles:
            raise ValueError(f"no engine role {name!r} (prefill, decode, colocated or flexible)")
        return roles[name]

    @property
    def flexible_pool(self) -> RoleSpec:
        """The flexible pool: prefill's configuration, both roles' engines."""
        p, d = self.prefill, self.decode
        return p.model_copy(
            update={
                "replicas": p.replicas + d.replicas,
                "min_replicas": p.min_replicas + d.min_replicas,
                "max_replicas": p.max_replicas + d.max_replicas,
            }
        )

    @property
    def engine_roles(self) -> tuple[str, ...]:
        """The engine pools this mode runs."""
        if self.mode == ServingMode.colocated:
            return (C.ROLE_COLOCATED,)
        if self.mode == ServingMode.flexible:
            return (C.ROLE_FLEXIBLE,)
        return C.ENGINE_ROLES

    @property
    def hands_off_kv(self) -> bool:
        """Whether engines hand KV from prefill to decode (not in colocated mode)."""
        return self.mode != ServingMode.colocated

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or self.model.name

    @property
    def kv_protocol(self) -> KVProtocol:
        if self.kv_transfer.protocol is not None:
            return self.kv_transfer.protocol
        return KVProtocol.tcp if self.rdma.mode == RDMAMode.none else KVProtocol.rdma


# ---------------------------------------------------------------------------- status


class Condition(Model):
    """A standard Kubernetes condition."""

    type: str
    status: str = Field(json_schema_extra={"enum": ["True", "False", "Unknown"]})
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class RoleStatus(Model):
    """Observed state of one engine pool."""

    desired: int = 0
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    gpus: int = 0


class ComponentStatus(Model):
    replicas: int = 0
    ready: int = 0


class ObservedMetrics(Model):
    """What the control law saw (milliseconds and requests per second, as integers x1000 where noted)."""

    ttft_ms: int | None = None
    itl_ms: int | None = None
    request_rate_milli: int | None = Field(None, description="Requests per second x 1000.")
    mean_input_tokens: int | None = None
    mean_output_tokens: int | None = None
    prefill_queue: int | None = None
    decode_kv_usage_percent: int | None = None


class Decision(Model):
    """One run of the control law."""

    time: str
    prefill: int = Field(0, description="Prefill replicas decided; 0 in colocated mode.")
    decode: int = Field(0, description="Decode replicas decided; 0 in colocated mode.")
    colocated: int | None = Field(None, description="Colocated replicas decided; unset when disaggregated.")
    action: str = Field(description="`scale`, `hold` or `recommend`.")
    cause: str = Field(
        "", description="Why, as a code (the Autoscaling condition's reason), e.g. `TTFTOverTarget`."
    )
    summary: str = Field("", description="What changes or holds and why, in one line.")
    reason: str = Field(description="The figures and every consideration behind the decision.")
    metrics: ObservedMetrics | None = None


class LoadSample(Model):
    """The demand on each role that one run of the control law saw (its trend predicts the next)."""

    time: str
    prefill: int = Field(ge=0, description="Prompt tokens arriving per second.")
    decode: int = Field(
        ge=0,
        description="KV tokens the arriving requests hold, per second of decoding x 1000 "
        "(requests/s x output tokens x mean context / 1000).",
    )


class DecodeSample(Model):
    """One window's mean decode step on one engine, with the load it ran at."""

    sequences_milli: int = Field(ge=0, description="Running sequences per engine x 1000.")
    kv_usage_ppm: int = Field(ge=0, description="KV-cache usage in millionths.")
    step_us: int = Field(
        ge=0, description="Mean step time (running sequences / tokens per second), microseconds."
    )


class LearnedCapacity(Model):
    """What the control law has learned of one engine of each role from the engines' metrics.

    Kept in status so that a restarted operator does not start learning again.
    """

    prefill_ns_per_token: int | None = Field(
        None,
        ge=0,
        description="Engine-nanoseconds per prompt token computed (not served from the prefix cache).",
    )
    prefill_windows: int = Field(0, ge=0, description="Metrics windows the prefill estimate is made of.")
    decode_samples: list[DecodeSample] | None = Field(
        None, description="The last windows' decode steps, oldest first (the step-time fit's input)."
    )
    decode_windows: int = Field(0, ge=0, description="Metrics windows the decode fit has seen.")
    kv_capacity_tokens: int | None = Field(
        None, ge=1, description="KV tokens one decode engine holds (running sequences x context / KV usage)."
    )


class TTFTStages(Model):
    """Where the mean time to first token went in the last window (ms)."""

    router_ms: int = Field(description="The router: parsing, admission, transport to the prefill engine.")
    prefill_queue_ms: int = Field(description="Waiting in a prefill engine's queue.")
    prefill_compute_ms: int = Field(description="The prefill itself.")
    kv_handoff_ms: int = Field(description="Moving the KV cache to the decode engine.")
    decode_wait_ms: int = Field(description="The decode engine's wait for its first step.")


class AutoscalingState(Model):
    """Control-law memory, kept in status so a restarted operator continues where it stopped."""

    prefill: int | None = Field(
        None, description="Replicas the autoscaler wants for prefill (used in `auto` mode)."
    )
    decode: int | None = Field(
        None, description="Replicas the autoscaler wants for decode (used in `auto` mode)."
    )
    colocated: int | None = Field(
        None, description="Replicas the autoscaler wants for the colocated pool (used in `auto` mode)."
    )
    last_run_time: str | None = None
    last_change_time: str | None = None
    pending_since: StringMap | None = Field(
        None, description="Per role, since when a scale-up has been waiting for ready pods."
    )
    blocked_until: StringMap | None = Field(
        None, description="Per role, no scale-up before this time (set when a scale-up timed out)."
    )
    up_wanted_since: StringMap | None = Field(
        None, description="Per role, since when a scale-up has been wanted."
    )
    down_wanted_since: StringMap | None = Field(
        None, description="Per role, since when a scale-down has been wanted."
    )
    history: list[LoadSample] | None = Field(
        None, description="Demand seen by the runs of the last metrics window, oldest first."
    )
    capacity: LearnedCapacity | None = None
    ttft_stages: TTFTStages | None = None
    last_decision: Decision | None = None
    decisions: int = Field(0, description="Decisions that changed replicas so far.")


class PDClusterStatus(Model):
    """Observed state, written once per reconcile."""

    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    prefill: RoleStatus = Field(default_factory=RoleStatus)
    decode: RoleStatus = Field(default_factory=RoleStatus)
    colocated: RoleStatus | None = Field(None, description="The engine pool in colocated mode.")
    flexible: RoleStatus | None = Field(None, description="The engine pool in flexible mode.")
    ratio: str | None = Field(
        None,
        description="Ready prefill:decode pods, e.g. `2:3` (in flexible mode: ready engines acting as each "
        "role); unset when colocated.",
    )
    router: ComponentStatus = Field(default_factory=ComponentStatus)
    mooncake: ComponentStatus = Field(default_factory=ComponentStatus)
    ttft_p99_ms: int | None = None
    itl_p99_ms: int | None = None
    autoscaling: AutoscalingState | None = None
    rollout: str | None = Field(
        None,
        description="While prefill and decode move to a new engine revision: pods updated per role, e.g. "
        "`prefill 1/2, decode 1/3 at revision 3f2a9c81d0e4`.",
    )


# ------------------------------------------------------------------- role scaler


class PDRoleScalerSpec(Model):
    """Desired replicas of one engine role, written by HPA, KEDA or `kubectl scale`."""

    # Not optional: HPA reads /scale before its first write, and a missing field would
    # leave it nothing to start from (as LWS's KEP-849 notes for its role scaler).
    replicas: int = Field(
        1, ge=0, description="Pods wanted for the role; clamped to the role's min/maxReplicas."
    )


class PDRoleScalerStatus(Model):
    """What the /scale subresource reports back."""

    replicas: int = Field(0, description="Pods of the role that exist now.")
    selector: str = Field("", description="Label selector of the role's pods (for HPA's pod metrics).")
