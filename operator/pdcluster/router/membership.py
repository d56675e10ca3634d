"""Which engines the router may use: from static flags, EndpointSlices or Pods.

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

Colocated engines (role `colocated`) form a plain pool: each serves a request whole, with
no KV hand-off, and is routable as soon as it is ready.

A prefill instance becomes routable once its bootstrap server has told us its DP
ranks' engine ids (`GET /query`); each rank is then its own `Upstream`. Ids are
re-queried periodically and after a failure, so a restarted instance (new random
engine_id, see vllm==0.33.0 config/kv_transfer.py) is picked up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdcluster.constants import (
    BOOTSTRAP_PORT,
    ENGINE_PORT,
    LABEL_CLUSTER,
    LABEL_KV_REVISION,
    LABEL_LWS_WORKER_INDEX,
    LABEL_ROLE,
    ROLE_COLOCATED,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_ROUTER,
)
from pdcluster.io.kube import ApiError, Kube
from pdcluster.router.policy import Backend
from pdcluster.router.protocol import BootstrapError, MooncakeProtocol, PrefillEngine
from pdcluster.router.upstream import Origin

log = logging.getLogger(__name__)

REQUERY_INTERVAL_S = 30.0
RETRY_INTERVAL_S = 0.5
# The circuit breaker: an engine that failed is skipped for COOLDOWN_S, doubled with
# every failure in a row up to COOLDOWN_MAX_S; one success closes it again.
COOLDOWN_S = 2.0
COOLDOWN_MAX_S = 30.0
OPEN_AFTER_FAILURES = 3  # when the breaker counts as open, for the metric


@dataclass(eq=False)
class Upstream(Backend):
    """A routable engine: a prefill DP rank, a decode instance or a colocated engine."""

    url: str = ""
    name: str = ""  # its pod's name where known, else its URL
    revision: str = ""  # pdcluster.io/kv-revision: only equal revisions exchange KV
    engine: PrefillEngine | None = None  # prefill only
    cooldown_until: float = 0.0  # not routable before this (monotonic) time
    failures: int = 0  # in a row
    # Set when the router drops this engine (prefill: also a new engine id at its address):
    # KV it holds for a decode can no longer arrive.
    gone: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    origin: Origin = field(init=False)

    def __post_init__(self) -> None:
        self.origin = Origin.parse(self.url)
        self.name = self.name or self.url

    def failed(self, now: float) -> bool:
        """Count a failure; True when it opens the breaker."""
        self.failures += 1
        self.cooldown_until = now + min(COOLDOWN_S * 2 ** (self.failures - 1), COOLDOWN_MAX_S)
        return self.failures == OPEN_AFTER_FAILURES

    def succeeded(self) -> None:
        self.failures = 0


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


def parse_static(prefill: Iterable[str], decode: Iterable[str], colocated: Iterable[str] = ()) -> Members:
    """`--prefill URL[#bootstrap=PORT]`, `--decode URL` and `--colocated URL` values."""
    prefills = {}
    for spec in prefill:
        url, _, fragment = spec.partition("#")
        url = url.rstrip("/")
        port = BOOTSTRAP_PORT
        if fragment:
            key, _, value = fragment.partition("=")
            if key != "bootstrap" or not value.isdigit():
                raise ValueError(f"--prefill {spec!r}: expected URL[#bootstrap=PORT]")
            port = int(value)
        prefills[url] = f"http://{_host(Origin.parse(url).host)}:{port}"
    decodes = frozenset(d.rstrip("/") for d in decode)
    plain = frozenset(e.rstrip("/") for e in colocated)
    for url in decodes | plain:
        Origin.parse(url)
    return Members(prefills, decodes, plain)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def members_from_slices(slices: Iterable[dict[str, Any]]) -> Members:
    prefill: dict[str, str] = {}
    decode: set[str] = set()
    plain: set[str] = set()
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
            if role == ROLE_PREFILL:
                prefill[url] = f"http://{host}:{ports.get('bootstrap') or BOOTSTRAP_PORT}"
            else:
                (decode if role == ROLE_DECODE else plain).add(url)
    return Members(prefill, frozenset(decode), frozenset(plain))


def members_from_pods(pods: Iterable[dict[str, Any]]) -> Members:
    prefill: dict[str, str] = {}
    decode: set[str] = set()
    plain: set[str] = set()
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
        if role == ROLE_PREFILL:
            prefill[url] = f"http://{host}:{ports.get('bootstrap') or BOOTSTRAP_PORT}"
        else:
            (decode if role == ROLE_DECODE else plain).add(url)
    return Members(prefill, frozenset(decode), frozenset(plain), names, revisions, frozenset(routers))


_ENGINE_ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_COLOCATED)

_DISCOVERY = {
    "endpointslices": ("discovery.k8s.io/v1", "EndpointSlice", members_from_slices),
    "pods": ("v1", "Pod", members_from_pods),
}


class _PrefillInstance:
    def __init__(self, url: str, bootstrap_addr: str, revision: str = ""):
        self.url = url
        self.bootstrap_addr = bootstrap_addr
        self.revision = revision
        self.ranks: list[Upstream] = []
        self.task: asyncio.Task[None] | None = None
        self.stale = asyncio.Event()


class Pool:
    """The router's live view of its backends."""

    def __init__(
        self, session: aiohttp.ClientSession, on_forget: Callable[[str], None] = lambda backend_id: None
    ):
        self.session = session
        self.on_forget = on_forget  # a backend's cached state (prefix cache, rate) is gone
        self._prefill: dict[str, _PrefillInstance] = {}
        self._decode: dict[str, Upstream] = {}
        self._colocated: dict[str, Upstream] = {}
        self.prefill: list[Upstream] = []  # routable prefill ranks
        self.decode: list[Upstream] = []
        self.colocated: list[Upstream] = []  # colocated: a plain pool
        self.changed = asyncio.Event()  # set on every change (tests, readiness)
        self.names: dict[str, str] = {}
        self.revisions: dict[str, str] = {}
        self.routers: frozenset[str] = frozenset()

    # ---------------------------------------------------------------- membership
    def update(self, members: Members) -> None:
        self.names = members.names
        self.revisions = members.revisions
        self.routers = members.routers
        for url in set(self._prefill) - set(members.prefill):
            self._drop_prefill(url)
        for url, bootstrap_addr in members.prefill.items():
            instance = self._prefill.get(url)
            revision = members.revisions.get(url, "")
            if instance is not None and (instance.bootstrap_addr, instance.revision) != (
                bootstrap_addr,
                revision,
            ):
                self._drop_prefill(url)  # another engine at this address
                instance = None
            if instance is None:
                instance = _PrefillInstance(url, bootstrap_addr, revision)
                self._prefill[url] = instance
                instance.task = asyncio.get_running_loop().create_task(self._resolve(instance))
        self._follow(self._decode, members.decode, ROLE_DECODE, members)
        self._follow(self._colocated, members.colocated, ROLE_COLOCATED, members)
        self._publish()

    def _follow(self, known: dict[str, Upstream], urls: frozenset[str], role: str, members: Members) -> None:
        """Make `known` (engines addressed by URL alone) hold exactly `urls`."""
        for url in set(known) - urls:
            gone = known.pop(url)
            gone.gone.set()
            self.on_forget(gone.id)
        for url in set(known) & urls:
            if known[url].revision != members.revisions.get(url, ""):
                self.on_forget(known.pop(url).id)  # a new engine at the same address
        for url in urls - set(known):
            known[url] = Upstream(
                url, role, url=url, name=members.names.get(url, ""), revision=members.revisions.get(url, "")
            )

    def _drop_prefill(self, url: str) -> None:
        instance = self._prefill.pop(url)
        if instance.task is not None:
            instance.task.cancel()
        for rank in instance.ranks:
            rank.gone.set()
            self.on_forget(rank.id)

    def _publish(self) -> None:
        self.prefill = [rank for instance in self._prefill.values() for rank in instance.ranks]
        self.decode = list(self._decode.values())
        self.colocated = list(self._colocated.values())
        self.changed.set()

    def invalidate(self, upstream: Upstream) -> None:
        """A request to this prefill failed: re-query its engine ids now."""
        for instance in self._prefill.values():
            if upstream in instance.ranks:
                instance.stale.set()

    async def _resolve(self, instance: _PrefillInstance) -> None:
        """Query the engine ids, soon again while the answer is changing or empty (DP
        ranks register one by one as their KV caches are allocated), then every
        REQUERY_INTERVAL_S, or at once after `invalidate`."""
        interval = RETRY_INTERVAL_S
        while True:
            try:
                engines = await MooncakeProtocol.query(self.session, instance.bootstrap_addr)
            except BootstrapError as e:
                if instance.ranks:
                    log.warning("prefill %s unusable until its bootstrap answers: %s", instance.url, e)
                    self._set_ranks(instance, [])
                await asyncio.sleep(RETRY_INTERVAL_S)
                continue
            if engines != [r.engine for r in instance.ranks]:
                self._set_ranks(instance, engines)
                interval = RETRY_INTERVAL_S
            elif engines:
                interval = min(interval * 2, REQUERY_INTERVAL_S)
            instance.stale.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(instance.stale.wait(), interval)

    def _set_ranks(self, instance: _PrefillInstance, engines: list[PrefillEngine]) -> None:
        for rank in instance.ranks:
            rank.gone.set()
            self.on_forget(rank.id)
        many = len(engines) > 1
        instance.ranks = [
            Upstream(
                f"{instance.url}#dp{e.dp_rank}" if many else instance.url,
                ROLE_PREFILL,
                url=instance.url,
                name=self.names.get(instance.url, instance.url) + (f"#dp{e.dp_rank}" if many else ""),
                revision=instance.revision,
                engine=e,
            )
            for e in engines
        ]
        if engines:
            log.info("prefill %s: engines %s", instance.url, [e.engine_id for e in engines])
        self._publish()

    # ---------------------------------------------------------------- views
    def routable(self, upstreams: list[Upstream], now: float) -> list[Upstream]:
        """Upstreams not cooling down after a failure (all of them if every one is)."""
        healthy = [u for u in upstreams if u.cooldown_until <= now]
        return healthy or upstreams

    @property
    def ready(self) -> bool:
        return (bool(self.prefill) and bool(self.decode)) or bool(self.colocated)

    def describe(self) -> dict[str, Any]:
        def one(u: Upstream) -> dict[str, Any]:
            out = {
                "id": u.id,
                "name": u.name,
                "revision": u.revision,
                "url": u.url,
                "inflight_requests": u.inflight_requests,
                "inflight_tokens": u.inflight_tokens,
            }
            if u.engine is not None:
                out |= {
                    "engine_id": u.engine.engine_id,
                    "dp_rank": u.engine.dp_rank,
                    "bootstrap_addr": u.engine.bootstrap_addr,
                }
            return out

        return {
            "prefill_instances": {
                url: {"bootstrap_addr": i.bootstrap_addr, "ranks": len(i.ranks)}
                for url, i in self._prefill.items()
            },
            "prefill": [one(u) for u in self.prefill],
            "decode": [one(u) for u in self.decode],
            "colocated": [one(u) for u in self.colocated],
        }

    def all_upstreams(self) -> list[Upstream]:
        return [*self.prefill, *self.decode, *self.colocated]

    def load_snapshot(self) -> tuple[list[Upstream], dict[str, int]]:
        """Every engine, and the count of each role's: the router's load gauges."""
        counts = {"prefill": len(self.prefill), "decode": len(self.decode), "colocated": len(self.colocated)}
        return self.all_upstreams(), counts

    async def close(self) -> None:
        for instance in self._prefill.values():
            if instance.task is not None:
                instance.task.cancel()
        tasks = [i.task for i in self._prefill.values() if i.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)


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
