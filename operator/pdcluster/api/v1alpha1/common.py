"""Shared pieces of the spec: environment, tolerations, resources, secret references, probes, the model."""

from __future__ import annotations

from pydantic import Field

from pdcluster.api.base import FreeForm, Model, Quantity


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
