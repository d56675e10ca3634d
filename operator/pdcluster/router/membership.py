"""The router's live view of its engines (`Pool`), kept equal to the desired membership
(discovery.py) and to the flexible pool's split.

Prefill instances, decode engines and colocated engines are kept by URL. A prefill
instance becomes routable once its bootstrap server has told us its DP ranks' engine ids
(`GET /query`); each rank is then its own `Upstream`. Ids are re-queried periodically and
after a failure, so a restarted instance (a new random engine_id: vLLM's
config/kv_transfer.py) is picked up. Colocated engines form a plain pool: each serves a
request whole, with no KV hand-off, and is routable as soon as it is ready.

Flexible engines (vLLM's MooncakeConnector as `kv_both`) are prefill or decode by the
request's kv_transfer_params alone, so the router decides each one's role by
pdcluster.flexible's rule over the ready ones in pool order. A new split applies at once
(`assign`); requests in flight on an engine whose role changed finish there (a kv_both
engine does both at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from pdcluster import flexible
from pdcluster.constants import (
    ROLE_COLOCATED,
    ROLE_DECODE,
    ROLE_PREFILL,
)
from pdcluster.router.policy import Backend
from pdcluster.router.protocol import BootstrapError, MooncakeProtocol, PrefillEngine
from pdcluster.router.upstream import Origin

if TYPE_CHECKING:
    from pdcluster.router.discovery import Members

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


def assign_roles(engines: list[str], prefill_engines: int) -> dict[str, str]:
    """Each flexible engine's role, the engines in pool order (pdcluster.flexible)."""
    if len(engines) == 1:
        return {engines[0]: ROLE_COLOCATED}
    prefill, _ = flexible.split(len(engines), prefill_engines)
    return {e: ROLE_PREFILL if n < prefill else ROLE_DECODE for n, e in enumerate(engines)}


class _PrefillInstance:
    def __init__(self, url: str, bootstrap_addr: str, revision: str = ""):
        self.url = url
        self.bootstrap_addr = bootstrap_addr
        self.revision = revision
        self.ranks: list[Upstream] = []
        self.task: asyncio.Task[None] | None = None
        self.stale = asyncio.Event()


class _FlexibleEngine:
    """A kv_both engine: its prefill ranks (once its bootstrap server names them), and
    itself as a decode engine and as an engine serving requests whole."""

    def __init__(self, instance: _PrefillInstance, members: Members):
        url = instance.url
        name, revision = members.names.get(url, ""), instance.revision
        self.instance = instance
        self.decode = Upstream(url, ROLE_DECODE, url=url, name=name, revision=revision)
        self.whole = Upstream(url, ROLE_COLOCATED, url=url, name=name, revision=revision)
        self.ordinal = members.ordinals.get(url, 0)

    def upstreams(self) -> list[Upstream]:
        return [*self.instance.ranks, self.decode, self.whole]


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
        self._flexible: dict[str, _FlexibleEngine] = {}
        self.prefill_engines = 1  # of the flexible engines, how many act as prefill
        self.roles: dict[str, str] = {}  # flexible engine URL -> its role now
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
        self._follow_flexible(members)
        self._publish()

    def _follow_flexible(self, members: Members) -> None:
        for url in set(self._flexible) - set(members.flexible):
            self._drop_flexible(url)
        for url, bootstrap_addr in members.flexible.items():
            engine = self._flexible.get(url)
            revision = members.revisions.get(url, "")
            if engine is not None and (engine.instance.bootstrap_addr, engine.instance.revision) != (
                bootstrap_addr,
                revision,
            ):
                self._drop_flexible(url)  # another engine at this address
                engine = None
            if engine is None:
                instance = _PrefillInstance(url, bootstrap_addr, revision)
                engine = self._flexible[url] = _FlexibleEngine(instance, members)
                instance.task = asyncio.get_running_loop().create_task(self._resolve(instance))
            engine.ordinal = members.ordinals.get(url, 0)

    def _drop_flexible(self, url: str) -> None:
        engine = self._flexible.pop(url)
        if engine.instance.task is not None:
            engine.instance.task.cancel()
        for upstream in engine.upstreams():
            upstream.gone.set()
            self.on_forget(upstream.id)

    def assign(self, prefill_engines: int) -> None:
        """How many flexible engines act as prefill: the operator's split, applied now."""
        if prefill_engines != self.prefill_engines:
            log.info("flexible engines acting as prefill: %d -> %d", self.prefill_engines, prefill_engines)
            self.prefill_engines = prefill_engines
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
        engines = sorted(self._flexible.values(), key=lambda e: (e.ordinal, e.instance.url))
        roles = assign_roles([e.instance.url for e in engines], self.prefill_engines)
        for engine in engines:
            role = roles[engine.instance.url]
            if role == ROLE_PREFILL:
                self.prefill += engine.instance.ranks
            elif role == ROLE_DECODE:
                self.decode.append(engine.decode)
            else:
                self.colocated.append(engine.whole)
        flipped = [url for url, role in roles.items() if self.roles.get(url, role) != role]
        if flipped:
            log.info("flexible engines changed role: %s", ", ".join(f"{u} -> {roles[u]}" for u in flipped))
        self.roles = roles
        self.changed.set()

    def invalidate(self, upstream: Upstream) -> None:
        """A request to this prefill failed: re-query its engine ids now."""
        for instance in self._instances():
            if upstream in instance.ranks:
                instance.stale.set()

    def _instances(self) -> list[_PrefillInstance]:
        """Every engine with a bootstrap server: prefill instances and flexible engines."""
        return [*self._prefill.values(), *(e.instance for e in self._flexible.values())]

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
            "flexible": {"prefill_engines": self.prefill_engines, "roles": self.roles},
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
        for instance in self._instances():
            if instance.task is not None:
                instance.task.cancel()
        tasks = [i.task for i in self._instances() if i.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)


