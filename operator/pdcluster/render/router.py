"""The PD router: a Deployment, its Service, and read-only access to the cluster's pods
(it follows engines by pod readiness)."""

from __future__ import annotations

from typing import Any

from pdcluster import constants as C
from pdcluster import flexible
from pdcluster.api.v1alpha1 import PDClusterSpec, RouterPolicy, RouterSpec, ServingMode
from pdcluster.render.engine import disruption_budget
from pdcluster.render.names import (
    TRACES_HEADERS_ENV,
    Owner,
    env_field,
    env_secret,
    labels,
    metadata,
    restricted_container,
    restricted_pod,
    scrape_annotations,
    selector,
)

API_KEY_DIR = "/etc/pdcluster/api-key"
ENGINE_KEY_DIR = "/etc/pdcluster/engine-api-key"
HOSTNAME_KEY = "kubernetes.io/hostname"  # the well-known node label
PRE_STOP_SLEEP_S = 5
# Guaranteed CPU for the relay loop, no CPU limit (throttling stalls every stream a
# router relays); memory capped well above what 4096 open streams hold.
DEFAULT_RESOURCES: dict[str, Any] = {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}


def router_args(spec: PDClusterSpec, owner: Owner) -> list[str]:
    r = spec.router
    args = [
        f"--port={r.port}",
        "--kube",
        # Ready engine pods by label, the same signal EndpointSlices carry; it also works
        # where slices cannot hold pod addresses (loopback test clusters).
        "--discovery=pods",
        "--namespace=$(POD_NAMESPACE)",
        f"--cluster={owner.name}",
        f"--model={spec.served_model_name}",
        f"--policy={r.policy.value}",
        f"--request-timeout={r.request_timeout_seconds}",
        f"--head-timeout={r.connections.head_timeout_seconds}",
        f"--body-timeout={r.connections.body_timeout_seconds}",
        f"--max-connections={r.connections.max_connections}",
    ]
    args += _admission_args(spec)
    retries = r.retries
    args += [f"--max-attempts={retries.max_attempts}", f"--prefill-timeout={retries.prefill_timeout_seconds}"]
    if not retries.resume_streams:
        args.append("--no-resume-streams")
    if r.max_fan_out != RouterSpec.model_fields["max_fan_out"].default:
        args.append(f"--max-fan-out={r.max_fan_out}")
    args += _probe_args(spec, owner)
    if r.prefill_on_decode_below_tokens and spec.hands_off_kv:
        args.append(f"--prefill-on-decode-below={r.prefill_on_decode_below_tokens}")
    if spec.mode == ServingMode.flexible:
        args += [
            f"--roles-configmap={roles_configmap_name(owner)}",
            # Where to start until the ConfigMap is read: the spec's split, so that the
            # law's flips (the ConfigMap alone) do not roll the routers.
            f"--prefill-engines={flexible.prefill_engines(spec)}",
        ]
    if r.api_key_secret:
        args.append(f"--api-key-file={API_KEY_DIR}/{r.api_key_secret.key}")
    if spec.engine.api_key_secret:
        args.append(f"--engine-api-key-file={ENGINE_KEY_DIR}/{spec.engine.api_key_secret.key}")
    if spec.tracing.enabled:
        args += [
            f"--otlp-traces-endpoint={spec.tracing.traces_url}",
            f"--trace-sample-ratio={spec.tracing.sample_percent / 100:g}",
        ]
    store = store_hit_args(spec, owner)
    if store or r.policy == RouterPolicy.precise_prefix:
        # Both hash prompts as the engines do: vLLM seeds its block hashes with this.
        args.append(f"--hash-seed={spec.engine.python_hash_seed}")
    if r.policy == RouterPolicy.precise_prefix:
        args += [
            f"--kv-events-port={C.KV_EVENTS_PORT}",
            f"--kv-events-replay-port={C.KV_EVENTS_REPLAY_PORT}",
            # Hashing a prompt as the engines do asks one for its tokens, as a store lookup does.
            f"--exact-timeout={r.store_hits.lookup_timeout_ms / 1000:g}",
        ]
    return args + store


def _admission_args(spec: PDClusterSpec) -> list[str]:
    admission = spec.router.admission
    if not admission.enabled:
        return ["--no-admission"]
    target = admission.ttft_target_ms or spec.autoscaling.slo.ttft_ms
    args = [
        f"--admission-ttft-ms={target}",
        f"--admission-reject-factor={admission.reject_factor_percent / 100:g}",
    ]
    if not admission.ttft_target_ms and not spec.autoscaling.ttft_includes_prefill:
        args.append("--admission-ttft-plus-prefill")  # the SLO's target, as the SLO means it
    return args


def _probe_args(spec: PDClusterSpec, owner: Owner) -> list[str]:
    probe = spec.router.kv_probe
    if not (probe.enabled and spec.hands_off_kv):  # colocated: no hand-off to verify
        return ["--kv-probe-interval=0"]
    return [
        f"--kv-probe-interval={probe.interval_seconds}",
        f"--kv-probe-tokens={probe.prompt_tokens}",
        f"--state-configmap={state_configmap_name(owner)}",
    ]


def store_hit_args(spec: PDClusterSpec, owner: Owner) -> list[str]:
    """Store lookups, where the router can compute the keys the engines write: both roles
    at one TP size (the store's default key layout; a shared TP layout names its keys
    after the attention backend's KV layout, which only the engine knows)."""
    hits = spec.router.store_hits
    same_tp = spec.prefill.tensor_parallel_size == spec.decode.tensor_parallel_size
    # A colocated engine loads stored prefixes itself: there is no prefill to skip.
    if not (
        spec.mooncake.store.enabled and hits.enabled and same_tp and spec.hands_off_kv
    ):
        return []
    master = f"http://{owner.child(C.ROLE_MOONCAKE_MASTER)}:{spec.mooncake.metrics_port}"
    return [
        f"--store-master={master}",
        f"--store-max-computed-tokens={hits.max_computed_tokens}",
        f"--store-lookup-timeout={hits.lookup_timeout_ms / 1000:g}",
    ]


