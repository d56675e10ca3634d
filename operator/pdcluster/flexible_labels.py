"""The I/O half of the flexible pool's acting-role labels (flexible.relabels is the rule)."""

from __future__ import annotations

from typing import Any

from pdcluster import constants as C
from pdcluster import flexible
from pdcluster.io.kube import ApiError, Kube


async def label_acting_roles(
    kube: Kube, namespace: str, pods: list[dict[str, Any]], prefill_engines: int
) -> None:
    """Label each flexible engine pod with the role the routers make it act as, so that
    Prometheus files its series under that role (constants.LABEL_ACTING_ROLE)."""
    for name, role in flexible.relabels(pods, prefill_engines).items():
        try:
            await kube.merge_patch(
                "v1", "Pod", name, namespace, {"metadata": {"labels": {C.LABEL_ACTING_ROLE: role}}}
            )
        except ApiError as e:
            if e.status != 404:  # a pod deleted since the cache saw it needs no label
                raise
