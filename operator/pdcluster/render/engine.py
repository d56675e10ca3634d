"""Engine pools (prefill and decode, or colocated): a StatefulSet (a LeaderWorkerSet
for a role spanning nodes), a headless Service and a PDB per role.

vLLM is launched as its MooncakeConnector expects (vLLM docs/features/mooncake_connector_usage.md
and mooncake_connector.py): `--kv-transfer-config` with kv_producer on prefill and
kv_consumer on decode, the bootstrap server on prefill (VLLM_MOONCAKE_BOOTSTRAP_PORT),
VLLM_HOST_IP set to the pod IP (the connector advertises it to its peers), and the same
PYTHONHASHSEED on both roles (it seeds the first block hash: kv_cache_utils.py NONE_HASH).

With the store enabled, both roles run MultiConnector (vLLM docs/features/
mooncake_store_connector_usage.md): MooncakeConnector first, so a request prefilled
elsewhere always takes the hand-off (the first child with tokens to load wins:
multi_connector.py get_num_new_matched_tokens), then MooncakeStoreConnector, which
loads the longest stored prefix of any other request. Prefill also writes the blocks it
computes (kv_both); decode only reads (kv_consumer).

In colocated mode one pool serves each request whole: no hand-off connector, chunked
prefill on (prefill chunks and decode tokens share each step's token budget), and with
the store on MooncakeStoreConnector alone (kv_both: it reads and writes).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import EnvVar, PDClusterSpec, Resources, RoleSpec, RouterPolicy
from pdcluster.render import model, mooncake, rdma
from pdcluster.render.names import (
    TRACES_HEADERS_ENV,
    Owner,
    env_field,
    env_secret,
    labels,
    metadata,
    scrape_annotations,
    selector,
)
from pdcluster.vllm import kvtransfer as kvt

# A flexible engine is both: each request's kv_transfer_params make it prefill or decode
# (mooncake_connector.py: with kv_both neither is_kv_producer nor is_kv_consumer is set,
# and the worker starts the sender, the receiver and the bootstrap server).
KV_ROLE = {C.ROLE_PREFILL: kvt.KV_PRODUCER, C.ROLE_DECODE: kvt.KV_CONSUMER, C.ROLE_FLEXIBLE: kvt.KV_BOTH}
# Engines that serve the Mooncake bootstrap server, which decode asks for the engine ids.
BOOTSTRAP_ROLES = (C.ROLE_PREFILL, C.ROLE_FLEXIBLE)
SHM_VOLUME = "dshm"
# Long enough for routers to see the pod leave its EndpointSlice before SIGTERM, so no
# new request lands on an engine that is shutting down.
PRESTOP_SLEEP_SECONDS = 5
# Left between vLLM's drain and the kubelet's SIGKILL, for the process to exit.
SHUTDOWN_MARGIN_SECONDS = 2


STORE_KV_ROLE = {C.ROLE_PREFILL: kvt.KV_BOTH, C.ROLE_DECODE: kvt.KV_CONSUMER, C.ROLE_FLEXIBLE: kvt.KV_BOTH}
STORE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"


def kv_transfer_config(spec: PDClusterSpec, role: str) -> dict[str, Any] | None:
    """`--kv-transfer-config` of a role; None: no connector (colocated, no store)."""
    if role == C.ROLE_COLOCATED:
        if not spec.mooncake.store.enabled:
            return None
        return {
            kvt.CONNECTOR_KEY: kvt.STORE_CONNECTOR,
            kvt.ROLE_KEY: kvt.KV_BOTH,
            kvt.EXTRA_KEY: {},
        }
    extra: dict[str, Any] = {"mooncake_protocol": spec.kv_protocol.value}
    devices = spec.kv_transfer.devices or ",".join(spec.rdma.hcas)
    if devices:
        extra["device_name"] = devices
    handoff = {
        kvt.CONNECTOR_KEY: kvt.HANDOFF_CONNECTOR,
        kvt.ROLE_KEY: KV_ROLE[role],
        kvt.EXTRA_KEY: extra,
    }
    # A KV pull that fails makes decode compute the prompt itself, not fail the request
    # (vllm/config/kv_transfer.py; the scheduler reads it from the top-level config).
    recompute = {"kv_load_failure_policy": "recompute"}
    if not spec.mooncake.store.enabled:
        return handoff | recompute
    store_extra: dict[str, Any] = {}
    tp = {spec.prefill.tensor_parallel_size, spec.decode.tensor_parallel_size}
    if len(tp) > 1:
        # Keys per rank of a common TP layout, so both roles find each other's blocks
        # (store/worker.py: store_tp_size must be a multiple of the engine's TP).
        store_extra["store_tp_size"] = math.lcm(*tp)
    store = {
        kvt.CONNECTOR_KEY: kvt.STORE_CONNECTOR,
        kvt.ROLE_KEY: STORE_KV_ROLE[role],
        kvt.EXTRA_KEY: store_extra,
    }
    return {
        kvt.CONNECTOR_KEY: kvt.MULTI_CONNECTOR,
        kvt.ROLE_KEY: KV_ROLE[role],
        kvt.EXTRA_KEY: {kvt.CHILDREN_KEY: [handoff, store]},
        **recompute,
    }


def kv_revision(spec: PDClusterSpec) -> str:
    """What both roles must share to exchange KV, as a short hash (a label value)."""
    engine = spec.engine
    shared = {
        "model": spec.model.name,
        "served": spec.served_model_name,
        "maxModelLen": spec.model.max_model_len,
        "image": engine.image,
        "command": engine.command,
        "args": engine.args,
        "hashSeed": engine.python_hash_seed,
        "kv": [kv_transfer_config(spec, role) for role in spec.engine_roles],
    }
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:12]


# vLLM's KV events publisher (config/kv_events.py: KVEventsConfig), read by the router.
KV_EVENTS = kvt.kv_events_config(C.KV_EVENTS_PORT, C.KV_EVENTS_REPLAY_PORT)


def publishes_kv_events(spec: PDClusterSpec, role: str) -> bool:
    """The precise-prefix router reads the KV events of the engines it picks among."""
    return spec.router.policy == RouterPolicy.precise_prefix and role != C.ROLE_DECODE


def engine_args(spec: PDClusterSpec, role: str) -> list[str]:
    r = spec.role(role)
    args = [model.serve_path(spec), "--port", str(spec.engine.port), "--served-model-name", spec.served_model_name]
    args += ["--tensor-parallel-size", str(r.tensor_parallel_size)]
    if r.pipeline_parallel_size > 1:
        args += ["--pipeline-parallel-size", str(r.pipeline_parallel_size)]
    if r.data_parallel_size > 1:
        args += ["--data-parallel-size", str(r.data_parallel_size)]
    if spec.model.max_model_len:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    kv = kv_transfer_config(spec, role)
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    if publishes_kv_events(spec, role):
        # Prefix caching is vLLM's default; said outright for the engine simulator, which
        # models a prefix cache only when asked.
        args += [
            "--enable-prefix-caching",
            "--kv-events-config",
            json.dumps(KV_EVENTS, separators=(",", ":")),
        ]
    # The usage of every answer says how many prompt tokens were cached (vLLM 0.32,
    # entrypoints/openai/completion/serving.py): the router reports the prefill leg's.
    args.append("--enable-prompt-tokens-details")
    if role in (C.ROLE_PREFILL, C.ROLE_FLEXIBLE):
        # Each prefill answer carries the prompt's own compute (metrics.time_to_first_token_ms;
        # vLLM 0.32 entrypoints/generate/base/serving.py): the router's TTFT beyond prefill.
        # vLLM refuses it beside --disable-log-stats (entrypoints/launchers/cli_args.py).
        args.append("--enable-per-request-metrics")
    if spec.tracing.enabled:
        # Over OTLP/HTTP (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL in engine_env), as the router.
        args += ["--otlp-traces-endpoint", spec.tracing.traces_url]
    if role == C.ROLE_COLOCATED:
        # vLLM's default where the model supports it (arg_utils.py
        # _set_default_chunked_prefill_and_prefix_caching_args); said outright, since
        # without it a long prompt stalls every stream on the engine for its prefill.
        args.append("--enable-chunked-prefill")
    # On SIGTERM vLLM aborts what it is serving unless given time to drain
    # (--shutdown-timeout, 0 by default: vllm/config/vllm.py): give it the grace period
    # the preStop sleep leaves, so a scale-down finishes the streams in flight.
    grace = spec.engine.termination_grace_period_seconds
    drain = grace - prestop_seconds(grace) - SHUTDOWN_MARGIN_SECONDS
    args += ["--shutdown-timeout", str(max(drain, 0))]
    return args + spec.engine.args + r.args


def _env(items: list[EnvVar]) -> list[dict[str, Any]]:
    return [e.wire() for e in items]


def engine_env(spec: PDClusterSpec, owner: Owner, role: str) -> list[dict[str, Any]]:
    env = [
        env_field("POD_IP", "status.podIP"),
        env_field("POD_NAME", "metadata.name"),
        env_field("POD_NAMESPACE", "metadata.namespace"),
        # The connector advertises this address to its peers for the KV transfer.
        {"name": "VLLM_HOST_IP", "value": "$(POD_IP)"},
        # Block hashes must agree across instances that share KV.
        {"name": "PYTHONHASHSEED", "value": str(spec.engine.python_hash_seed)},
    ]
    if spec.mooncake.store.enabled:
        env.append({"name": STORE_CONFIG_ENV, "value": f"{mooncake.CONFIG_DIR}/{mooncake.ENGINE_CONFIG}"})
        env += mooncake.client_env(spec, owner)
    if role in BOOTSTRAP_ROLES:
        env.append({"name": "VLLM_MOONCAKE_BOOTSTRAP_PORT", "value": str(spec.kv_transfer.bootstrap_port)})
    if role != C.ROLE_COLOCATED:
        # The router gives up on a request after its timeout: KV held longer for a decode
        # that never pulls it is held for nobody (vLLM's default is 480 s).
        env.append(
            {"name": "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "value": str(spec.router.request_timeout_seconds)}
        )
    for name, ref in (
        ("HF_TOKEN", spec.engine.hf_token_secret),
        ("VLLM_API_KEY", spec.engine.api_key_secret),
    ):
        if ref is not None:
            env.append(env_secret(name, ref))
    if spec.tracing.enabled:
        # vllm/tracing/otel.py picks its exporter by this (gRPC by default); the SDK names
        # the engine's spans' resource from the other two.
        env += [
            {"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": "http/protobuf"},
            {"name": "OTEL_SERVICE_NAME", "value": "vllm"},
            {
                "name": "OTEL_RESOURCE_ATTRIBUTES",
                "value": f"pdcluster.cluster={owner.name},pdcluster.role={role}",
            },
        ]
        if spec.tracing.headers_secret is not None:
            env.append(env_secret(TRACES_HEADERS_ENV, spec.tracing.headers_secret))
    env += model.engine_env(spec) + rdma.env(spec) + rdma.transfer_env(spec)
    # A name set twice is invalid in a server-side apply (env is a map keyed by name):
    # the user's entries replace ours, the role's replace the engine's.
    merged: dict[str, dict[str, Any]] = {}
    for item in env + _env(spec.engine.env) + _env(spec.role(role).env):
        merged[item["name"]] = item
    return list(merged.values())


def resources(role: RoleSpec, spec: PDClusterSpec) -> dict[str, Any]:
    base = role.resources or Resources()
    requests = dict(base.requests or {})
    limits = dict(base.limits or {})
    per_pod = role.gpus // role.nodes  # a role spanning nodes: one node's share per pod
    extended = {role.gpu_resource_name: per_pod} if per_pod else {}
    extended |= rdma.extended_resources(spec)
    # Extended resources must have requests equal to limits.
    requests.update(extended)
    limits.update(extended)
    out = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probe(path: str, port: str, probe: Any) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "initialDelaySeconds": probe.initial_delay_seconds,
        "periodSeconds": probe.period_seconds,
        "timeoutSeconds": probe.timeout_seconds,
        "failureThreshold": probe.failure_threshold,
    }


def container(spec: PDClusterSpec, owner: Owner, role: str) -> dict[str, Any]:
    ports = [{"name": "http", "containerPort": spec.engine.port, "protocol": "TCP"}]
    if role in BOOTSTRAP_ROLES:
        ports.append(
            {"name": "bootstrap", "containerPort": spec.kv_transfer.bootstrap_port, "protocol": "TCP"}
        )
    if publishes_kv_events(spec, role):
        ports.append({"name": "kv-events", "containerPort": C.KV_EVENTS_PORT, "protocol": "TCP"})
        ports.append({"name": "kv-replay", "containerPort": C.KV_EVENTS_REPLAY_PORT, "protocol": "TCP"})
    security: dict[str, Any] = {"allowPrivilegeEscalation": False}
    if rdma.capabilities(spec):
        security["capabilities"] = {"add": rdma.capabilities(spec)}
    mounts = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    if spec.mooncake.store.enabled:
        mounts.append(mooncake.config_mount())
    mounts += model.engine_mounts(spec) + rdma.mounts(spec)
    return {
        "name": "engine",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": list(spec.engine.command),
        "args": engine_args(spec, role),
        "env": engine_env(spec, owner, role),
        "ports": ports,
        "resources": resources(spec.role(role), spec),
        "startupProbe": _probe("/health", "http", spec.engine.startup_probe),
        "readinessProbe": _probe("/health", "http", spec.engine.readiness_probe),
        "livenessProbe": {**_probe("/health", "http", spec.engine.readiness_probe), "failureThreshold": 6},
        **_pre_stop(spec.engine.termination_grace_period_seconds),
        "securityContext": security,
        "volumeMounts": mounts,
        # A crashed engine's last log lines become its termination message, which the
        # Stalled condition quotes (podstate.py): vLLM writes no termination-log file.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def prestop_seconds(grace_seconds: int) -> int:
    """The preStop sleep, shortened to fit a short grace period: the apiserver requires
    it to be less than terminationGracePeriodSeconds. 0: none."""
    return max(min(PRESTOP_SLEEP_SECONDS, grace_seconds - 1), 0)


def _pre_stop(grace_seconds: int) -> dict[str, Any]:
    seconds = prestop_seconds(grace_seconds)
    return {"lifecycle": {"preStop": {"sleep": {"seconds": seconds}}}} if seconds >= 1 else {}


def pod_template(spec: PDClusterSpec, owner: Owner, role: str) -> dict[str, Any]:
    r = spec.role(role)
    annotations = {
        **scrape_annotations(spec.engine.port),
        **(r.pod_annotations or {}),
        **rdma.annotations(spec),
    }
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.engine.termination_grace_period_seconds,
        "enableServiceLinks": False,
        "containers": [container(spec, owner, role)],
        "volumes": [
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.engine.shm_size}}
        ],
    }
    if spec.mooncake.store.enabled:
        pod["volumes"].append(mooncake.config_volume(owner))
    pod["volumes"] += model.engine_volumes(spec, owner) + rdma.volumes(spec)
    if model.init_containers(spec):
        pod["initContainers"] = model.init_containers(spec)
    pod |= rdma.pod_fields(spec)
    if r.node_selector:
        pod["nodeSelector"] = dict(r.node_selector)
    if r.tolerations:
        pod["tolerations"] = [t.wire() for t in r.tolerations]
    if r.affinity:
        pod["affinity"] = r.affinity
    if r.topology_spread_constraints:
        pod["topologySpreadConstraints"] = r.topology_spread_constraints
    if r.priority_class_name:
        pod["priorityClassName"] = r.priority_class_name
    pod_labels = {**labels(owner, role), **(r.pod_labels or {}), C.LABEL_KV_REVISION: kv_revision(spec)}
    return {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod}


def statefulset(
    spec: PDClusterSpec, owner: Owner, role: str, replicas: int, partition: int = 0
) -> dict[str, Any]:
    update: dict[str, Any] = {"type": "RollingUpdate"}
    if partition:  # pods below this ordinal keep the old revision for now (rollout.py)
        update["rollingUpdate"] = {"partition": partition}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(owner, role),
        "spec": {
            "replicas": replicas,
            "serviceName": owner.child(role),
            # Engines are independent of each other: start and stop them in parallel.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(owner, role)},
            "updateStrategy": update,
            "template": pod_template(spec, owner, role),
        },
    }


def workload_kind(spec: PDClusterSpec, role: str) -> tuple[str, str]:
    """(apiVersion, kind) of the object that runs a role's pods."""
    if spec.role(role).nodes > 1:
        return C.LWS_API_VERSION, "LeaderWorkerSet"
    return "apps/v1", "StatefulSet"


