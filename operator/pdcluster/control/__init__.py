"""The control laws (pure: no I/O, no clock; time is passed in)."""

from pdcluster.control.law import decide, decide_outcome
from pdcluster.control.notes import NoteKind
from pdcluster.control.types import MetricsSnapshot, Observed, RoleMetrics, RoleObserved

__all__ = [
    "MetricsSnapshot",
    "NoteKind",
    "Observed",
    "RoleMetrics",
    "RoleObserved",
    "decide",
    "decide_outcome",
]
