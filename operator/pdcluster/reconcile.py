"""One level-based reconcile of one PDCluster: the only place that joins the pure core
(api, render, drift, status, control) with I/O (Kubernetes, Prometheus).

    spec + status --(autoscaler)--> replica counts --(render)--> desired children
    desired vs live --(drift)--> server-side apply of what differs
    live children --(status)--> one status write, only if something changed
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import ValidationError

from pdcluster import constants as C
from pdcluster import flexible, metrics, modelready
from pdcluster.api.v1alpha1 import (
    AutoscalingMode,
    AutoscalingState,
    ModelSource,
    ModelStatus,
    PDClusterSpec,
    PDClusterStatus,
    ServingMode,
)
from pdcluster.children import Children, cluster_pods
from pdcluster.drift import in_sync, merge_patch, stamp
from pdcluster.flexible_labels import label_acting_roles
from pdcluster.io.events import EventRecorder
from pdcluster.io.kube import ApiError, Kube
from pdcluster.podstate import observe_pods
from pdcluster.render import Owner, Replicas, apply_stage, mooncake, render_all
from pdcluster.render.engine import kv_revision, workload_kind
from pdcluster.render.model import download_job_name
from pdcluster.render.router import state_configmap_name
from pdcluster.render.scaler import role_scaler, scaler_status
from pdcluster.rollout import Rollout
from pdcluster.rollout import plan as plan_rollout
from pdcluster.status import Observation, Problem, compute_status, stalled_warning

log = logging.getLogger(__name__)

WORKLOAD_ROLES = (
    C.ROLE_PREFILL, C.ROLE_DECODE, C.ROLE_COLOCATED, C.ROLE_FLEXIBLE, C.ROLE_ROUTER, C.ROLE_MOONCAKE_MASTER
)  # fmt: skip


@dataclass
class AutoscaleResult:
    state: AutoscalingState | None
    condition: tuple[bool, str, str] | None = None  # (ok, reason, message) for the Autoscaling condition
    latency_p99_ms: tuple[int | None, int | None] = (None, None)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    mode_fit: tuple[bool, str, str] | None = None  # (fits, reason, message) for the ModeFit condition


class Autoscaler(Protocol):
    """The hook the control law plugs into (see pdcluster.autoscaler)."""

    async def step(
        self, spec: PDClusterSpec, owner: Owner, status: PDClusterStatus, now: datetime
    ) -> AutoscaleResult: ...


@dataclass
class Context:
    kube: Kube
    events: EventRecorder
    autoscaler: Autoscaler | None = None
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    children: Children | None = None  # the watch cache; None: read each child from the apiserver


async def _live(ctx: Context, api_version: str, kind: str, name: str, owner: Owner) -> dict[str, Any] | None:
    if ctx.children is not None and ctx.children.covers(kind):
        return ctx.children.get(kind, owner.namespace, owner.name, name)
    return await ctx.kube.get(api_version, kind, name, owner.namespace)


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _left_behind(live: dict[str, Any] | None, owner: Owner) -> str | None:
    """The uid of an earlier PDCluster of this name that `live` still belongs to. Such a
    child is the garbage collector's to delete: adopting it races the collector, which
    may delete it right after, so the operator deletes it itself (by uid) and creates a
    new one. To keep children across a delete and re-create, delete with
    `--cascade=orphan`: the collector then removes the reference first."""
    for ref in ((live or {}).get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == C.KIND and ref.get("name") == owner.name and ref.get("uid") != owner.uid:
            return str(ref.get("uid"))
    return None


def _workload_role(obj: dict[str, Any]) -> str | None:
    if obj["kind"] in ("StatefulSet", "Deployment", "LeaderWorkerSet"):
        role = obj["metadata"]["labels"][C.LABEL_ROLE]
        return role if role in WORKLOAD_ROLES else None
    return None


def _secret_users(spec: PDClusterSpec) -> list[tuple[str, str, set[str]]]:
    """(secret, key, workload roles that mount it) for every Secret the spec refers to."""
    out = []
    if spec.engine.hf_token_secret:
        ref = spec.engine.hf_token_secret
        out.append((ref.name, ref.key, {C.ROLE_PREFILL, C.ROLE_DECODE}))
    if spec.router.api_key_secret:
        ref = spec.router.api_key_secret
        out.append((ref.name, ref.key, {C.ROLE_ROUTER}))
    if spec.engine.api_key_secret:
        ref = spec.engine.api_key_secret
        out.append((ref.name, ref.key, {C.ROLE_PREFILL, C.ROLE_DECODE, C.ROLE_ROUTER}))
    if spec.tracing.enabled and spec.tracing.headers_secret:
        ref = spec.tracing.headers_secret
        engines = {C.ROLE_PREFILL, C.ROLE_DECODE, C.ROLE_COLOCATED, C.ROLE_FLEXIBLE}
        out.append((ref.name, ref.key, engines | {C.ROLE_ROUTER}))
    return out


async def preflight(kube: Kube, spec: PDClusterSpec, namespace: str) -> tuple[list[Problem], set[str]]:
    """Problems a schema cannot catch (a referenced Secret is missing), and the workload
    roles we must not roll onto a config that cannot start."""
    problems, blocked = [], set()
    for name, key, roles in _secret_users(spec):
        secret = await kube.get("v1", "Secret", name, namespace)
        if secret is None:
            problems.append(
                Problem(
                    "SecretNotFound", f"Secret {namespace}/{name} does not exist; create it with key {key!r}"
                )
            )
        elif key not in (secret.get("data") or {}) and key not in (secret.get("stringData") or {}):
            problems.append(Problem("SecretKeyNotFound", f"Secret {namespace}/{name} has no key {key!r}"))
        else:
            continue
        blocked |= roles
    if mooncake.store_breaks_engine_image(spec):
        # Warned, not blocked: the image may carry the fix another way.
        problems.append(
            Problem(
                "EngineImageKnownBug",
                f"engine image {spec.engine.image!r} with mooncake.store.enabled hits vLLM #43828 "
                "(MultiConnector ends the API server on the first KV hand-off): use the project's "
                "engine image (images/engine) or a vLLM with #43836",
                blocks=False,
            )
        )
    return problems, blocked


def _invalid_spec_status(
    previous: PDClusterStatus, generation: int | None, error: ValidationError, now: datetime
) -> PDClusterStatus:
    details = "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()[:5])
    spec = PDClusterSpec.model_construct()  # only for the shape of compute_status's inputs
    obs = Observation(workloads={}, desired={}, problems=[Problem("InvalidSpec", details)])
    status = compute_status(spec, generation, obs, previous, previous.autoscaling, now)
    return status.model_copy(update={"prefill": previous.prefill, "decode": previous.decode})


async def reconcile(ctx: Context, body: dict[str, Any]) -> PDClusterStatus:
    started = time.monotonic()
    meta = body["metadata"]
    owner = Owner.from_body(body)
    generation = meta.get("generation")
    now = ctx.clock()
    try:
        previous = PDClusterStatus.model_validate(body.get("status") or {})
    except ValidationError:
        previous = PDClusterStatus()  # a status we cannot read is rebuilt, not fatal

    try:
        spec = PDClusterSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        # The CRD schema catches almost everything; this covers objects stored before a
        # schema change. Report and touch nothing.
        status = _invalid_spec_status(previous, generation, e, now)
        await _write_status(ctx, body, previous, status)
        return status

    plan = await _plan(ctx, body, spec, owner, previous, now)
    problems, blocked = await preflight(ctx.kube, spec, owner.namespace)
    live: dict[tuple[str, str], dict[str, Any] | None] = {}
    for obj in plan.desired:
        live[_key(obj)] = await _live(ctx, obj["apiVersion"], obj["kind"], obj["metadata"]["name"], owner)
    applied = {} if spec.paused else await _converge(ctx, owner, plan.desired, live, problems, blocked)

    workloads = {_workload_role(o): live[_key(o)] for o in plan.desired if _workload_role(o) is not None}
    obs = _observation(spec, owner, plan, live, workloads, problems)
    pods = await cluster_pods(ctx.children, ctx.kube, owner.namespace, owner.name)
    observe_pods(obs, spec, previous, pods)
    if spec.mode == ServingMode.flexible and not spec.paused:
        obs.problems += await label_acting_roles(ctx.kube, owner.namespace, pods, plan.replicas.flexible_prefill)
    obs.model = await _model_cache(ctx, spec, owner, live, previous)
    status = compute_status(spec, generation, obs, previous, plan.autoscale.state, now)
    for role, scaler in plan.scalers.items():
        await _report_scale(ctx, owner, role, scaler, workloads.get(role))
    # Status first: events describe what was stored, so a failed write (retried) emits none.
    await _write_status(ctx, body, previous, status)
    await _emit_events(ctx, body, previous, status, applied, plan.autoscale.events, problems)
    metrics.observe_reconcile("degraded" if problems else "ok", time.monotonic() - started)
    return status


@dataclass
class _Plan:
    """The children this reconcile wants, and how it chose their replicas."""

    autoscale: AutoscaleResult
    scalers: dict[str, dict[str, Any]]  # role -> the PDRoleScaler HPA/KEDA write to (external mode)
    replicas: Replicas
    rollout: Rollout
    desired: list[dict[str, Any]]  # rendered and stamped children


async def _plan(
    ctx: Context,
    body: dict[str, Any],
    spec: PDClusterSpec,
    owner: Owner,
    previous: PDClusterStatus,
    now: datetime,
) -> _Plan:
    autoscale = AutoscaleResult(previous.autoscaling)
    scalers: dict[str, dict[str, Any]] = {}
    if spec.autoscaling.enabled and spec.autoscaling.mode == AutoscalingMode.external:
        scalers = await role_scalers(ctx, body, spec, owner)
    elif spec.autoscaling.enabled and ctx.autoscaler is not None:
        autoscale = await ctx.autoscaler.step(spec, owner, previous, now)
    external = {role: obj["spec"]["replicas"] for role, obj in scalers.items()}
    replicas = Replicas.choose(spec, autoscale.state, external)
    for role in spec.engine_roles:
        metrics.DESIRED_REPLICAS.labels(owner.namespace, owner.name, role).set(replicas.of(role))
    rollout = await _rollout(ctx, spec, owner, replicas)
    desired = [stamp(obj) for obj in render_all(spec, owner, replicas, rollout.partitions)]
    return _Plan(autoscale, scalers, replicas, rollout, desired)


async def _rollout(ctx: Context, spec: PDClusterSpec, owner: Owner, replicas: Replicas) -> Rollout:
    """How far prefill and decode may each move to a new engine revision."""
    if spec.mode != ServingMode.disaggregated:
        return Rollout({})  # one pool (colocated, flexible): no pairs of roles to keep at one revision
    engines = {}
    for role in C.ENGINE_ROLES:
        found = await _live(ctx, *workload_kind(spec, role), owner.child(role), owner)
        engines[role] = None if _left_behind(found, owner) else found
    return plan_rollout(kv_revision(spec), engines, {role: replicas.of(role) for role in C.ENGINE_ROLES})


async def _converge(
    ctx: Context,
    owner: Owner,
    desired: list[dict[str, Any]],
    live: dict[tuple[str, str], dict[str, Any] | None],
    problems: list[Problem],
    blocked: set[str],
) -> dict[str, list[str]]:
    """Apply what differs, delete what is left behind or no longer rendered; `live` is
    kept to what the apiserver answered. Returns the children touched, by verb."""
    applied: dict[str, list[str]] = {"Created": [], "Updated": []}
    applied["Deleted"] = await _delete_left_behind(ctx, owner, desired, live, problems)
    stale = [o for o in desired if _workload_role(o) not in blocked and not in_sync(o, live[_key(o)])]
    # A new PDCluster's children: one round trip per stage, not one per child.
    for _, stage in itertools.groupby(stale, key=apply_stage):
        for verb, name in await _apply_stage(ctx, owner, list(stage), live, problems):
            applied[verb].append(name)
    applied["Deleted"] += await _prune(ctx, owner, desired, problems)
    return applied


async def _apply_stage(
    ctx: Context,
    owner: Owner,
    batch: list[dict[str, Any]],
    live: dict[tuple[str, str], dict[str, Any] | None],
    problems: list[Problem],
) -> list[tuple[str, str]]:
    """Apply one stage's children at once; (verb, "Kind name") of each that went through."""
    outcomes = await asyncio.gather(
        *(ctx.kube.apply(obj, field_manager=C.FIELD_MANAGER) for obj in batch), return_exceptions=True
    )
    done = []
    for obj, outcome in zip(batch, outcomes, strict=True):
        name = f"{obj['kind']} {obj['metadata']['name']}"
        if isinstance(outcome, ApiError):
            problems.append(Problem("ApplyFailed", f"{name}: {outcome.message}"))
            continue
        if isinstance(outcome, BaseException):
            raise outcome  # transient (the worker retries) or a bug
        verb = "Created" if live[_key(obj)] is None else "Updated"
        live[_key(obj)] = outcome
        log.info("%s %s/%s %s", verb, owner.namespace, obj["metadata"]["name"], obj["kind"])
        done.append((verb, name))
    return done


