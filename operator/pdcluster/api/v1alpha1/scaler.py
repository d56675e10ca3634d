"""PDRoleScaler: one role's replicas, for HPA or KEDA through /scale."""

from __future__ import annotations

from pydantic import Field

from pdcluster.api.base import Model


class PDRoleScalerSpec(Model):
    """Desired replicas of one engine role, written by HPA, KEDA or `kubectl scale`."""

    # Not optional: HPA reads /scale before its first write, and a missing field would
    # leave it nothing to start from (as LWS's KEP-849 notes for its role scaler).
    replicas: int = Field(
        1, ge=0, description="Pods wanted for the role; clamped to the role's min/maxReplicas."
    )


class PDRoleScalerStatus(Model):
    """What the /scale subresource reports back."""

    replicas: int = Field(0, description="Pods of the role that exist now.")
    selector: str = Field("", description="Label selector of the role's pods (for HPA's pod metrics).")
