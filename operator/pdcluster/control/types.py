"""Inputs of the control law: what Prometheus showed and what the StatefulSets report."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoleMetrics:
    """Engine-side (vLLM) view of one pool over the rate window.

    Latencies are at the SLO quantile, in milliseconds; None when the pool had no
    observations in the window.
    """

    ttft_ms: float | None = None  # vllm:time_to_first_token_seconds (prefill: queue + prefill)
    itl_ms: float | None = None  # vllm:inter_token_latency_seconds
    queue_time_ms: float | None = None  # mean of vllm:request_queue_time_seconds (time WAITING)
    queue_time_q_ms: float | None = None  # the same at the SLO quantile
    prefill_time_ms: float | None = (
        None  # mean of vllm:request_prefill_time_seconds (scheduled to first token)
    )
    steps_per_s: float | None = None  # engine steps (vllm:iteration_tokens_total observations), summed
    tokens_per_s: float | None = None  # prefill, colocated: prompt tokens computed; decode: tokens generated
    ready: float | None = None  # engines reporting, mean over the window
    running: float | None = None  # requests RUNNING, summed over the engines (window mean)
    waiting: float | None = None  # requests WAITING, summed over the engines (window mean)
    kv_usage: float | None = None  # 0..1, mean over the engines (window mean)
    # Prompt lengths the engines finished in the window (vllm:request_prompt_tokens):
    # (bucket upper bound, requests in that bucket), the last bound +Inf.
    prompt_tokens: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class MetricsSnapshot:
    """One window of metrics as PromQL returns them.

    `ttft_ms` / `itl_ms` are the router's (user-visible) quantiles; the per-role ones come
    from vLLM. A field is None when its series was absent; the whole snapshot is None when
    Prometheus could not be asked at all.
    """

    window_s: int
    request_rate: float  # requests arriving per second (router prompt tokens / mean prompt)
    request_rate_before: float | None = None  # the same over the window before this one
    ttft_ms: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None  # the router's quantile of each stream's mean time per output token
    ttft_beyond_prefill_ms: float | None = None  # the router's TTFT beyond prefill quantile
    mean_input_tokens: float | None = None
    mean_output_tokens: float | None = None
    prefill_queue: float | None = None  # requests WAITING, summed over prefill engines (window mean)
    decode_kv_usage: float | None = None  # 0..1, mean over decode engines (window mean)
    prefix_hit_ratio: float | None = None  # share of prompt tokens served from the prefix cache
    ttft_mean_ms: float | None = None  # the router's, mean
    router_prefill_ms: float | None = None  # arrival at the router to the prefill's answer, mean
    router_after_prefill_ms: float | None = None  # the prefill's answer to the first token, mean
    kv_handoff_ms: float | None = None  # vllm:mooncake_xfer_time_seconds (prefill pushes), mean
    prefill: RoleMetrics = field(default_factory=RoleMetrics)
    decode: RoleMetrics = field(default_factory=RoleMetrics)
    colocated: RoleMetrics = field(default_factory=RoleMetrics)


@dataclass(frozen=True)
class TTFTBreakdown:
    """Where the mean time to first token went (ms), from the router's and the engines'
    histograms: the router's share (parsing, admission, transport), the prefill engine's
    queue and compute, the KV hand-off, and the decode engine's wait for its first step."""

    router_ms: float
    prefill_queue_ms: float
    prefill_compute_ms: float
    kv_handoff_ms: float
    decode_wait_ms: float

    @property
    def largest(self) -> str:
        parts = {
            "router": self.router_ms,
            "prefill queue": self.prefill_queue_ms,
            "prefill compute": self.prefill_compute_ms,
            "KV hand-off": self.kv_handoff_ms,
            "decode wait": self.decode_wait_ms,
        }
        return max(parts, key=parts.__getitem__)


def breakdown(m: MetricsSnapshot) -> TTFTBreakdown | None:
    """None without the router's stage histograms (no streamed requests in the window).
    Without the engines' transfer time (vLLM 0.32's MooncakeConnector exports none; 0.33's
    exports vllm:mooncake_xfer_time_seconds) the hand-off counts as decode wait."""
    total, before, after = m.ttft_mean_ms, m.router_prefill_ms, m.router_after_prefill_ms
    if total is None or before is None or after is None:
        return None
    queue = min(max(m.prefill.queue_time_ms or 0.0, 0.0), before)
    compute = min(max(m.prefill.prefill_time_ms or 0.0, 0.0), before - queue)
    handoff = min(max(m.kv_handoff_ms or 0.0, 0.0), after)
    router = max(total - before - after, 0.0) + (before - queue - compute)
    return TTFTBreakdown(router, queue, compute, handoff, after - handoff)


@dataclass(frozen=True)
class RoleObserved:
    """One StatefulSet as the operator sees it."""

    desired: int  # spec.replicas
    replicas: int  # pods that exist
    ready: int  # pods that are ready
    unschedulable: int = 0  # pods Pending with reason Unschedulable
    # Seconds from a pod's creation to Ready, as measured (None: not measured yet); how far
    # ahead of a ramp a scale-up must start.
    startup_s: float | None = None


