"""The router: policy, admission, store hits, retries, KV hand-off probes."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from pdcluster import constants as C
from pdcluster import images
from pdcluster.api.base import FreeForm, Model, Port
from pdcluster.api.v1alpha1.common import Resources, SecretKeyRef, section


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


class ConnectionsSpec(Model):
    """Client connections: how long a head and a body may take, and how many may be open.

    Slow or silent clients are cut (408, or closed where nothing was sent), a body declared
    over the 64 MiB limit is answered 413 at its head, and past the connection limit a new
    connection gets a 503."""

    head_timeout_seconds: int = Field(
        30,
        ge=1,
        le=3600,
        description="A request's whole head, from the connection's opening or, on a kept-alive connection, "
        "from the head's first byte, however it trickles; a connection that sends nothing is closed after "
        "as long.",
    )
    body_timeout_seconds: int = Field(
        60, ge=1, le=3600, description="A request's whole body, from the end of its head."
    )
    max_connections: int = Field(
        4096,
        ge=1,
        le=1048576,
        description="Open client connections per router replica; past it a new connection gets a 503 and is "
        "closed while the open ones keep working. Keep it under the container's open-file limit.",
    )


class RouterSpec(Model):
    """The OpenAI-compatible, PD-aware router in front of the pools."""

    replicas: int = Field(
        2,
        ge=0,
        description="Router pods. Two by default, spread over nodes, with a PodDisruptionBudget of one: a "
        "node that goes takes one router and the Service sends new requests to the other.",
    )
    image: str = Field(
        default_factory=images.factory(images.ROUTER),
        min_length=1,
        exclude_if=images.is_default(images.ROUTER),
        description="Unset: the operator's default (chart value `images.router`).",
    )
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
    prefill_on_decode_below_tokens: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="A prompt shorter than this many tokens is prefilled by the decode engine it goes to, with "
        "no KV hand-off (Dynamo's conditional disaggregation): for short prompts the hand-off costs more than "
        "the prefill it moves. 0: every prompt is handed off. The router counts these requests "
        "(pdcluster_router_local_prefills_total).",
    )
    connections: ConnectionsSpec = section(ConnectionsSpec)
    request_timeout_seconds: int = Field(
        600,
        ge=1,
        description="Seconds per request, streams and retries included; prefill engines keep KV for a decode "
        "that never pulls it for as long (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT).",
    )
    max_fan_out: int = Field(
        16,
        ge=1,
        le=1024,
        description="A request with `n` > 1 or several prompts runs as one prefill/decode flow per prompt and "
        "choice, merged into one answer; a request needing more flows than this is refused with a 400.",
    )
    api_key_secret: SecretKeyRef | None = Field(
        None, description="When set, clients must send this key as a Bearer token."
    )
    service_type: str = Field(
        "ClusterIP", json_schema_extra={"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}
    )
    resources: Resources | None = Field(
        None,
        description="Unset: requests of 1 CPU and 512Mi, a 2Gi memory limit and no CPU limit (a throttled "
        "router adds its wait to every token it relays). `{}` leaves the router BestEffort.",
    )
    affinity: FreeForm | None = Field(
        None,
        description="Pod affinity, as in a Pod spec. Unset: routers prefer nodes without another router "
        "of this cluster (kubernetes.io/hostname).",
    )
