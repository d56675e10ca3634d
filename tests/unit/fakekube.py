"""An in-memory apiserver for unit tests of reconcile: get, list, create, server-side
apply, merge patch (status included) and delete, with the semantics our objects rely on.

Server-side apply is modelled for one applying manager with others writing by merge
patch: each object keeps the fields its applier last sent and those others patched in;
the live object is the others' fields overlaid with the applier's (force: ours win), so
a field the applier stops sending is gone unless someone else set it, which is what the
apiserver's managed fields do. Every write is logged in order, events included."""

from __future__ import annotations

import asyncio
import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

from pdcluster.children import Children
from pdcluster.io.kube import ApiError


def _merge(base: Any, patch: Any) -> Any:
    """RFC 7386: null deletes."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base) if isinstance(base, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


@dataclass
class _Stored:
    applied: dict[str, Any] = field(default_factory=dict)  # the field manager's last apply
    others: dict[str, Any] = field(default_factory=dict)  # created or merge-patched by others
    status: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # uid, resourceVersion, generation


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], _Stored] = {}
        self.writes: list[tuple[str, str, str]] = []  # (verb, kind, name) in order
        self.fail_status_writes: ApiError | None = None
        self.fail_applies: dict[tuple[str, str], ApiError] = {}  # (kind, name) -> the apiserver's answer
        self.applying = self.most_applying = 0  # applies in flight: now, and the most at once
        self._versions = itertools.count(1)
        self._uids: set[str] = set()
        self._caches: list[Children] = []

    # ------------------------------------------------------------------ helpers
    def _live(self, stored: _Stored) -> dict[str, Any]:
        obj = _merge(stored.others, stored.applied)
        obj.setdefault("metadata", {}).update(copy.deepcopy(stored.meta))
        if stored.status:
            obj["status"] = copy.deepcopy(stored.status)
        return obj

    def _uid(self, name: str) -> str:
        """uid-<name> the first time, as tests expect; a new one for each re-creation."""
        uid = f"uid-{name}"
        while uid in self._uids:
            uid = f"uid-{name}-{len(self._uids)}"
        self._uids.add(uid)
        return uid

    def _bump(self, stored: _Stored) -> None:
        stored.meta["resourceVersion"] = str(next(self._versions))
        self._refresh()

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """An object as a user would create it (kubectl create)."""
        meta = obj["metadata"]
        stored = _Stored(others=copy.deepcopy({k: v for k, v in obj.items() if k != "status"}))
        stored.meta = {"uid": self._uid(meta["name"]), "generation": 1}
        stored.status = copy.deepcopy(obj.get("status") or {})
        self.objects[(obj["kind"], meta.get("namespace", ""), meta["name"])] = stored
        self._bump(stored)
        return self._live(stored)

    def live(self, kind: str, name: str, namespace: str = "ns") -> dict[str, Any] | None:
        stored = self.objects.get((kind, namespace, name))
        return self._live(stored) if stored else None

    def list_sync(self, kind: str) -> list[dict[str, Any]]:
        return [self._live(s) for (k, _, _), s in self.objects.items() if k == kind]

    def children(self) -> Children:
        """The operator's children cache, kept up to date by every write here, as its
        watches would keep it (without their delay)."""
        cache = Children()
        self._caches.append(cache)
        self._refresh()
        return cache

    def _refresh(self) -> None:
        for cache in self._caches:
            for kind in cache.indexes:
                cache.replace(
                    kind, None, [self._live(s) for (k, _, _), s in self.objects.items() if k == kind]
                )

    def written(self, verb: str | None = None) -> list[tuple[str, str, str]]:
        return [w for w in self.writes if verb is None or w[0] == verb]

    # ------------------------------------------------------------------ the client
    async def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> dict[str, Any] | None:
        return self.live(kind, name, namespace or "")

    async def list(
        self, api_version: str, kind: str, namespace: str | None = None, *, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        wanted = dict(p.split("=", 1) for p in label_selector.split(",")) if label_selector else {}
        out = []
        for (k, ns, _), stored in self.objects.items():
            obj = self._live(stored)
            labels = obj["metadata"].get("labels") or {}
            if k == kind and (namespace is None or ns == namespace) and wanted.items() <= labels.items():
                out.append(obj)
        return out

    async def create(self, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        meta = obj["metadata"]
        key = (obj["kind"], meta.get("namespace", ""), meta["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f"{obj['kind']} {meta['name']} already exists")
        self.writes.append(("create", obj["kind"], meta["name"]))
        return self.put(obj)

    async def apply(
        self, obj: dict[str, Any], *, field_manager: str, force: bool = True, dry_run: bool = False
    ) -> dict[str, Any]:
        meta = obj["metadata"]
        self.applying += 1
        self.most_applying = max(self.most_applying, self.applying)
        await asyncio.sleep(0)  # a round trip: others may start meanwhile
        self.applying -= 1
        if (failure := self.fail_applies.get((obj["kind"], meta["name"]))) is not None:
            raise failure
        key = (obj["kind"], meta.get("namespace", ""), meta["name"])
        stored = self.objects.get(key)
        if stored is None:
            stored = self.objects[key] = _Stored(meta={"uid": self._uid(meta["name"]), "generation": 1})
        elif stored.applied.get("spec") != obj.get("spec"):
            stored.meta["generation"] += 1
        stored.applied = copy.deepcopy(obj)
        self._bump(stored)
        self.writes.append(("apply", obj["kind"], meta["name"]))
        return self._live(stored)

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
        stored = self.objects.get((kind, namespace or "", name))
        if stored is None:
            raise ApiError(404, "NotFound", f"{kind} {name} not found")
        if subresource == "status":
            if self.fail_status_writes is not None:
                raise self.fail_status_writes
            stored.status = _merge(stored.status, patch.get("status") or {})
        else:
            stored.others = _merge(stored.others, patch)
            stored.applied = _merge(stored.applied, {k: v for k, v in patch.items() if k in stored.applied})
        self._bump(stored)
        self.writes.append(("patch-" + (subresource or "object"), kind, name))
        return self._live(stored)

    async def delete(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        uid: str | None = None,
        **_: Any,
    ) -> bool:
        self.writes.append(("delete", kind, name))
        key = (kind, namespace or "", name)
        if key not in self.objects or (uid is not None and self.objects[key].meta["uid"] != uid):
            return False  # not found, or a precondition conflict: nothing deleted
        del self.objects[key]
        self._refresh()
        return True
