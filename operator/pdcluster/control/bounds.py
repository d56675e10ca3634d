"""Bounds from what the engines show, beside the capacity models: a role keeps the engines
it has where their measured busy share and latency hold its target at the grown load,
and a TTFT miss that is a burst's wait, drained before a new engine would start, holds
prefill."""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.control import models
from pdcluster.control.context import Context, Role
from pdcluster.control.observed import prefill_latency, seen_itl_ms
from pdcluster.control.types import MetricsSnapshot

# The busiest a measured prefill bound plans an engine: the queue's sojourn grows as
# 1/(1 - busy), so past this a window's noise in the busy figure decides the answer.
PREFILL_HOLD_BUSY = 0.9


def prefill_busy(m: MetricsSnapshot) -> float | None:
    """The share of the time a prefill engine computes, from what the engines show: steps
    per second times the mean prefill time, per engine. It errs high: a prompt that spans
    several steps counts each of them at its whole prefill time."""
    steps, prefill_ms, ready = m.prefill.steps_per_s, m.prefill.prefill_time_ms, m.prefill.ready
    if steps is None or prefill_ms is None or not ready:
        return None
    return steps * prefill_ms / 1000.0 / ready


def prefill_busy_at(m: MetricsSnapshot, busy: float, growth: float, step_ms: float | None) -> float:
    """The busy share at `growth` times the load. The prompts' tokens grow with it; a
    step's fixed cost `step_ms` is counted at today's steps per second, since prompts that
    arrive while an engine computes join its next step (vLLM schedules what waits, up to
    its token budget): a busier engine runs fuller steps, not more of them. That is exact
    for an engine never idle and low for one mostly idle, whose new prompts start steps
    of their own, so the bound is only used far under the target. Without a known fixed
    cost the whole busy share grows with the load."""
    steps, ready = m.prefill.steps_per_s, m.prefill.ready
    if step_ms is None or not steps or not ready:
        return busy * growth
    fixed = min(steps * step_ms / 1000.0 / ready, busy)
    return fixed + (busy - fixed) * growth


def prefill_holds(ctx: Context, m: MetricsSnapshot, growth: float, step_ms: float | None) -> bool:
    """Whether the prefill engines there are keep the TTFT target at `growth` times the
    load, from what they show: at `busy` a queue's sojourn is its service time over
    (1 - busy) (M/M/1), so the whole TTFT quantile grows by at most
    (1 - busy) / (1 - busy at the grown load) (its fixed part does not grow at all)."""
    ttft, busy = prefill_latency(ctx.auto, m), prefill_busy(m)
    if ttft is None or busy is None:
        return False
    grown_busy = prefill_busy_at(m, busy, growth, step_ms)
    if grown_busy >= PREFILL_HOLD_BUSY:
        return False
    grown = ttft * (1.0 - busy) / (1.0 - grown_busy)
    return grown < ctx.auto.slo.ttft_ms * (1.0 - ctx.tol)


@dataclass(frozen=True)
class Burst:
    """A TTFT miss that is a burst's wait, not a shortage: the queue drains before a
    scale-up's engines would start."""

    wait_x: float  # the observed wait quantile over what the arrival rate explains (M/M/c)
    busy: float  # the share of the time the engines computed (measured)
    drain_s: float  # the queue's drain time on the ready engines
    startup_s: float  # a prefill engine's start-up, pod created to Ready


# A wait quantile this many times what M/M/c gives at the window's arrival rate is a
# batch of arrivals, not a load. Sizing by it scaled with engines (calibrate_prefill) gave
# 6-9 engines to a prefill load of 0.6 at night on the Azure code weekday (the wait 20-400x
# the model's); a sustained load's stayed within 0.2-3.4x over the Mooncake conversation
# hour once its engines were up.
BURST_WAIT_X = 10.0


def burst_of(
    ctx: Context, m: MetricsSnapshot, model: models.PrefillModel, growth: float, step_ms: float | None
) -> Burst | None:
    """The burst behind a TTFT miss, if it is one: the wait is BURST_WAIT_X or more times
    what the arrival rate explains, the engines show they are busy less than
    PREFILL_MAX_BUSY at `growth` times the load (measured, so a profile that flatters the engines
    cannot hide a load), and the ready engines drain the queue within a start-up, so
    engines asked for now would find it gone."""
    if model.wait_scale is None or model.wait_scale < BURST_WAIT_X:
        return None
    busy, ready = prefill_busy(m), m.prefill.ready
    if busy is None or not ready:
        return None
    grown = prefill_busy_at(m, busy, growth, step_ms)
    drain_s = (m.prefill_queue or 0.0) * model.service_s / ready
    startup_s = ctx.startup_s(Role.prefill)
    if grown >= models.PREFILL_MAX_BUSY or drain_s >= startup_s:
        return None
    return Burst(model.wait_scale, busy, drain_s, startup_s)


def decode_spares_one(ctx: Context, m: MetricsSnapshot, engines: int) -> bool:
    """Whether `engines - 1` decode engines keep the ITL and KV targets (`decode_holds` at
    engines / (engines - 1) times the load). Decode whose batches stay too small to fit
    its capacity (short outputs) would otherwise keep an engine it once added for good:
    feedback alone never sheds one."""
    return engines >= 2 and decode_holds(ctx, m, engines / (engines - 1))


def decode_holds(ctx: Context, m: MetricsSnapshot, growth: float) -> bool:
    """Whether the decode engines there are keep the ITL and KV targets at `growth` times
    the sequences each runs now, bounded from what they show. A decode step's time is a
    fixed part (the weights read once) plus parts that grow with the batch and its KV, so
    ITL and KV usage grow by at most `growth`."""
    itl, kv = seen_itl_ms(m, m.decode), m.decode_kv_usage
    if itl is None:
        return False
    keep = 1.0 - ctx.tol
    return itl * growth < ctx.auto.slo.itl_ms * keep and (kv or 0.0) * growth < models.KV_LIMIT * keep
