"""PDRoleScalers: one per engine role when autoscaling.mode is `external`."""

from __future__ import annotations

from typing import Any

from pdcluster import constants as C
from pdcluster.render.names import Owner, metadata, selector


def role_scaler(owner: Owner, role: str, replicas: int) -> dict[str, Any]:
    """Created once with the role's starting replicas; from then on its spec belongs to
    whoever scales it (HPA, KEDA, a person), and the operator only reads it."""
    return {
        "apiVersion": C.API_VERSION,
        "kind": C.SCALER_KIND,
        "metadata": metadata(owner, role),
        "spec": {"replicas": replicas},
    }


def scaler_status(owner: Owner, role: str, current: int) -> dict[str, Any]:
    labels = ",".join(f"{k}={v}" for k, v in selector(owner, role).items())
    return {"replicas": current, "selector": labels}
