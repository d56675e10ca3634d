"""The PDCluster spec: the modes, and the rules that span its sections."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator
from pydantic.alias_generators import to_camel

from pdcluster import constants as C
from pdcluster import images
from pdcluster.api.base import Model, cel
from pdcluster.api.v1alpha1.autoscaling import AutoscalingMode, AutoscalingSpec
from pdcluster.api.v1alpha1.common import ModelSpec, section
from pdcluster.api.v1alpha1.engines import (
    EngineSpec,
    KVProtocol,
    KVTransferSpec,
    NetworkPolicySpec,
    RDMAMode,
    RDMASpec,
    RoleSpec,
    TracingSpec,
)
from pdcluster.api.v1alpha1.mooncake import MooncakeSpec
from pdcluster.api.v1alpha1.router import RouterSpec


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
            f"{flexible} || !self.autoscaling.enabled || !has(self.autoscaling.mode)"
            " || self.autoscaling.mode != 'external'",
            "mode flexible is autoscaled by the operator's law (autoscaling.mode auto or recommend): "
            "HPA or KEDA cannot move engines between the roles of one pool",
            ".autoscaling.mode",
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


class ImagePullSecret(Model):
    """A Secret of type kubernetes.io/dockerconfigjson in the PDCluster's namespace."""

    name: str = Field(min_length=1, description="Secret name.")


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
        "between the roles in seconds, without a restart; with autoscaling, the law moves the split by such flips "
        "every interval and the pool's size by pods; with decode.minReplicas 0 it may shrink a quiet pool to one engine, "
        "which serves requests whole. Changing it replaces the pools.",
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
    image_pull_secrets: list[ImagePullSecret] = Field(
        default_factory=lambda: [ImagePullSecret(name=n) for n in images.pull_secrets()],
        exclude_if=lambda refs: [r.name for r in refs] == images.pull_secrets(),
        description="Secrets for pulling images, on every pod the operator renders. Unset: the operator's "
        "(chart value `images.pullSecrets`); a list here replaces them.",
    )
    suspend: bool = Field(
        False,
        description="Scale every workload to zero and drop the roles' disruption budgets (they would guard no pod); keep everything else.",
    )
    paused: bool = Field(False, description="Stop applying changes to children; status keeps being reported.")
    progress_deadline_seconds: int = Field(
        600,
        ge=1,
        description="How long a workload may stay short of its desired state without coming closer (a pod "
        "created, updated or Ready) before the `Stalled` condition turns True with the pods' own reason "
        "(image pull, scheduling, crash loop, out of memory) and a Warning event is posted.",
    )

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
        if self.autoscaling.enabled and self.autoscaling.mode == AutoscalingMode.external:
            # as the CRD says, for a spec that did not pass through it
            raise ValueError("mode flexible is autoscaled by the operator's law: autoscaling.mode auto or recommend")
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