def _observation(
    spec: PDClusterSpec,
    owner: Owner,
    plan: _Plan,
    live: dict[tuple[str, str], dict[str, Any] | None],
    workloads: dict[str, dict[str, Any] | None],
    problems: list[Problem],
) -> Observation:
    desired_counts = {
        **{role: plan.replicas.of(role) for role in spec.engine_roles},
        C.ROLE_ROUTER: 0 if spec.suspend else spec.router.replicas,
        C.ROLE_MOONCAKE_MASTER: 0 if spec.suspend else spec.mooncake.master_replicas,
    }
    verdicts = live.get(("ConfigMap", state_configmap_name(owner)))
    return Observation(
        workloads=workloads,
        desired=desired_counts,
        problems=problems,
        autoscaling=plan.autoscale.condition,
        latency_p99_ms=plan.autoscale.latency_p99_ms,
        kv_verdicts=(verdicts or {}).get("data")
        if spec.router.kv_probe.enabled and spec.hands_off_kv
        else None,
        rollout=plan.rollout.progress,
        mode_fit=plan.autoscale.mode_fit,
    )


async def _model_cache(
    ctx: Context,
    spec: PDClusterSpec,
    owner: Owner,
    live: dict[tuple[str, str], dict[str, Any] | None],
    previous: PDClusterStatus,
) -> tuple[modelready.ConditionFields, ModelStatus] | None:
    """The download Job's progress (model.source cache); its pods are read only when they
    hold news: the report of a success, or the error of another failed attempt."""
    if spec.model.source != ModelSource.cache:
        return None
    name = download_job_name(spec, owner)
    job = live.get(("Job", name))
    pods = None
    if modelready.needs_pods(job, previous.model):
        selector = f"{C.LABEL_JOB_NAME}={name}"
        pods = await ctx.kube.list("v1", "Pod", owner.namespace, label_selector=selector)
    return modelready.observe(name, job, pods, previous.model)


