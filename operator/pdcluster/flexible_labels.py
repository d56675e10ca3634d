"""The I/O half of the flexible pool's acting-role labels (flexible.relabels is the rule)."""

from __future__ import annotations

from typing import Any

from pdcluster import constants as C
from pdcluster import flexible
from pdcluster.io.kube import ApiError, Kube
from pdcluster.status import Problem


async def label_acting_roles(
    kube: Kube, namespace: str, pods: list[dict[str, Any]], prefill_engines: int
) -> list[Problem]:
    """Label each flexible engine pod with the role the routers make it act as, so that
    Prometheus files its series under that role (constants.LABEL_ACTING_ROLE). A label
    that cannot be written is a warning, not a stop: routing does not depend on it, only
    the law's per-role metrics do."""
    for name, role in flexible.relabels(pods, prefill_engines).items():
        try:
            await kube.merge_patch(
                "v1", "Pod", name, namespace, {"metadata": {"labels": {C.LABEL_ACTING_ROLE: role}}}
            )
        except ApiError as e:
            if e.status != 404:  # a pod deleted since the cache saw it needs no label
                why = f"Pod {name}: {C.LABEL_ACTING_ROLE} not written ({e.message}); the operator needs patch on pods"
                return [Problem("ActingRoleLabelFailed", why, blocks=False)]
    return []
