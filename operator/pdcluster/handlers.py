"""Thin kopf wiring: watch PDClusters and their children, hand everything to the Controller.

Only event handlers are used: they need no finalizers and write no progress annotations,
so kopf itself never writes to our objects. They are async so that they run on the event
loop the Controller's workers live on (kopf runs sync handlers in a thread pool).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from pdcluster import constants as C
from pdcluster.controller import Controller
from pdcluster.io.kube import KubeConfig

# Child kinds whose changes should wake their PDCluster's worker (drift repair, status).
CHILD_RESOURCES = [
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    # HPA/KEDA scaling a role in `external` mode must take effect at once.
    (C.GROUP, C.VERSION, C.SCALER_PLURAL),
]


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
            controller.observe(_plain(body))

    for group, version, plural in CHILD_RESOURCES:

        @kopf.on.event(
            group,
            version,
            plural,
            labels={C.LABEL_MANAGED_BY: C.MANAGED_BY},
            registry=registry,
            id=f"child-{plural}",
        )
        async def child_event(body: kopf.Body, **_: Any) -> None:
            meta = body["metadata"]
            for ref in meta.get("ownerReferences") or []:
                if ref.get("kind") == C.KIND and ref.get("apiVersion", "").startswith(f"{C.GROUP}/"):
                    controller.wake(meta["namespace"], ref["name"])


def _plain(body: kopf.Body) -> dict[str, Any]:
    return {key: body[key] for key in body}
