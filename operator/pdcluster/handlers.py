"""Thin kopf wiring: watch PDClusters and hand them to the Controller (their children
are watched by children.py; follow.py watches PDClusters too, as kopf can stop).

Only an event handler is used: it needs no finalizer and writes no progress annotation,
so kopf itself never writes to our objects. It is async so that it runs on the event
loop the Controller's workers live on (kopf runs sync handlers in a thread pool).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from pdcluster import constants as C
from pdcluster.controller import Controller
from pdcluster.follow import plain
from pdcluster.io.kube import KubeConfig


def register(registry: kopf.OperatorRegistry, controller: Controller, config: KubeConfig) -> None:
    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Our own EventRecorder posts meaningful events; kopf's per-handler chatter is noise.
        settings.posting.level = logging.WARNING
        # Reconnect watches regularly so an apiserver restart is noticed quickly.
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.connect_timeout = 10
        settings.networking.request_timeout = 30
        settings.persistence.diffbase_storage = _NoDiffBase()
        # A line per event ("Handler ... succeeded") is noise; failures still show.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)

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
    async def pdcluster_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
        meta = body["metadata"]
        if event.get("type") == "DELETED":
            controller.forget(meta["namespace"], meta["name"], meta.get("uid"))
        else:
            controller.observe(plain(body))


class _NoDiffBase(kopf.DiffBaseStorage):
    """No essence kept or compared: with no change handlers kopf uses it for nothing, and
    building it deep-copies every body of every watch event (kopf processing.py
    _detect_causes), most of the operator's CPU while a thousand PDClusters converge."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None
