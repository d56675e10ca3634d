"""Which engines the router may use, as `Members`: from static flags, EndpointSlices or
Pods; and the flexible pool's split, from the roles ConfigMap.

The operator's headless Services carry `pdcluster.io/cluster` and `pdcluster.io/role`
labels, which their EndpointSlices inherit. An endpoint counts when its `ready`
condition is not false (the API says an unset condition means ready); the API port is
the one named `http`, the Mooncake bootstrap port the one named `bootstrap`.

Pods (`--discovery pods`) carry the same labels; a pod counts when it is Ready and not
being deleted, with the container ports named `http`/`bootstrap` (default 8000/8998).
This is for clusters whose EndpointSlices cannot hold the pod addresses (the local test
cluster gives pods loopback addresses, which EndpointSlice validation rejects).

A role spanning nodes runs as LeaderWorkerSet groups: only each group's leader serves
(worker index 0); its Service `<cluster>-<role>-leaders` selects the leaders alone.

Flexible engines are ordered by their pods' ordinals (from the pod name, which an
endpoint's targetRef carries), or by the order of `--flexible`; the operator writes how
many of them act as prefill in the `<cluster>-router-roles` ConfigMap (`watch_roles`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from pdcluster.constants import (
    BOOTSTRAP_PORT,
    ENGINE_PORT,
    KEY_PREFILL_ENGINES,
    LABEL_CLUSTER,
    LABEL_KV_REVISION,
    LABEL_LWS_WORKER_INDEX,
    LABEL_ROLE,
    ROLE_COLOCATED,
    ROLE_DECODE,
    ROLE_FLEXIBLE,
    ROLE_PREFILL,
    ROLE_ROUTER,
)
from pdcluster.io.kube import ApiError, Kube
from pdcluster.router.upstream import Origin

if TYPE_CHECKING:
    from pdcluster.router.membership import Pool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Members:
    """Desired membership: prefill API URL -> bootstrap base URL, decode API URLs, and
    colocated engines' API URLs."""

    prefill: dict[str, str] = field(default_factory=dict)
    decode: frozenset[str] = frozenset()
    colocated: frozenset[str] = frozenset()
    names: dict[str, str] = field(default_factory=dict)  # engine URL -> pod name
    revisions: dict[str, str] = field(default_factory=dict)  # engine URL -> its kv-revision label
    routers: frozenset[str] = frozenset()  # router pod names (pod discovery only)
    flexible: dict[str, str] = field(default_factory=dict)  # flexible engine URL -> bootstrap base URL
    ordinals: dict[str, int] = field(default_factory=dict)  # flexible engine URL -> its place in the pool


def parse_static(
    prefill: Iterable[str], decode: Iterable[str], colocated: Iterable[str] = (), flexible: Iterable[str] = ()
) -> Members:
    """`--prefill URL[#bootstrap=PORT]`, `--decode URL`, `--colocated URL` and
    `--flexible URL[#bootstrap=PORT]` values."""
    prefills = dict(_with_bootstrap(spec, "--prefill") for spec in prefill)
    flexibles = dict(_with_bootstrap(spec, "--flexible") for spec in flexible)
    decodes = frozenset(d.rstrip("/") for d in decode)
    plain = frozenset(e.rstrip("/") for e in colocated)
    for url in decodes | plain:
        Origin.parse(url)
    ordinals = {url: n for n, url in enumerate(flexibles)}
    return Members(prefills, decodes, plain, flexible=flexibles, ordinals=ordinals)


def _with_bootstrap(spec: str, flag: str) -> tuple[str, str]:
    """(API URL, bootstrap base URL) of a `URL[#bootstrap=PORT]` value."""
    url, _, fragment = spec.partition("#")
    url = url.rstrip("/")
    port = BOOTSTRAP_PORT
    if fragment:
        key, _, value = fragment.partition("=")
        if key != "bootstrap" or not value.isdigit():
            raise ValueError(f"{flag} {spec!r}: expected URL[#bootstrap=PORT]")
        port = int(value)
    return url, f"http://{_host(Origin.parse(url).host)}:{port}"


