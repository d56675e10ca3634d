"""What a run noticed on the way to its decision: typed notes, worded only when the
decision's reason is written."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class NoteKind(StrEnum):
    clamped = "Clamped"  # the stored count lay outside the role's bounds
    over_budget = "OverBudget"  # the stored counts exceed a (lowered) GPU budget
    scale_up_timed_out = "ScaleUpTimedOut"
    feedback_only = "FeedbackOnly"  # the role's capacity is not learned yet
    queueing_share = "QueueingShare"  # TTFT without queueing nearly fills the target
    beyond_limit = "BeyondLimit"  # the role needs more engines than it may have
    reactive = "Reactive"  # the SLO is missed although the model sees enough engines
    measured_holds = "MeasuredHolds"  # the fit asks for more engines; what they show bounds it
    burst_drains = "BurstDrains"  # TTFT missed in a burst the ready engines drain before a start-up
    donor_misses = "DonorMisses"  # budget full, the other role misses its own target
    donor_needs = "DonorNeeds"  # budget full, the other role needs all its engines
    free_shared = "FreeShared"  # both roles miss: free GPUs shared between them
    rebalance_futile = "RebalanceFutile"  # both roles miss: moving engines would not help
    rebalancing = "Rebalancing"
    blocked = "Blocked"  # a scale-up within the block after a timeout
    up_waiting = "UpWaiting"  # a scale-up within its stabilization window
    taking_waits = "TakingWaits"  # a shortfall not yet seen for the window taking needs
    down_waiting = "DownWaiting"  # a scale-down within its stabilization window
    cooling_down = "CoolingDown"
    starting = "Starting"  # colocated: the scale-up asked for is still starting
    saturated = "Saturated"  # colocated: sized by throughput, not by the queue
    unmeasured = "Unmeasured"  # colocated: the window has not yet seen every engine serving


_TEXT: dict[NoteKind, str | dict[str, str]] = {
    NoteKind.clamped: "{role} {value} outside [{low}, {high}]: clamped",
    NoteKind.over_budget: "over the GPU budget {budget}: cut to {prefill}:{decode}",
    NoteKind.scale_up_timed_out: "{role} scale-up to {target} not ready after {waited:.0f} s "
    "({ready} ready{stuck}): falling back to {fallback}, no {who}scale-up for {timeout} s",
    NoteKind.feedback_only: "{unseen}: feedback only",
    NoteKind.queueing_share: "TTFT without queueing is {fixed_ms:.0f} ms: prefill sized for queueing "
    "under {queueing_ms:.0f} ms",
    NoteKind.beyond_limit: {
        "prefill": "prefill load of {load:.1f} engines needs more than {limit}",
        "decode": "decode needs more than {limit} engines for ITL {target_ms:.0f} ms",
        "colocated": "the pool needs more than {limit} engines",
    },
    NoteKind.reactive: "{role} SLO missed although the model sees enough engines: +1",
    NoteKind.measured_holds: {
        "decode": "the fit asks for {want} decode engines, but ITL {itl_ms:.0f} ms and KV usage {kv:.0%} "
        "at {growth:.2f}x the load stay within the targets: {engines} held",
        "prefill": "the fit asks for {want} prefill engines, but TTFT {ttft_ms:.0f} ms at {busy:.0%} busy "
        "stays within the target at {growth:.2f}x the load: {engines} held",
    },
    NoteKind.burst_drains: "TTFT {ttft_ms:.0f} ms is a burst's wait ({wait_x:.0f}x what the arrival rate "
    "explains, engines {busy:.0%} busy), drained in {drain_s:.0f} s before a new engine starts "
    "({startup_s:.0f} s): {engines} held",
    NoteKind.donor_misses: "GPU budget {budget} full and {role} misses its own target",
    NoteKind.donor_needs: "GPU budget {budget} full and {role} needs its {engines} engines",
    NoteKind.free_shared: "both roles miss their targets: free GPUs shared towards {prefill}:{decode}",
    NoteKind.rebalance_futile: "both roles miss their targets (model needs {need_prefill}:{need_decode}) "
    "and moving engines would not help enough",
    NoteKind.rebalancing: "both roles miss their targets (model needs {need_prefill}:{need_decode}): "
    "rebalancing towards {prefill}:{decode}",
    NoteKind.blocked: "{who}scale-up blocked until {until} (earlier timeout)",
    NoteKind.up_waiting: "{who}scale-up wanted for {wanted:.0f}/{needed} s",
    NoteKind.taking_waits: "{role} short for {wanted:.0f}/{window} s before taking from {donor}",
    NoteKind.down_waiting: "{who}scale-down to {want} wanted for {waited:.0f}/{needed} s",
    NoteKind.cooling_down: "cooling down after the change at {since}",
    NoteKind.starting: "scale-up to {target} under way ({ready} ready)",
    NoteKind.unmeasured: "the window saw {measured:.1f} of the {engines} engines serving",
    NoteKind.saturated: "saturated: {backlog:.2f}x the prompt tokens it computes arrive",
}


@dataclass(frozen=True)
class Note:
    """What a run noticed: its kind, the role it concerns, and the figures its text quotes."""

    kind: NoteKind
    role: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        template = _TEXT[self.kind]
        if isinstance(template, dict):
            template = template[self.role or ""]
        # `who`: the role, where the note does not go without saying (a colocated pool's).
        who = f"{self.role} " if self.role and self.role != "colocated" else ""
        unschedulable = self.figures.get("unschedulable")
        stuck = f", {unschedulable} unschedulable" if unschedulable else ""
        return template.format(role=self.role, who=who, stuck=stuck, **self.figures)


def note(kind: NoteKind, role: str | None = None, **figures: Any) -> Note:
    return Note(kind, role, figures)


def worded(notes: Sequence[Note]) -> str:
    return "; ".join(n.text for n in notes)


def with_notes(reason: str, notes: Sequence[Note]) -> str:
    """The reason with the notes in brackets, when there are any."""
    return f"{reason} ({worded(notes)})" if notes else reason
