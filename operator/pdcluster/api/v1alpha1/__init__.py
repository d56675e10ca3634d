"""PDCluster v1alpha1: the single source of truth for the CRD, the docs and the code.

One PDCluster is one model served by a prefill pool and a decode pool (vLLM with the
MooncakeConnector), a Mooncake master, and a PD-aware router. Replica counts in the
spec are the starting point; when autoscaling is on, the operator's decision (kept in
status) takes over without ever writing to the spec.

The API's types live in modules by concern (common, engines, mooncake, router,
autoscaling, cluster, status, scaler) and are all importable from here.
"""

from __future__ import annotations

from pdcluster.api.v1alpha1.autoscaling import AutoscalingMode, AutoscalingSpec, Quantile, SLOSpec
from pdcluster.api.v1alpha1.cluster import PDClusterSpec, ServingMode
from pdcluster.api.v1alpha1.common import (
    EnvVar,
    ModelCache,
    ModelNodePath,
    ModelPVC,
    ModelSource,
    ModelSpec,
    Probe,
    ReadinessProbe,
    Resources,
    SecretKeyRef,
    StartupProbe,
    Toleration,
    section,
)
from pdcluster.api.v1alpha1.engines import (
    EngineSpec,
    KVConnector,
    KVProtocol,
    KVTransferSpec,
    NetworkPolicySpec,
    RDMAMode,
    RDMASpec,
    RoleSpec,
    TracingSpec,
)
from pdcluster.api.v1alpha1.mooncake import MasterHASpec, MooncakeSpec, MooncakeStoreSpec, StoreSSDSpec
from pdcluster.api.v1alpha1.router import (
    AdmissionSpec,
    ConnectionsSpec,
    KvProbeSpec,
    RetrySpec,
    RouterPolicy,
    RouterSpec,
    StoreHitsSpec,
)
from pdcluster.api.v1alpha1.scaler import PDRoleScalerSpec, PDRoleScalerStatus
from pdcluster.api.v1alpha1.status import (
    AutoscalingState,
    ComponentStatus,
    Condition,
    Decision,
    DecodeSample,
    LearnedCapacity,
    LoadSample,
    ModelStatus,
    ObservedMetrics,
    PDClusterStatus,
    PodStartup,
    PrefillSample,
    RoleStatus,
    SeasonalMemory,
    SLOStatus,
    StartupStatus,
    TTFTStages,
)

__all__ = [
    "AdmissionSpec",
    "AutoscalingMode",
    "AutoscalingSpec",
    "AutoscalingState",
    "ComponentStatus",
    "Condition",
    "ConnectionsSpec",
    "Decision",
    "DecodeSample",
    "EngineSpec",
    "EnvVar",
    "KVConnector",
    "KVProtocol",
    "KVTransferSpec",
    "KvProbeSpec",
    "LearnedCapacity",
    "LoadSample",
    "MasterHASpec",
    "ModelCache",
    "ModelNodePath",
    "ModelPVC",
    "ModelSource",
    "ModelSpec",
    "ModelStatus",
    "MooncakeSpec",
    "MooncakeStoreSpec",
    "NetworkPolicySpec",
    "ObservedMetrics",
    "PDClusterSpec",
    "PDClusterStatus",
    "PDRoleScalerSpec",
    "PDRoleScalerStatus",
    "PodStartup",
    "PrefillSample",
    "Probe",
    "Quantile",
    "RDMAMode",
    "RDMASpec",
    "ReadinessProbe",
    "Resources",
    "RetrySpec",
    "RoleSpec",
    "RoleStatus",
    "RouterPolicy",
    "RouterSpec",
    "SLOSpec",
    "SLOStatus",
    "SeasonalMemory",
    "SecretKeyRef",
    "ServingMode",
    "StartupProbe",
    "StartupStatus",
    "StoreHitsSpec",
    "StoreSSDSpec",
    "TTFTStages",
    "Toleration",
    "TracingSpec",
    "section",
]
