"""The Mooncake master and store."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pdcluster import images
from pdcluster.api.base import Model, Port, Quantity, cel
from pdcluster.api.v1alpha1.common import Resources, section


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
        default_factory=images.factory(images.MOONCAKE),
        min_length=1,
        exclude_if=images.is_default(images.MOONCAKE),
        description="Image of the master and store pods: Mooncake's wheel (`mooncake_master`, "
        "`mooncake.mooncake_store_service`), as images/mooncake builds it. Unset: the operator's default "
        "(chart value `images.mooncake`).",
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
