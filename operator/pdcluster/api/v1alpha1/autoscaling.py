"""The rebalancer: SLO, budget, windows and the other knobs of the control law."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from pdcluster.api.base import Model, cel
from pdcluster.api.v1alpha1.common import SecretKeyRef, section


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


class BasicAuthSecret(Model):
    """A Secret in the cluster's namespace holding a user name and a password."""

    name: str = Field(min_length=1, description="Secret name.")
    username_key: str = Field("username", min_length=1, description="Key of the user name.")
    password_key: str = Field("password", min_length=1, description="Key of the password.")


class CaBundleSecret(SecretKeyRef):
    """A PEM bundle of the CAs that sign Prometheus' serving certificate."""

    key: str = Field("ca.crt", description="Key within the Secret.")


class PrometheusAuthSpec(Model):
    """Credentials for a secured Prometheus (managed services, Mimir, Thanos, Cortex), read
    from Secrets in the PDCluster's namespace at every autoscaler run, so rotations apply."""

    model_config = Model.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                cel(
                    "!(has(self.bearerTokenSecret) && has(self.basicAuthSecret))",
                    "set bearerTokenSecret or basicAuthSecret, not both",
                )
            ]
        }
    }

    bearer_token_secret: SecretKeyRef | None = Field(
        None, description="Sent as `Authorization: Bearer <token>`."
    )
    basic_auth_secret: BasicAuthSecret | None = Field(None, description="HTTP basic auth.")
    ca_secret: CaBundleSecret | None = Field(
        None, description="CAs to verify an https Prometheus with, instead of the system's."
    )
    headers: dict[str, str] | None = Field(
        None,
        description="Extra request headers, e.g. `X-Scope-OrgID: <tenant>` for a multi-tenant Mimir, Cortex "
        "or Thanos. Not for secrets: they are stored in the spec as written.",
    )


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
        300,
        ge=0,
        description="A scale-down must be wanted this long (a colocated pool's then goes to the most replicas "
        "wanted in that time).",
    )
    cooldown_seconds: int = Field(60, ge=0, description="No new change this soon after the last one.")
    max_step: int = Field(2, ge=1, description="Most replicas one role moves per decision.")
    tolerance_percent: int = Field(
        10,
        ge=0,
        le=100,
        description="Hysteresis band around the SLO targets. The capacity models size with half of it "
        "while neither role's demand is bursty (decode: nor rising).",
    )
    scale_up_timeout_seconds: int = Field(
        600,
        ge=30,
        description="Give up on a scale-up whose pods never become ready (e.g. no free GPUs). Pods that are all "
        "scheduled get at least twice the role's measured start-up.",
    )
    prometheus_url: str | None = Field(
        None, description="Prometheus base URL; defaults to the operator's setting."
    )
    prometheus_auth: PrometheusAuthSpec | None = Field(
        None,
        description="Credentials for `prometheusUrl`. Unset: none with a URL of the spec's own, the operator's "
        "(its --prometheus-* flags) with the operator's URL.",
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
        description="When false, `slo.ttftMs` bounds the TTFT beyond prefill: TTFT less the prompt's own prefill "
        "compute (queueing, KV transfer, first decode step remain), measured per request by the router: for long "
        "prompts whose prefill alone exceeds any fixed target.",
    )