def router_env(spec: PDClusterSpec) -> list[dict[str, Any]]:
    env = [env_field("POD_NAMESPACE", "metadata.namespace"), env_field("POD_NAME", "metadata.name")]
    if spec.tracing.enabled and spec.tracing.headers_secret is not None:
        # From the environment, not a flag: a credential stays out of the pod's args.
        env.append(env_secret(TRACES_HEADERS_ENV, spec.tracing.headers_secret))
    return env


def deployment(spec: PDClusterSpec, owner: Owner, replicas: int) -> dict[str, Any]:
    r = spec.router
    role = C.ROLE_ROUTER
    pod: dict[str, Any] = {
        "serviceAccountName": owner.child(role),
        "enableServiceLinks": False,
        "securityContext": restricted_pod(),
        # In-flight streams get this long to finish after SIGTERM (the router drains).
        "terminationGracePeriodSeconds": 60,
        "containers": [
            {
                "name": "router",
                "image": r.image,
                "imagePullPolicy": r.image_pull_policy,
                "command": ["pdcluster-router"],
                "args": router_args(spec, owner),
                "env": router_env(spec),
                "ports": [{"name": "http", "containerPort": r.port, "protocol": "TCP"}],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2},
                # Serve on while the Service takes this pod out of its endpoints (kube-proxy
                # lags the deletion by a moment); SIGTERM, and the drain, come after.
                "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SLEEP_S)]}}},
                "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
                "resources": r.resources.wire() if r.resources is not None else DEFAULT_RESOURCES,
                "securityContext": restricted_container(),
            }
        ],
    }
    pod["affinity"] = r.affinity if r.affinity is not None else spread(owner)
    keys = [
        ("api-key", r.api_key_secret, API_KEY_DIR),
        ("engine-api-key", spec.engine.api_key_secret, ENGINE_KEY_DIR),
    ]
    mounted = [(name, ref, path) for name, ref, path in keys if ref is not None]
    if mounted:
        pod["volumes"] = [{"name": name, "secret": {"secretName": ref.name}} for name, ref, _ in mounted]
        pod["containers"][0]["volumeMounts"] = [
            {"name": name, "mountPath": path, "readOnly": True} for name, _, path in mounted
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, role),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(owner, role)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(owner, role), "annotations": scrape_annotations(r.port)},
                "spec": pod,
            },
        },
    }


def spread(owner: Owner) -> dict[str, Any]:
    """Prefer a node without another router of this cluster: one node lost leaves the
    others serving. Preferred, not required, so a one-node cluster still runs them all."""
    term = {"labelSelector": {"matchLabels": selector(owner, C.ROLE_ROUTER)}, "topologyKey": HOSTNAME_KEY}
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]
        }
    }


def service(spec: PDClusterSpec, owner: Owner) -> dict[str, Any]:
    role = C.ROLE_ROUTER
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, role),
        "spec": {
            "type": spec.router.service_type,
            "selector": selector(owner, role),
            "ports": [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def state_configmap_name(owner: Owner) -> str:
    return f"{owner.child(C.ROLE_ROUTER)}-state"


def state_configmap(owner: Owner) -> dict[str, Any]:
    """Where routers report their KV hand-off verdicts (router/state.py). Rendered
    without data: each router owns its own key, and the operator's apply never touches it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, C.ROLE_ROUTER, state_configmap_name(owner)),
    }


def roles_configmap_name(owner: Owner) -> str:
    return f"{owner.child(C.ROLE_ROUTER)}-roles"


def roles_configmap(owner: Owner, prefill_engines: int) -> dict[str, Any]:
    """The flexible split the routers apply (router/membership.py): a change here moves
    engines between the roles within a second, with no pod restarted."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, C.ROLE_ROUTER, roles_configmap_name(owner)),
        "data": {C.KEY_PREFILL_ENGINES: str(prefill_engines)},
    }


def rbac(spec: PDClusterSpec, owner: Owner) -> list[dict[str, Any]]:
    role = C.ROLE_ROUTER
    name = owner.child(role)
    # Membership: which engine pods are ready; its one ConfigMap of verdicts; in flexible
    # mode the ConfigMap of roles, by name.
    rules: list[dict[str, Any]] = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [state_configmap_name(owner)],
            "verbs": ["get", "patch"],
        },
    ]
    if spec.mode == ServingMode.flexible:
        rules.append(
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [roles_configmap_name(owner)],
                "verbs": ["get", "list", "watch"],
            }
        )
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": metadata(owner, role),
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(owner, role),
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(owner, role),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def build_router(
    spec: PDClusterSpec, owner: Owner, *, suspended: bool, prefill_engines: int = 0
) -> list[dict[str, Any]]:
    """`prefill_engines`: of a flexible pool's engines, how many act as prefill."""
    replicas = 0 if suspended else spec.router.replicas
    roles = [roles_configmap(owner, prefill_engines)] if spec.mode == ServingMode.flexible else []
    # A budget over no pod only makes the disruption controller warn (as for the engines).
    budget = [disruption_budget(owner, C.ROLE_ROUTER)] if replicas > 0 else []
    return [
        *rbac(spec, owner), state_configmap(owner), *roles, deployment(spec, owner, replicas), service(spec, owner),
        *budget,
    ]  # fmt: skip