async def _emit_events(
    ctx: Context,
    body: dict[str, Any],
    previous: PDClusterStatus,
    status: PDClusterStatus,
    applied: dict[str, list[str]],
    autoscale_events: list[tuple[str, str, str]],
    problems: list[Problem],
) -> None:
    """The events of a reconcile whose status was stored."""
    # One event per verb naming every child, not one per child: a thousand new PDClusters
    # would otherwise post an event for each of their children while the apiserver is busiest.
    applied_events = [
        ("Normal", verb, f"{verb} {', '.join(names)}") for verb, names in applied.items() if names
    ]
    for type_, reason, message in applied_events + autoscale_events:
        await ctx.events.emit(body, type_, reason, message)
    if problems and not _had_condition(previous, "Degraded", problems[0].reason):
        await ctx.events.warning(body, problems[0].reason, problems[0].message)
    if (warning := stalled_warning(previous, status, problems)) is not None:
        await ctx.events.warning(body, *warning)
    if (flip := flexible.flip_event(previous.roles, status.roles)) is not None:
        await ctx.events.normal(body, *flip)
    handoff = next((c for c in status.conditions if c.type == "KVTransfer"), None)
    before = next((c for c in previous.conditions if c.type == "KVTransfer"), None)
    if (
        handoff is not None
        and handoff.status == "False"
        and (before is None or before.message != handoff.message)
    ):
        await ctx.events.warning(body, "KVTransferFailed", handoff.message)