def multi_node_args(r: RoleSpec, *, worker: bool) -> list[str]:
    """vLLM across the nodes of one group with its own processes, no Ray (vllm/config/
    parallel.py: nnodes, node_rank, master_addr; vllm/entrypoints/cli/serve.py runs a
    `--headless` node as workers only, no API server). The LeaderWorkerSet webhook
    gives every pod of a group LWS_LEADER_ADDRESS and LWS_WORKER_INDEX (0: the leader)."""
    args = ["--distributed-executor-backend", "mp", "--nnodes", str(r.nodes)]
    args += ["--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)"]
    return args + (["--headless"] if worker else [])


def leaderworkerset(
    spec: PDClusterSpec, owner: Owner, role: str, replicas: int, partition: int = 0
) -> dict[str, Any]:
    """A role spanning nodes: `replicas` groups of `nodes` pods. The leader serves the API
    and joins the KV hand-off; workers hold the other ranks and serve nothing, so they
    have no ports, probes or scrape annotations."""
    r = spec.role(role)
    leader = pod_template(spec, owner, role)
    leader["spec"]["containers"][0]["args"] += multi_node_args(r, worker=False)
    worker = pod_template(spec, owner, role)
    engine = worker["spec"]["containers"][0]
    engine["args"] += multi_node_args(r, worker=True)
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe"):
        engine.pop(key)
    for key in scrape_annotations(spec.engine.port):
        worker["metadata"]["annotations"].pop(key)
    return {
        "apiVersion": C.LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": metadata(owner, role),
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            # Groups below the partition keep the old revision for now (rollout.py).
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"partition": partition, "maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": r.nodes,
                # A rank that dies takes its group's collective with it: restart the group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def headless_service(spec: PDClusterSpec, owner: Owner, role: str) -> dict[str, Any]:
    ports = [{"name": "http", "port": spec.engine.port, "targetPort": "http", "protocol": "TCP"}]
    if role in BOOTSTRAP_ROLES:
        ports.append(
            {"name": "bootstrap", "port": spec.kv_transfer.bootstrap_port, "targetPort": "bootstrap"}
        )
    chosen = selector(owner, role)
    name = None
    if spec.role(role).nodes > 1:
        # The LeaderWorkerSet has a Service of its own name for its pods' DNS; this one
        # holds the group leaders alone, whose EndpointSlices the routers read.
        chosen = {**chosen, C.LABEL_LWS_WORKER_INDEX: "0"}
        name = f"{owner.child(role)}-leaders"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, role, name=name),
        "spec": {
            # Headless: stable pod DNS for each engine (routers follow the pods themselves).
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": chosen,
            "ports": ports,
        },
    }


def disruption_budget(owner: Owner, role: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner, role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(owner, role)}},
    }


def build_role(
    spec: PDClusterSpec, owner: Owner, role: str, replicas: int, partition: int = 0
) -> list[dict[str, Any]]:
    multi_node = spec.role(role).nodes > 1
    objects = [
        (leaderworkerset if multi_node else statefulset)(spec, owner, role, replicas, partition),
        headless_service(spec, owner, role),
    ]
    # A budget over no pod guards nothing, and the disruption controller warns about it
    # (NoPods) for as long as it exists: suspended or scaled to zero, a role has none.
    if replicas > 0:
        objects.append(disruption_budget(owner, role))
    return objects