@dataclass(frozen=True)
class Observed:
    prefill: RoleObserved
    decode: RoleObserved
    colocated: RoleObserved = RoleObserved(0, 0, 0)

    def role(self, name: str) -> RoleObserved:
        roles = {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}
        if name not in roles:
            raise ValueError(f"no engine role {name!r} (prefill, decode or colocated)")
        return roles[name]


# Over 60 lines by its signature alone: one keyword per series of series.py, which the
# operator's PromQL and the simulator's evaluator both fill by name.
def assemble(
    *,
    window_s: int,
    prompt_tokens_rate: float | None = None,
    prompt_tokens_rate_before: float | None = None,
    finished_rate: float | None = None,
    generated_tokens_rate: float | None = None,
    prefilled_tokens_rate: float | None = None,
    prefilled_rate: float | None = None,
    decode_tokens_rate: float | None = None,
    prefix_queries_rate: float | None = None,
    prefix_hits_rate: float | None = None,
    ttft_ms: float | None = None,
    ttft_beyond_prefill_ms: float | None = None,
    ttft_mean_ms: float | None = None,
    router_prefill_ms: float | None = None,
    router_after_prefill_ms: float | None = None,
    kv_handoff_ms: float | None = None,
    itl_ms: float | None = None,
    tpot_ms: float | None = None,
    prefill_ttft_ms: float | None = None,
    decode_itl_ms: float | None = None,
    queue_time_ms: float | None = None,
    queue_time_q_ms: float | None = None,
    prefill_time_ms: float | None = None,
    prefill_steps_rate: float | None = None,
    prefill_queue: float | None = None,
    decode_running: float | None = None,
    decode_kv_usage: float | None = None,
    prefill_ready: float | None = None,
    decode_ready: float | None = None,
    prompt_tokens: tuple[tuple[float, float], ...] = (),
    colocated_prompt_tokens_rate: float | None = None,
    colocated_finished_rate: float | None = None,
    colocated_ttft_ms: float | None = None,
    colocated_queue_time_q_ms: float | None = None,
    colocated_itl_ms: float | None = None,
    colocated_kv_usage: float | None = None,
    colocated_waiting: float | None = None,
    colocated_ready: float | None = None,
) -> MetricsSnapshot:
    """A snapshot from per-second rates of the router's and the engines' counters.

    The router counts prompt tokens when it dispatches and requests when they finish, so
    under a backlog finished requests understate demand. The arrival rate is therefore
    prompt tokens arriving / mean prompt, the mean prompt taken from what the prefill
    engines finished (vllm:prompt_tokens / vllm:request_success on prefill; on the
    colocated engines in colocated mode).
    """
    prompt_tokens_rate = prompt_tokens_rate or 0.0
    prefilled_tokens_rate, prefilled_rate = prefilled_tokens_rate or 0.0, prefilled_rate or 0.0
    finished_rate, generated_tokens_rate = finished_rate or 0.0, generated_tokens_rate or 0.0
    isl = prefilled_tokens_rate / prefilled_rate if prefilled_rate > 0 else 0.0
    if isl <= 0 and colocated_finished_rate:  # colocated: the engines' own count, as prefill's
        isl = (colocated_prompt_tokens_rate or 0.0) / colocated_finished_rate
    if isl <= 0 and finished_rate > 0:  # prefill counted requests but no tokens in the window
        isl = prompt_tokens_rate / finished_rate
    if isl <= 0:
        return MetricsSnapshot(window_s, 0.0)
    return MetricsSnapshot(
        window_s=window_s,
        request_rate=prompt_tokens_rate / isl,
        request_rate_before=None if prompt_tokens_rate_before is None else prompt_tokens_rate_before / isl,
        ttft_ms=ttft_ms,
        itl_ms=itl_ms,
        tpot_ms=tpot_ms,
        ttft_beyond_prefill_ms=ttft_beyond_prefill_ms,
        mean_input_tokens=isl,
        mean_output_tokens=generated_tokens_rate / finished_rate if finished_rate > 0 else None,
        prefill_queue=prefill_queue,
        decode_kv_usage=decode_kv_usage,
        prefix_hit_ratio=(prefix_hits_rate or 0.0) / prefix_queries_rate if prefix_queries_rate else None,
        ttft_mean_ms=ttft_mean_ms,
        router_prefill_ms=router_prefill_ms,
        router_after_prefill_ms=router_after_prefill_ms,
        kv_handoff_ms=kv_handoff_ms,
        prefill=RoleMetrics(
            ttft_ms=prefill_ttft_ms,
            queue_time_ms=queue_time_ms,
            queue_time_q_ms=queue_time_q_ms,
            prefill_time_ms=prefill_time_ms,
            steps_per_s=prefill_steps_rate,
            tokens_per_s=prefilled_tokens_rate,
            ready=prefill_ready,
            prompt_tokens=prompt_tokens,
        ),
        decode=RoleMetrics(
            itl_ms=decode_itl_ms, tokens_per_s=decode_tokens_rate, ready=decode_ready, running=decode_running
        ),
        colocated=RoleMetrics(
            ttft_ms=colocated_ttft_ms,
            itl_ms=colocated_itl_ms,
            queue_time_q_ms=colocated_queue_time_q_ms,
            tokens_per_s=colocated_prompt_tokens_rate,
            ready=colocated_ready,
            waiting=colocated_waiting,
            kv_usage=colocated_kv_usage,
        ),
    )
