"""Thin kopf wiring: watch PDClusters and their children, hand everything to the Controller.

Only event and index handlers are used: they need no finalizers and write no progress
annotations, so kopf itself never writes to our objects. They are async so that they run
on the event loop the Controller's workers live on (kopf runs sync handlers in a thread
pool). The indexes are the children cache reconcile reads (children.py).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from pdcluster import constants as C
from pdcluster.children import KINDS, Children, owner_of
from pdcluster.controller import Controller
from pdcluster.io.kube import KubeConfig


def register(
    registry: kopf.OperatorRegistry, controller: Controller, config: KubeConfig, children: Children
) -> None:
    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Our own EventRecorder posts meaningful events; kopf's per-handler chatter is noise.
        settings.posting.level = logging.WARNING
        # Reconnect watches regularly so an apiserver restart is noticed quickly.
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.connect_timeout = 10
        settings.networking.request_timeout = 30

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(
            server=config.server,
            ca_path=config.ca_file,
            insecure=config.insecure,
            scheme="Bearer" if config.bearer() else None,
            token=config.bearer(),
            certificate_path=config.cert_file,
            private_key_path=config.key_file,
            default_namespace=config.namespace,
        )

    @kopf.on.event(C.GROUP, C.VERSION, C.PLURAL, registry=registry)
    async def pdcluster_event(event: dict[str, Any], body: kopf.Body, **kwargs: Any) -> None:
        if not children.indexes:  # kopf hands its indexes to handlers only
            children.indexes = {kind: kwargs[_index_id(plural)] for (_, _, plural), kind in KINDS.items()}
        meta = body["metadata"]
        if event.get("type") == "DELETED":
            controller.forget(meta["namespace"], meta["name"], meta.get("uid"))
        else:
            controller.observe(_plain(body))

    for (group, version, plural), _kind in KINDS.items():
        managed = {C.LABEL_MANAGED_BY: C.MANAGED_BY}

        @kopf.index(group, version, plural, labels=managed, registry=registry, id=_index_id(plural))
        async def child(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]] | None:
            owner = owner_of(body)
            return {(body["metadata"]["namespace"], owner): _plain(body)} if owner else None

        @kopf.on.event(group, version, plural, labels=managed, registry=registry, id=f"child-{plural}")
        async def child_event(body: kopf.Body, **_: Any) -> None:
            owner = owner_of(body)
            if owner:
                controller.wake(body["metadata"]["namespace"], owner)


def _index_id(plural: str) -> str:
    return f"children_{plural}"


def _plain(body: kopf.Body) -> dict[str, Any]:
    return {key: body[key] for key in body}
