"""Leader election on a coordination.k8s.io Lease, so two operator replicas never both
write replicas (the "two writers" failure other planners hit)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from datetime import UTC, datetime, timedelta

from pdcluster.io.kube import ApiError, Kube
from pdcluster.timestamps import micro_time, parse

log = logging.getLogger(__name__)


def _now() -> datetime:
    return datetime.now(UTC)


def _parse(s: str | None) -> datetime | None:
    return parse(s) if s else None


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str = "pdcluster-operator",
        *,
        duration: int = 15,
        renew_every: float = 5.0,
    ):
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.duration = duration
        self.renew_every = renew_every
        self.identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        self.leading = asyncio.Event()
        self._path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"

    async def run(self) -> None:
        """Acquire and renew forever; `leading` is set only while we hold the lease."""
        while True:
            try:
                ok = await self._try_acquire_or_renew()
            except (TimeoutError, ApiError, OSError) as e:
                log.warning("leader election: %s", e)
                ok = False
            if ok and not self.leading.is_set():
                log.info("became leader as %s", self.identity)
                self.leading.set()
            elif not ok and self.leading.is_set():
                log.warning("lost leadership")
                self.leading.clear()
            await asyncio.sleep(self.renew_every)

    async def release(self) -> None:
        if not self.leading.is_set():
            return
        self.leading.clear()
        try:
            lease = await self.kube.request("GET", self._path)
            if lease["spec"].get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = None
                await self.kube.request("PUT", self._path, body=lease)
        except (ApiError, OSError) as e:
            log.warning("could not release lease: %s", e)

    async def _try_acquire_or_renew(self) -> bool:
        now = _now()
        try:
            lease = await self.kube.request("GET", self._path)
        except ApiError as e:
            if e.status != 404:
                raise
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(now, now, 0),
            }
            try:
                await self.kube.request("POST", self._path.rsplit("/", 1)[0], body=body)
                return True
            except ApiError as e2:
                if e2.status == 409:
                    return False
                raise
        spec = lease.get("spec", {})
        holder = spec.get("holderIdentity")
        renewed = _parse(spec.get("renewTime"))
        expired = renewed is None or now > renewed + timedelta(
            seconds=spec.get("leaseDurationSeconds", self.duration)
        )
        if holder not in (None, self.identity) and not expired:
            return False
        transitions = spec.get("leaseTransitions", 0) + (0 if holder == self.identity else 1)
        acquired = spec.get("acquireTime") if holder == self.identity else None
        lease["spec"] = self._spec(_parse(acquired) or now, now, transitions)
        try:
            # resourceVersion in the body makes this a compare-and-swap.
            await self.kube.request("PUT", self._path, body=lease)
            return True
        except ApiError as e:
            if e.status == 409:
                return False
            raise

    def _spec(self, acquired: datetime, renewed: datetime, transitions: int) -> dict:
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.duration,
            "acquireTime": micro_time(acquired),
            "renewTime": micro_time(renewed),
            "leaseTransitions": transitions,
        }