def _ordinal(name: str) -> int | None:
    """A StatefulSet pod's ordinal, from its name."""
    tail = name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else None


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def members_from_slices(slices: Iterable[dict[str, Any]]) -> Members:
    prefill: dict[str, str] = {}
    decode: set[str] = set()
    plain: set[str] = set()
    flexible: dict[str, str] = {}
    names: dict[str, str] = {}
    for s in slices:
        role = ((s.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE)
        if role not in _ENGINE_ROLES:
            continue
        ports = {p.get("name"): p.get("port") for p in s.get("ports") or [] if isinstance(p, dict)}
        http = ports.get("http")
        if not http:
            continue
        for endpoint in s.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            host = _host(addresses[0])
            url = f"http://{host}:{http}"
            if name := (endpoint.get("targetRef") or {}).get("name"):
                names[url] = name
            bootstrap = f"http://{host}:{ports.get('bootstrap') or BOOTSTRAP_PORT}"
            _place(role, url, bootstrap, prefill, decode, plain, flexible)
    return Members(
        prefill, frozenset(decode), frozenset(plain), names, flexible=flexible, ordinals=_ordinals(flexible, names)
    )


def _place(
    role: str, url: str, bootstrap: str, prefill: dict[str, str], decode: set[str], plain: set[str],
    flexible: dict[str, str],
) -> None:  # fmt: skip
    if role == ROLE_PREFILL:
        prefill[url] = bootstrap
    elif role == ROLE_FLEXIBLE:
        flexible[url] = bootstrap
    else:
        (decode if role == ROLE_DECODE else plain).add(url)


def _ordinals(flexible: dict[str, str], names: dict[str, str]) -> dict[str, int]:
    """Flexible engines' places in the pool: their pods' ordinals, else their URLs' order."""
    by_name = {url: _ordinal(names.get(url, "")) for url in flexible}
    unnamed = sorted(url for url, n in by_name.items() if n is None)
    last = max((n for n in by_name.values() if n is not None), default=-1)
    return {url: n if n is not None else last + 1 + unnamed.index(url) for url, n in by_name.items()}


def members_from_pods(pods: Iterable[dict[str, Any]]) -> Members:
    prefill: dict[str, str] = {}
    decode: set[str] = set()
    plain: set[str] = set()
    flexible: dict[str, str] = {}
    names: dict[str, str] = {}
    revisions: dict[str, str] = {}
    routers: set[str] = set()
    for pod in pods:
        meta = pod.get("metadata") or {}
        role = (meta.get("labels") or {}).get(LABEL_ROLE)
        if role == ROLE_ROUTER and not meta.get("deletionTimestamp"):
            routers.add(meta.get("name", ""))
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if role not in _ENGINE_ROLES or not ip or meta.get("deletionTimestamp"):
            continue
        if (meta.get("labels") or {}).get(LABEL_LWS_WORKER_INDEX, "0") != "0":
            continue  # a multi-node group's worker: its leader serves the group
        conditions = status.get("conditions") or []
        if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            continue
        ports = {
            port.get("name"): port.get("containerPort")
            for container in (pod.get("spec") or {}).get("containers") or []
            for port in container.get("ports") or []
        }
        host = _host(ip)
        url = f"http://{host}:{ports.get('http') or ENGINE_PORT}"
        names[url] = meta.get("name", url)
        revisions[url] = (meta.get("labels") or {}).get(LABEL_KV_REVISION, "")
        bootstrap = f"http://{host}:{ports.get('bootstrap') or BOOTSTRAP_PORT}"
        _place(role, url, bootstrap, prefill, decode, plain, flexible)
    return Members(
        prefill, frozenset(decode), frozenset(plain), names, revisions, frozenset(routers), flexible,
        _ordinals(flexible, names),
    )  # fmt: skip


_ENGINE_ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_COLOCATED, ROLE_FLEXIBLE)


_DISCOVERY = {
    "endpointslices": ("discovery.k8s.io/v1", "EndpointSlice", members_from_slices),
    "pods": ("v1", "Pod", members_from_pods),
}


async def watch_kube(
    kube: Kube, namespace: str, cluster: str, pool: Pool, discovery: str = "endpointslices"
) -> None:
    """Keep `pool` equal to the ready engines of the cluster, from its EndpointSlices or
    its Pods (see the module docstring)."""
    api_version, kind, members = _DISCOVERY[discovery]
    selector = f"{LABEL_CLUSTER}={cluster}"
    while True:
        objects: dict[str, dict[str, Any]] = {}
        try:
            async for event, obj in kube.watch(api_version, kind, namespace, label_selector=selector):
                if event == "SYNC":
                    objects = {item["metadata"]["name"]: item for item in obj["items"]}
                elif event == "DELETED":
                    objects.pop(obj["metadata"]["name"], None)
                else:
                    objects[obj["metadata"]["name"]] = obj
                pool.update(members(objects.values()))
        except (ApiError, aiohttp.ClientError, TimeoutError) as e:
            log.warning("%s watch failed (%s); retrying", kind, e)
            await asyncio.sleep(1.0)


async def watch_roles(kube: Kube, namespace: str, configmap: str, pool: Pool) -> None:
    """Keep `pool`'s split of its flexible engines equal to the roles ConfigMap's. By name:
    the router may read that one ConfigMap (RBAC resourceNames holds for a list or watch
    by metadata.name)."""
    while True:
        try:
            async for event, obj in kube.watch(
                "v1", "ConfigMap", namespace, field_selector=f"metadata.name={configmap}"
            ):
                items = obj["items"] if event == "SYNC" else [obj] if event != "DELETED" else []
                for item in items:
                    _apply_roles(item, pool)
        except (ApiError, aiohttp.ClientError, TimeoutError) as e:
            log.warning("ConfigMap %s watch failed (%s); retrying", configmap, e)
            await asyncio.sleep(1.0)


def _apply_roles(configmap: dict[str, Any], pool: Pool) -> None:
    value = (configmap.get("data") or {}).get(KEY_PREFILL_ENGINES, "")
    if not value.isdigit():
        log.warning("ConfigMap %s: %s is %r, not a count; roles unchanged", configmap["metadata"]["name"],
                    KEY_PREFILL_ENGINES, value)  # fmt: skip
        return
    pool.assign(int(value))