async def _delete_left_behind(
    ctx: Context,
    owner: Owner,
    desired: list[dict[str, Any]],
    live: dict[tuple[str, str], dict[str, Any] | None],
    problems: list[Problem],
) -> list[str]:
    """Delete the rendered children an earlier PDCluster of this name left behind and
    mark them missing, so that the applies after this create them anew."""
    deleted = []
    for obj in desired:
        key = _key(obj)
        found = live[key]
        if found is None or _left_behind(found, owner) is None:
            continue
        try:
            gone = await ctx.kube.delete(
                obj["apiVersion"], obj["kind"], key[1], owner.namespace, uid=found["metadata"]["uid"]
            )
        except ApiError as e:
            problems.append(Problem("DeleteFailed", f"{obj['kind']} {key[1]}: {e.message}"))
            continue
        live[key] = None
        if gone:
            log.info("Deleted %s/%s %s, left by an earlier PDCluster", owner.namespace, key[1], obj["kind"])
            deleted.append(f"{obj['kind']} {key[1]}")
    return deleted


async def _prune(
    ctx: Context, owner: Owner, desired: list[dict[str, Any]], problems: list[Problem]
) -> list[str]:
    """Delete the children this spec no longer renders (the pools of the other mode, a
    store turned off), from the watch cache: without it nothing is deleted. PDRoleScalers
    are never rendered: they belong to their HPA or KEDA and stay."""
    if ctx.children is None:
        return []
    wanted = {_key(obj) for obj in desired}
    deleted = []
    for kind, name, api_version in ctx.children.owned(owner.namespace, owner.name):
        if kind == C.SCALER_KIND or (kind, name) in wanted:
            continue
        child = ctx.children.get(kind, owner.namespace, owner.name, name)
        if child is None or child["metadata"].get("deletionTimestamp"):
            continue  # on its way out already
        try:
            if not await ctx.kube.delete(api_version, kind, name, owner.namespace):
                continue  # gone meanwhile
        except ApiError as e:
            problems.append(Problem("DeleteFailed", f"{kind} {name}: {e.message}"))
            continue
        log.info("Deleted %s/%s %s", owner.namespace, name, kind)
        deleted.append(f"{kind} {name}")
    return deleted


