"""Shared pieces of the spec: environment, tolerations, resources, secret references, probes, the model."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from pdcluster.api.base import FreeForm, Model, Quantity, cel


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


class ModelSource(StrEnum):
    """Where engines read the weights from."""

    hub = "hub"
    pvc = "pvc"
    node_path = "nodePath"
    cache = "cache"


_RELATIVE_PATH_RULE = cel(
    "!self.startsWith('/') && !self.matches('(^|/)\\\\.\\\\.(/|$)')",
    "path must be relative to the claim's root and must not contain '..'",
)


class ModelPVC(Model):
    """A PersistentVolumeClaim of yours that holds the model, mounted read-only."""

    claim_name: str = Field(min_length=1, description="Claim in the PDCluster's namespace.")
    path: str = Field(
        "",
        max_length=1024,
        description="Directory of the model (config.json, weights, tokenizer) within the claim, relative; "
        "empty: the claim's root.",
        json_schema_extra={"x-kubernetes-validations": [_RELATIVE_PATH_RULE]},
    )


class ModelNodePath(Model):
    """A directory on every node that runs engines (a hostPath), mounted read-only."""

    path: str = Field(pattern="^/", max_length=1024, description="Absolute directory of the model on the node.")


class ModelCache(Model):
    """A ReadWriteMany PersistentVolumeClaim the operator creates and fills once with a download Job;
    every engine mounts it read-only."""

    size: Quantity = Field(description="Storage the claim requests: room for the weights, e.g. `40Gi`.")
    storage_class_name: str | None = Field(
        None, description="Storage class of the claim (it must offer ReadWriteMany); the cluster default when unset."
    )
    retain: bool = Field(
        False,
        description="Keep the claim, and the weights in it, when the PDCluster is deleted (it then has no "
        "owner reference; a PDCluster of the same name takes it up again). False: deleted with the PDCluster.",
    )
    image: str | None = Field(
        None, description="Image of the download Job (Python with huggingface_hub); the engine image when unset."
    )


def _model_rules() -> list[dict[str, str]]:
    sections = {"pvc": "pvc", "nodePath": "nodePath", "cache": "cache"}
    rules = []
    for source, field in sections.items():
        rules.append(cel(f"self.source != '{source}' || has(self.{field})", f"source {source} needs {field}", f".{field}"))
        rules.append(
            cel(f"!has(self.{field}) || self.source == '{source}'", f"{field} is set but source is not {source}", f".{field}")
        )
    return rules


class ModelSpec(Model):
    """The model every engine serves, and where its weights come from."""

    model_config = Model.model_config | {"json_schema_extra": {"x-kubernetes-validations": _model_rules()}}

    name: str = Field(
        min_length=1, description="Model name or path passed to `vllm serve` (e.g. a Hugging Face id)."
    )
    served_model_name: str | None = Field(
        None, description="Name clients use in requests; defaults to `name`."
    )
    max_model_len: int | None = Field(None, ge=1, description="`--max-model-len`; engine default when unset.")
    revision: str | None = Field(
        None, min_length=1, description="Hub revision (branch, tag or commit) the cache downloads; `main` when unset."
    )
    source: ModelSource = Field(
        ModelSource.hub,
        description="`hub`: every engine downloads `name` from Hugging Face itself. `pvc`: the weights are in "
        "a claim of yours (`pvc`). `nodePath`: in a directory on the nodes (`nodePath`). `cache`: the "
        "operator fills a claim of its own once with a download Job (`cache`) and engines start when it "
        "has. Engines of the last three read only the mounted directory (`HF_HUB_OFFLINE=1`).",
    )
    hub_endpoint: str | None = Field(
        None,
        pattern="^https?://",
        description="`HF_ENDPOINT`: a Hugging Face mirror, for the cache's download Job and for `hub` engines.",
    )
    pvc: ModelPVC | None = None
    node_path: ModelNodePath | None = None
    cache: ModelCache | None = None

    @model_validator(mode="after")
    def _check_source(self) -> ModelSpec:
        """The CRD's rules, for a spec that did not pass through the apiserver."""
        given = {ModelSource.pvc: self.pvc, ModelSource.node_path: self.node_path, ModelSource.cache: self.cache}
        for source, section_ in given.items():
            field = source.value
            if self.source == source and section_ is None:
                raise ValueError(f"model.source {field} needs model.{field}")
            if self.source != source and section_ is not None:
                raise ValueError(f"model.{field} is set but model.source is {self.source.value}")
        if self.pvc is not None and (self.pvc.path.startswith("/") or ".." in self.pvc.path.split("/")):
            raise ValueError("model.pvc.path must be relative to the claim's root and must not contain '..'")
        return self
