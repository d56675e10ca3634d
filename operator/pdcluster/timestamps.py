"""The one place timestamps are written and read. Kubernetes has two wire formats
(apimachinery meta/v1: Time, RFC 3339 in whole seconds, for conditions and events;
MicroTime, microseconds, for a Lease's acquire and renew times); our own status fields
(the autoscaler's decisions and holds) keep milliseconds, so that times passed to the
control law survive a status round trip."""

from __future__ import annotations

from datetime import UTC, datetime


def time_s(t: datetime) -> str:
    """metav1.Time."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(t: datetime) -> str:
    """metav1.MicroTime."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def time_ms(t: datetime) -> str:
    """Our status fields: RFC 3339 with milliseconds."""
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse(s: str) -> datetime:
    """Any of the three (Python 3.11 reads RFC 3339 with or without a fraction)."""
    return datetime.fromisoformat(s.replace("Z", "+00:00"))