async def role_scalers(
    ctx: Context, body: dict[str, Any], spec: PDClusterSpec, owner: Owner
) -> dict[str, dict[str, Any]]:
    """The PDRoleScalers HPA/KEDA write to, created with the spec's replicas if missing."""
    out = {}
    for role in spec.engine_roles:
        name = owner.child(role)
        obj = await _live(ctx, C.API_VERSION, C.SCALER_KIND, name, owner)
        if obj is not None and _left_behind(obj, owner):
            await ctx.kube.delete(
                C.API_VERSION, C.SCALER_KIND, name, owner.namespace, uid=obj["metadata"]["uid"]
            )
            obj = None
        if obj is None:
            # Create, never apply: after creation spec.replicas belongs to the scaler's
            # user, and an apply by us would take it back (two writers).
            obj = await ctx.kube.create(role_scaler(owner, role, spec.role(role).replicas))
            await ctx.events.normal(body, "Created", f"Created {C.SCALER_KIND} {name}")
        out[role] = obj
    return out


async def _report_scale(
    ctx: Context, owner: Owner, role: str, scaler: dict[str, Any], workload: dict[str, Any] | None
) -> None:
    current = ((workload or {}).get("status") or {}).get("replicas", 0)
    status = scaler_status(owner, role, current)
    if scaler.get("status") == status:
        return
    await ctx.kube.merge_patch(
        C.API_VERSION,
        C.SCALER_KIND,
        scaler["metadata"]["name"],
        owner.namespace,
        {"status": status},
        subresource="status",
    )


def _had_condition(status: PDClusterStatus, type_: str, reason: str) -> bool:
    return any(c.type == type_ and c.status == "True" and c.reason == reason for c in status.conditions)


async def _write_status(
    ctx: Context, body: dict[str, Any], previous: PDClusterStatus, status: PDClusterStatus
) -> None:
    old, new = body.get("status") or {}, status.wire()
    if old == new:
        return  # at rest: no writes
    patch = {"status": merge_patch(old, new)}
    meta = body["metadata"]
    try:
        await ctx.kube.merge_patch(
            C.API_VERSION, C.KIND, meta["name"], meta["namespace"], patch, subresource="status"
        )
    except ApiError as e:
        if e.status != 404:  # deleted meanwhile: nothing to report to
            raise
