"""The prefill:decode control law (pure: no I/O, no clock; time is passed in)."""

from pdcluster.control.law import decide
from pdcluster.control.types import MetricsSnapshot, Observed, RoleMetrics, RoleObserved

__all__ = ["MetricsSnapshot", "Observed", "RoleMetrics", "RoleObserved", "decide"]
