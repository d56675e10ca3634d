"""A small async Kubernetes API client on aiohttp.

The operator, the router (membership) and the local cluster's pod runner need only a
handful of verbs: get, list, watch, server-side apply, merge-patch (status), create and
delete. A thin client over one keep-alive session does them on the event loop kopf
already runs, on plain dicts parsed by orjson. benchmarks/kube_client.py measures the
reason to keep it: the same work against the same apiserver costs the `kubernetes`
package's client (a thread per call) and kubernetes_asyncio (typed models) 2.6 to 5
times our CPU per apply or patch, about 4 times per list and 4 to 8 times per watch
event (docs/benchmarks.md), and the operator's CPU is a share of the same cores the
apiserver needs when a thousand PDClusters converge. Configuration and authentication,
where users' setups vary most, come from the `kubernetes` package's loaders (KubeConfig
below).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

# kind -> (plural, namespaced) for the kinds this project touches.
_RESOURCES: dict[str, tuple[str, bool]] = {
    "Namespace": ("namespaces", False),
    "Node": ("nodes", False),
    "Pod": ("pods", True),
    "Service": ("services", True),
    "ServiceAccount": ("serviceaccounts", True),
    "ConfigMap": ("configmaps", True),
    "Secret": ("secrets", True),
    "Event": ("events", True),
    "Endpoints": ("endpoints", True),
    "StatefulSet": ("statefulsets", True),
    "Deployment": ("deployments", True),
    "ReplicaSet": ("replicasets", True),
    "ControllerRevision": ("controllerrevisions", True),
    "DaemonSet": ("daemonsets", True),
    "Job": ("jobs", True),
    "PersistentVolumeClaim": ("persistentvolumeclaims", True),
    "PersistentVolume": ("persistentvolumes", False),
    "PodDisruptionBudget": ("poddisruptionbudgets", True),
    "NetworkPolicy": ("networkpolicies", True),
    "EndpointSlice": ("endpointslices", True),
    "Role": ("roles", True),
    "RoleBinding": ("rolebindings", True),
    "ClusterRole": ("clusterroles", False),
    "ClusterRoleBinding": ("clusterrolebindings", False),
    "Lease": ("leases", True),
    "CustomResourceDefinition": ("customresourcedefinitions", False),
    "PDCluster": ("pdclusters", True),
    "PDRoleScaler": ("pdrolescalers", True),
    "ServiceMonitor": ("servicemonitors", True),
    "PodMonitor": ("podmonitors", True),
    "LeaderWorkerSet": ("leaderworkersets", True),
    "MutatingWebhookConfiguration": ("mutatingwebhookconfigurations", False),
    "ValidatingWebhookConfiguration": ("validatingwebhookconfigurations", False),
}


class ApiError(Exception):
    """An error answer from the apiserver, with its Status reason and message."""

    def __init__(self, status: int, reason: str, message: str, body: dict[str, Any] | None = None):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}


# JSON writes a character beyond U+FFFF as a surrogate pair of escapes, which JSON parsers
# join and YAML parsers reject; an apply patch is parsed as YAML. Not preceded by an
# escaped backslash: an odd run of backslashes ends in the escape's own.
_SURROGATE_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


def yaml_json(obj: Any) -> str | bytes:
    """`obj` as JSON that is also valid YAML: surrogate pairs become one \\U escape.
    ASCII JSON (nearly every object) needs no escape YAML reads differently."""
    try:
        fast = orjson.dumps(obj)
        if fast.isascii():
            return fast
    except TypeError:  # an integer past 64 bits: json writes it, the apiserver judges it
        pass

    def join(m: re.Match[str]) -> str:
        code = 0x10000 + ((int(m.group(2), 16) - 0xD800) << 10) + (int(m.group(3), 16) - 0xDC00)
        return f"{m.group(1)}\\U{code:08x}"

    return _SURROGATE_PAIR.sub(join, json.dumps(obj))


def _json(body: Any) -> bytes:
    try:
        return orjson.dumps(body)
    except TypeError:  # orjson stops at 64-bit integers; the apiserver judges larger ones
        return json.dumps(body).encode()


def resource_path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    plural, namespaced = _RESOURCES[kind]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespaced and namespace else ""
    return f"{base}{ns}/{plural}" + (f"/{name}" if name else "")


def object_path(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])


@dataclass
class KubeConfig:
    """Where the apiserver is and how to authenticate, as `kubectl` would: read by the
    `kubernetes` package's loaders, which know every kubeconfig users have (client
    certificates, tokens, exec credential plugins such as EKS', GKE's and AKS', OIDC
    refresh, several files in $KUBECONFIG) and the in-cluster service account (whose
    projected token rotates). Tokens that expire are refreshed by the loader's hook
    before a request needs them."""

    server: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    namespace: str = "default"
    insecure: bool = False
    auth: Any = field(default=None, repr=False)  # kubernetes.client.Configuration: the bearer token

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, context: str | None = None) -> KubeConfig:
        """`path` (several, joined by os.pathsep), else $KUBECONFIG, else the in-cluster
        service account, else ~/.kube/config."""
        if path is None:
            path = os.environ.get("KUBECONFIG") or None
        if (
            path is None
            and (SERVICE_ACCOUNT_DIR / "token").exists()
            and "KUBERNETES_SERVICE_HOST" in os.environ
        ):
            return cls.in_cluster()
        return cls.from_file(path or Path.home() / ".kube" / "config", context)

    @classmethod
    def in_cluster(cls) -> KubeConfig:
        from kubernetes import client, config

        auth = client.Configuration()
        config.load_incluster_config(client_configuration=auth)
        namespace = (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
        return cls._from(auth, namespace)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], context: str | None = None) -> KubeConfig:
        from kubernetes import client, config

        auth = client.Configuration()
        config.load_kube_config(
            config_file=str(path), context=context, client_configuration=auth, persist_config=False
        )
        _, active = config.list_kube_config_contexts(config_file=str(path))
        if context is not None:
            contexts, _ = config.list_kube_config_contexts(config_file=str(path))
            active = next(c for c in contexts if c["name"] == context)
        return cls._from(auth, (active.get("context") or {}).get("namespace") or "default")

    @classmethod
    def _from(cls, auth: Any, namespace: str) -> KubeConfig:
        return cls(
            server=auth.host,
            ca_file=auth.ssl_ca_cert,
            cert_file=auth.cert_file,
            key_file=auth.key_file,
            namespace=namespace,
            insecure=not auth.verify_ssl,
            auth=auth,
        )

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def bearer(self) -> str | None:
        """The current token; an expired one is renewed first (an exec plugin runs again,
        a rotated service-account token is read again)."""
        if self.auth is None:
            return None
        if self.auth.refresh_api_key_hook is not None:
            self.auth.refresh_api_key_hook(self.auth)
        # "Bearer x" from a kubeconfig, "bearer x" in a pod (incluster_config.py).
        value = self.auth.api_key.get("BearerToken") or self.auth.api_key.get("authorization") or ""
        scheme, _, token = value.strip().partition(" ")
        return (token if scheme.lower() == "bearer" else value).strip() or None


# Each watch holds one for good (the operator's: about a dozen); the rest carry requests,
# the operator's at most 8 reconciles x the few children of one apply stage.
CONNECTIONS = 64


class Kube:
    """Async client. Use as `async with Kube(KubeConfig.load()) as kube:`."""

    def __init__(self, config: KubeConfig, *, timeout: float = 30.0):
        self.config = config
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=5)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Kube:
        self._session = aiohttp.ClientSession(
            base_url=self.config.server,
            connector=aiohttp.TCPConnector(ssl=self.config.ssl_context(), limit=CONNECTIONS),
            timeout=self._timeout,
            json_serialize=json.dumps,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self.config.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        assert self._session is not None, "use `async with Kube(...)`"
        data = body if body is None or isinstance(body, (str, bytes)) else _json(body)
        async with self._session.request(
            method, path, data=data, params=params, headers=self._headers(content_type if data else None)
        ) as resp:
            raw = await resp.read()
            if resp.status >= 400 and not raw.lstrip().startswith(b"{"):
                # e.g. "404 page not found" for a group/version that is not served (yet)
                raise ApiError(resp.status, resp.reason or "", raw[:500].decode(errors="replace"))
            payload = orjson.loads(raw) if raw else {}
            if resp.status >= 400:
                raise ApiError(
                    resp.status,
                    payload.get("reason", resp.reason or ""),
                    payload.get("message", raw[:500].decode(errors="replace")),
                    payload,
                )
            return payload

    async def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        try:
            return await self.request("GET", resource_path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str | None = None, *, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        payload = await self.request("GET", resource_path(api_version, kind, namespace), params=params)
        items = payload.get("items", [])
        for item in items:  # list items carry no apiVersion/kind
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    async def apply(
        self, obj: dict[str, Any], *, field_manager: str, force: bool = True, dry_run: bool = False
    ) -> dict[str, Any]:
        """Server-side apply: the apiserver merges our fields and tracks ownership."""
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        if dry_run:
            params["dryRun"] = "All"
        return await self.request(
            "PATCH",
            object_path(obj),
            body=yaml_json(obj),
            params=params,
            content_type="application/apply-patch+yaml",
        )

    async def create(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        meta = obj["metadata"]
        params = {"dryRun": "All"} if dry_run else None
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return await self.request("POST", path, body=obj, params=params)

    async def merge_patch(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        path = resource_path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    async def delete(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        grace_period: int | None = None,
        uid: str | None = None,
    ) -> bool:
        """False when there was nothing to delete: no such object, or (with `uid`) one
        that has been replaced by another of the same name."""
        body: dict[str, Any] = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
        }
        if grace_period is not None:
            body["gracePeriodSeconds"] = grace_period
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", resource_path(api_version, kind, namespace, name), body=body)
            return True
        except ApiError as e:
            if e.status == 404 or (e.status == 409 and uid is not None):
                return False
            raise

    async def watch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        resource_version: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yields events forever. After every (re)list it yields ("SYNC", {"items": [...]})
        with the full current state, then ("ADDED"|"MODIFIED"|"DELETED", object) as they
        come; it re-lists when the apiserver says our resourceVersion is too old."""
        assert self._session is not None
        path = resource_path(api_version, kind, namespace)
        while True:
            selectors = {"labelSelector": label_selector, "fieldSelector": field_selector}
            selectors = {key: value for key, value in selectors.items() if value}
            if resource_version is None:
                params = dict(selectors)
                listing = await self.request("GET", path, params=params or None)
                resource_version = listing["metadata"]["resourceVersion"]
                yield "SYNC", {"items": listing.get("items", [])}
            params = {
                "watch": "1",
                "allowWatchBookmarks": "true",
                "resourceVersion": resource_version,
                "timeoutSeconds": str(timeout_seconds),
            }
            params |= selectors
            try:
                async with self._session.get(
                    path,
                    params=params,
                    headers=self._headers(),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=timeout_seconds + 30),
                ) as resp:
                    if resp.status == 410:
                        resource_version = None
                        continue
                    if resp.status >= 400:
                        raise ApiError(resp.status, resp.reason or "", await resp.text())
                    async for line in resp.content:
                        if not line.strip():
                            continue
                        event = orjson.loads(line)
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            if obj.get("code") == 410:
                                resource_version = None
                            break
                        resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
                        if event["type"] != "BOOKMARK":
                            yield event["type"], obj
            except (TimeoutError, aiohttp.ClientError):
                await asyncio.sleep(1.0)


@contextlib.asynccontextmanager
async def connect(kubeconfig: str | os.PathLike[str] | None = None) -> AsyncIterator[Kube]:
    async with Kube(KubeConfig.load(kubeconfig)) as kube:
        yield kube
