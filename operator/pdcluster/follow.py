"""The operator's own watch of PDClusters, beside kopf's.

kopf serves only the resources its API discovery finds, and looks again on every change
of a CustomResourceDefinition (kopf _core/reactor/observation.py). A restarted apiserver
rewrites the CRDs' status while it is still installing their paths ("the request has
been made before all known HTTP paths have been installed"): kopf's look at that moment
finds no PDClusters, logs "Unresolved resources cannot be served" and stops watching
them until the next CRD change, which may never come; spec changes then went unseen.
This watch lists again after any failure, whatever the apiserver answered, so the
Controller keeps every PDCluster's latest body. Events arriving twice (here and from
kopf) are harmless: observing a body is idempotent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from pdcluster import constants as C
from pdcluster.controller import Controller
from pdcluster.io.kube import ApiError, Kube

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 30.0


async def follow(kube: Kube, namespaces: list[str], controller: Controller) -> None:
    """Watch PDClusters in `namespaces` (empty: cluster-wide) until cancelled."""
    scopes: list[str | None] = list(namespaces) or [None]
    await asyncio.gather(*(_follow(kube, namespace, controller) for namespace in scopes))


async def _follow(kube: Kube, namespace: str | None, controller: Controller) -> None:
    retry = RETRY_SECONDS
    while True:
        try:
            async for event, obj in kube.watch(C.API_VERSION, C.KIND, namespace):
                if event == "SYNC":
                    retry = RETRY_SECONDS
                    synced(controller, namespace, obj["items"])
                elif event == "DELETED":
                    meta = obj["metadata"]
                    controller.forget(meta["namespace"], meta["name"], meta.get("uid"))
                else:
                    controller.observe(plain(obj))
        except (ApiError, aiohttp.ClientError, TimeoutError) as e:
            log.warning("PDCluster watch failed (%s); listing again in %gs", e, retry)
            await asyncio.sleep(retry)
            retry = min(retry * 2, MAX_RETRY_SECONDS)


def synced(controller: Controller, namespace: str | None, items: list[dict[str, Any]]) -> None:
    """A fresh list: every PDCluster in it observed, the ones gone meanwhile forgotten."""
    listed = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in items}
    for key, worker in list(controller.workers.items()):
        if (namespace is None or key[0] == namespace) and key not in listed:
            controller.forget(*key, worker.uid)
    for body in listed.values():
        controller.observe(plain(body))


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A PDCluster as the controller keeps it until its reconcile: managedFields are not read."""
    meta = {key: value for key, value in body["metadata"].items() if key != "managedFields"}
    return {**body, "metadata": meta}
