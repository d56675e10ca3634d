"""Kubernetes Events for a PDCluster: what the operator did and why, for `kubectl describe`."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from pdcluster import constants as C
from pdcluster.io.kube import ApiError, Kube
from pdcluster.timestamps import time_s

log = logging.getLogger(__name__)
COMPONENT = "pdcluster-operator"
# The same warning on every reconcile would flood the namespace; repeat it at most this often.
REPEAT_AFTER_SECONDS = 600.0
# Keys of deleted PDClusters and of old messages are dropped once there are this many.
PRUNE_AT = 1024


class EventRecorder:
    def __init__(self, kube: Kube):
        self.kube = kube
        self.instance = os.environ.get("POD_NAME") or socket.gethostname()
        self._last: dict[tuple[str, str, str], float] = {}
        self._prune_at = PRUNE_AT

    async def emit(self, owner: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = owner["metadata"]
        key = (meta.get("uid", ""), reason, message)
        now = time.monotonic()
        if now - self._last.get(key, -REPEAT_AFTER_SECONDS) < REPEAT_AFTER_SECONDS:
            return
        self._last[key] = now
        if len(self._last) >= self._prune_at:
            self._last = {k: t for k, t in self._last.items() if now - t < REPEAT_AFTER_SECONDS}
            self._prune_at = max(PRUNE_AT, 2 * len(self._last))  # amortized: prune rarely
        stamp = time_s(datetime.now(UTC))
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": C.API_VERSION,
                "kind": C.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            await self.kube.create(event)
        except ApiError as e:  # events are best effort; never fail a reconcile on them
            log.warning("could not post event %s: %s", reason, e)

    async def normal(self, owner: dict[str, Any], reason: str, message: str) -> None:
        await self.emit(owner, "Normal", reason, message)

    async def warning(self, owner: dict[str, Any], reason: str, message: str) -> None:
        await self.emit(owner, "Warning", reason, message)
