"""The PDCluster status: conditions, pools, the autoscaler's decision and memory."""

from __future__ import annotations

from pydantic import Field

from pdcluster.api.base import Model, StringMap


class Condition(Model):
    """A standard Kubernetes condition."""

    type: str
    status: str = Field(json_schema_extra={"enum": ["True", "False", "Unknown"]})
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class PodStartup(Model):
    """One engine pod's start-up: image pull, weights load and warm-up."""

    pod: str
    created: str = Field(description="The pod's creationTimestamp.")
    seconds: int = Field(ge=0, description="From creation to the pod's first Ready condition.")


class StartupStatus(Model):
    """Engine start-up as measured from the pool's pods (creation to first Ready)."""

    last_seconds: int = Field(ge=0, description="The start-up of the most recently created pod measured.")
    median_seconds: int = Field(ge=0, description="The median over `pods`.")
    pods: list[PodStartup] = Field(
        default_factory=list, description="The most recent pods measured, oldest first."
    )


class RoleStatus(Model):
    """Observed state of one engine pool."""

    desired: int = 0
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    gpus: int = 0
    startup: StartupStatus | None = Field(
        None, description="Measured engine start-up; unset until a pod of the pool has been Ready."
    )


class RoleFlips(Model):
    """The flexible pool's role assignment and the flips that changed it."""

    prefill_engines: int = Field(
        0, description="Engines the routers are told to use as prefill (the rest decode)."
    )
    flips: int = Field(
        0, description="Engines moved between prefill and decode since the PDCluster was created."
    )
    last_flip: str | None = Field(
        None, description="The last change, e.g. `1 engine decode -> prefill: prefill engines 1 -> 2 of 3`."
    )
    last_flip_time: str | None = None


class ComponentStatus(Model):
    replicas: int = 0
    ready: int = 0


class ObservedMetrics(Model):
    """What the control law saw (milliseconds and requests per second, as integers x1000 where noted)."""

    ttft_ms: int | None = None
    itl_ms: int | None = None
    ttft_beyond_prefill_ms: int | None = Field(
        None, description="The router's TTFT beyond prefill (TTFT less the prompt's own prefill compute)."
    )
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


class SeasonalMemory(Model):
    """One role's demand by time of day, learned online from what the law has seen (its
    seasonal forecast; the same units as LoadSample's)."""

    profile: list[int] = Field(
        description="The smoothed demand of each 10-minute bucket of the day (UTC), -1 where none was seen yet."
    )
    bucket: int | None = Field(None, description="The bucket being filled: seconds since the epoch / 600.")
    total: int = Field(0, ge=0, description="The demand summed over the bucket being filled.")
    samples: int = Field(0, ge=0, description="Runs in the bucket being filled.")
    first: int | None = Field(
        None,
        description="The bucket of the first sample: a bucket is memory of its time of day only from a day "
        "after it (none: all are).",
    )


class DecodeSample(Model):
    """One window's mean decode step on one engine, with the load it ran at."""

    sequences_milli: int = Field(ge=0, description="Running sequences per engine x 1000.")
    kv_usage_ppm: int = Field(ge=0, description="KV-cache usage in millionths.")
    step_us: int = Field(
        ge=0, description="Mean step time (running sequences / tokens per second), microseconds."
    )


class PrefillSample(Model):
    """One metrics window's prefill steps (the per-step fit's input)."""

    tokens_per_step: int = Field(ge=0, description="Prompt tokens computed per engine step.")
    step_us: int = Field(ge=0, description="Engine-microseconds per step.")


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
    prefill_samples: list[PrefillSample] | None = Field(
        None,
        description="The last windows' prefill steps, oldest first: a step's fixed cost and its cost per "
        "token are fitted from them once their batches differ enough.",
    )
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


class SLOStatus(Model):
    """The SLO as the last metrics window showed it, judged as the control law judges it
    (above the target x (1 + tolerancePercent) is missed); docs/metrics.md names each figure."""

    verdict: str = Field(
        json_schema_extra={"enum": ["met", "missed", "unseen"]},
        description="Both targets met, one missed, or a figure unseen (no traffic, no metrics).",
    )
    quantile: str = Field(description="The SLO quantile every figure is taken at, e.g. `p90`.")
    ttft_name: str = Field(
        description="What `slo.ttftMs` bounds: `TTFT beyond prefill` (`ttftIncludesPrefill` false), `TTFT`, "
        "or `prefill wait` (colocated engines)."
    )
    ttft_beyond_prefill_ms: int | None = Field(
        None, description="The router's TTFT beyond prefill at the quantile, when the target applies to it."
    )
    prefill_wait_ms: int | None = Field(
        None, description="The colocated engines' queue time at the quantile, when the target applies to it."
    )
    ttft_ms: int | None = Field(None, description="The router's whole TTFT at the quantile.")
    itl_ms: int | None = Field(
        None,
        description="The router's ITL at the quantile: of the gaps between streamed tokens, or on colocated "
        "engines of each stream's mean time per output token.",
    )
    summary: str = Field("", description="The figures against their targets, in one line.")


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
    down_wanted_most: dict[str, int] | None = Field(
        None,
        description="The colocated pool's most replicas wanted since its scale-down began: where the "
        "scale-down goes when its wait is over, as a HorizontalPodAutoscaler's does.",
    )
    history: list[LoadSample] | None = Field(
        None,
        description="Demand seen by the runs of the last metrics window, and before it each five minutes' most "
        "over the last hour (the scale-down floor's memory), oldest first.",
    )
    capacity: LearnedCapacity | None = None
    forecast: dict[str, SeasonalMemory] | None = Field(
        None, description="Per role, the demand by time of day the law has learned (its seasonal forecast)."
    )
    ttft_stages: TTFTStages | None = None
    slo: SLOStatus | None = None
    last_decision: Decision | None = None
    decisions: int = Field(0, description="Decisions that changed replicas so far.")


class ModelStatus(Model):
    """The model cache's download Job (model.source cache), as the ModelReady condition says it."""

    job: str = Field(description="The download Job this describes.")
    bytes: int | None = Field(None, ge=0, description="Size of the downloaded model.")
    files: int | None = Field(None, ge=0, description="Files downloaded.")
    download_ms: int | None = Field(None, ge=0, description="Time the download took, in milliseconds.")
    failed_attempts: int = Field(0, ge=0, description="Attempts of the Job that failed so far.")
    error: str | None = Field(None, description="How the last failed attempt ended (the tail of its log).")


class PDClusterStatus(Model):
    """Observed state, written once per reconcile."""

    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    prefill: RoleStatus = Field(default_factory=RoleStatus)
    decode: RoleStatus = Field(default_factory=RoleStatus)
    colocated: RoleStatus | None = Field(None, description="The engine pool in colocated mode.")
    flexible: RoleStatus | None = Field(None, description="The engine pool in flexible mode.")
    roles: RoleFlips | None = Field(None, description="Flexible mode: the role assignment and its flips.")
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
    last_progress_time: str | None = Field(
        None,
        description="While a workload is short of its desired state: when one last came closer to it (a pod "
        "created, updated or Ready). `spec.progressDeadlineSeconds` counts from here.",
    )
    model: ModelStatus | None = None
    rollout: str | None = Field(
        None,
        description="While prefill and decode move to a new engine revision: pods updated per role, e.g. "
        "`prefill 1/2, decode 1/3 at revision 3f2a9c81d0e4`.",
    )
