"""What the router tells the operator: its KV hand-off verdicts, in the PDCluster's
router-state ConfigMap (one key per router pod), which the operator watches anyway and
turns into the `KVTransfer` condition. The operator renders the ConfigMap and owns its
metadata; each router owns its own key (a merge patch of `data`), and removes the keys
of router pods that no longer exist, so a dead router's verdicts do not linger."""

from __future__ import annotations

import logging

import orjson

from pdcluster.io.kube import ApiError, Kube

log = logging.getLogger(__name__)


class StatePublisher:
    def __init__(self, kube: Kube, namespace: str, configmap: str, pod: str):
        self.kube = kube
        self.namespace = namespace
        self.configmap = configmap
        self.pod = pod
        self.routers: set[str] = {pod}  # router pods that exist, from the router's pod watch
        self._written: dict[str, object] | None = None
        self._keys: set[str] = set()

    async def publish(self, summary: dict[str, object]) -> None:
        """Write this router's verdicts when they changed; prune departed routers' keys."""
        if summary == self._written and self._keys <= self.routers | {self.pod}:
            return
        data: dict[str, str | None] = {self.pod: orjson.dumps(summary).decode()}
        try:
            current = await self.kube.get("v1", "ConfigMap", self.configmap, self.namespace)
            self._keys = set(current.get("data") or {})
            data |= {key: None for key in self._keys - self.routers - {self.pod}}
            await self.kube.merge_patch("v1", "ConfigMap", self.configmap, self.namespace, {"data": data})
        except ApiError as e:  # the next change tries again
            log.warning("cannot write the KV verdicts to ConfigMap %s: %s", self.configmap, e)
            return
        self._written = summary
        self._keys = {k for k, v in data.items() if v is not None} | (self._keys - set(data))
