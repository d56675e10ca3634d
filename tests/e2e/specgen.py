"""PDCluster specs from hypothesis, biased towards edge values and cross-field
combinations, and the check each one must pass against the real apiserver and operator:
either rejected with a message naming a field, or accepted and reconciled (status for its
generation written) with nothing raised in the operator. Shared by
tests/integration/test_specs_property.py and benchmarks/specs_property.py."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from harness import CHILD_KINDS, condition, wait_until
from hypothesis import strategies as st
from pydantic import ValidationError

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.io.kube import ApiError, Kube

INT32_MAX = 2**31 - 1
SIM_IMAGE = "pdcluster/engine-sim:0.1.0"
NOT_RUNNABLE = "vllm/vllm-openai:v0.32.0"  # the local pod runner leaves it Pending: no process
INVALID_ONE_IN = 40  # each field drawn out of its schema's range about this rarely


def mostly(valid: st.SearchStrategy[Any], invalid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` values, and now and then an `invalid` one: with ~30 fields per spec,
    about half the specs pass the schema and the rest fail on one or two fields."""
    return one_in(INVALID_ONE_IN).flatmap(lambda rare: invalid if rare else valid)


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in `n` draws. (Not `integers(0, n - 1) == 0`: hypothesis starts from
    the simplest choices, zero, and would make the rare case the first and most common.)"""
    return st.sampled_from([False] * (n - 1) + [True])


WRONG_TYPES = st.sampled_from(["1", 1.5, True, [], {}])


def ints(low: int, high: int, *typical: int) -> st.SearchStrategy[Any]:
    """The edges of [low, high] (and typical values) most of the time, anything inside
    sometimes; rarely just outside, an integer-width edge or a wrong type."""
    edges = sorted({v for v in (low, low + 1, high - 1, high, *typical) if low <= v <= high})
    outside = [v for v in (low - 1, high + 1, -1, INT32_MAX + 1, 2**63 - 1) if not low <= v <= high]
    return mostly(st.sampled_from(edges) | st.integers(low, high), st.sampled_from(outside) | WRONG_TYPES)


def choice(valid: list[Any], invalid: list[Any]) -> st.SearchStrategy[Any]:
    return mostly(st.sampled_from(valid), st.sampled_from(invalid) | WRONG_TYPES)


# Strings the schema accepts but later stages may not (a child's validation, a shell).
texts = st.sampled_from(["x", "a" * 300, "ünïcödé ✓", "with space", "UPPER", "$(MOONCAKE_MASTER)"]) | st.text(
    min_size=1, max_size=20
)
names = mostly(texts, st.just(""))  # fields with min_length 1
quantities = choice(
    ["16Gi", "64Mi", "0", "1", "1.5Gi", "500m", "1e3", "-1Gi", "10Ei", "0.1m", 0, 1, 10**20],
    ["lots", "", "1 Gi"],
)
# String maps and free-form objects pass the CRD as they are; the apiserver judges them
# when the operator applies the child that carries them.
label_keys = st.sampled_from(["team", "example.com/tier", "", "bad key!", "a" * 64, "pdcluster.io/role"])
label_values = st.sampled_from(["x", "", "a" * 63, "a" * 64, "bad value!", "-lead"])
string_maps = st.dictionaries(label_keys, label_values, max_size=3)
env_vars = st.lists(
    st.fixed_dictionaries(
        {
            "name": mostly(
                st.sampled_from(["A", "1BAD", "with space", "PYTHONHASHSEED", "VLLM_HOST_IP"]), st.just("")
            )
        },
        optional={
            "value": texts,
            "valueFrom": st.sampled_from([{}, {"fieldRef": {"fieldPath": "status.podIP"}}, {"bogus": 1}]),
        },
    ),
    max_size=3,
)
free_form = st.sampled_from([{}, {"nodeAffinity": {}}, {"bogus": [1, 2]}, {"podAntiAffinity": "x"}])
ports = ints(1, 65535, 80, 8000, 8998)


def section(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """An object whose every field may be left out."""
    return st.fixed_dictionaries({}, optional=fields)


def secret_ref(names: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    # Secrets these name never exist in the test namespace: a Degraded SecretNotFound.
    return st.fixed_dictionaries({"name": mostly(names, st.just(""))}, optional={"key": texts})


@st.composite
def role(draw: st.DrawFn, small: bool) -> dict[str, Any]:
    # Running clusters keep replica counts small: a StatefulSet of 2^31 pods would be
    # created faithfully and swamp the test cluster.
    top = 4 if small else INT32_MAX
    counts = ints(0, top, 1, 2, 8)
    spec = draw(
        section(
            replicas=counts,
            minReplicas=counts,
            maxReplicas=ints(1, top, 1, 2, 8),
            tensorParallelSize=choice([1, 1, 2, 4, 8, 3, 64], [0, 65]),
            pipelineParallelSize=choice([1, 1, 2, 64], [0, 65]),
            dataParallelSize=choice([1, 1, 2, 3], [0, 65]),
            gpuResourceName=st.sampled_from(["nvidia.com/gpu", "amd.com/gpu", "", "bad name!"]),
            resources=section(
                requests=st.dictionaries(
                    st.sampled_from(["cpu", "memory", "nvidia.com/gpu"]), quantities, max_size=2
                ),
                limits=st.dictionaries(
                    st.sampled_from(["cpu", "memory", "ephemeral-storage"]), quantities, max_size=2
                ),
            ),
            nodeSelector=string_maps,
            tolerations=st.lists(
                section(
                    key=st.sampled_from(["nvidia.com/gpu", "", "k"]),
                    operator=choice(["Exists", "Equal"], ["Bogus"]),
                    value=st.sampled_from(["present", ""]),
                    effect=choice(["NoSchedule", "NoExecute", "PreferNoSchedule"], ["Never"]),
                    tolerationSeconds=ints(0, 3600),
                ),
                max_size=2,
            ),
            affinity=free_form,
            topologySpreadConstraints=st.lists(free_form, max_size=2),
            priorityClassName=st.sampled_from(["", "high", "system-node-critical", "Bad Name"]),
            args=st.lists(texts, max_size=3),
            env=env_vars,
            podAnnotations=string_maps,
            podLabels=string_maps,
        )
    )
    if draw(one_in(5)):
        spec["gpusPerPod"] = draw(ints(0, 64, 1, 8))
    if not draw(one_in(5)):
        # Usually a consistent min <= replicas <= max; otherwise as drawn (CEL must catch it).
        low, mid, high = sorted(draw(st.lists(st.integers(0, 4 if small else 8), min_size=3, max_size=3)))
        spec.update(minReplicas=low, replicas=mid, maxReplicas=max(high, 1))
    return spec


@st.composite
def pdcluster(draw: st.DrawFn) -> dict[str, Any]:
    """One PDCluster document; metadata.name is drawn as (length, shape) and made unique
    with shape_name()."""
    suspend = not draw(one_in(4))  # three quarters suspended: no pods
    small = not suspend
    runnable = small and draw(one_in(10))  # a few of the others run real processes
    engine = draw(
        section(
            image=names,
            imagePullPolicy=choice(["Always", "IfNotPresent", "Never"], ["Sometimes"]),
            command=mostly(
                st.sampled_from([["vllm", "serve"], ["pdcluster-engine-sim", "serve"]]), st.just([])
            ),
            port=ports,
            args=st.lists(texts, max_size=3),
            env=env_vars,
            hfTokenSecret=secret_ref(st.sampled_from(["hf-token", "Bad Name"])),
            shmSize=quantities,
            pythonHashSeed=ints(0, 2**32, 0),
            startupProbe=section(periodSeconds=ints(1, 60), failureThreshold=ints(1, 1000, 180)),
            readinessProbe=section(timeoutSeconds=ints(1, 60), initialDelaySeconds=ints(0, 600)),
            terminationGracePeriodSeconds=ints(0, 3600, 30),
        )
    )
    router = draw(
        section(
            replicas=ints(0, 2 if small else INT32_MAX, 1),
            port=ports,
            policy=choice(["least-loaded", "prefix-aware"], ["random"]),
            admission=section(
                enabled=st.booleans(),
                ttftTargetMs=ints(1, 60000, 500),
                rejectFactorPercent=ints(100, 1000, 200),
            ),
            storeHits=section(
                enabled=st.booleans(),
                maxComputedTokens=ints(0, 1 << 20, 512),
                lookupTimeoutMs=ints(1, 10000, 100),
            ),
            requestTimeoutSeconds=ints(1, 3600, 600),
            apiKeySecret=secret_ref(st.just("key")),
            serviceType=choice(["ClusterIP", "NodePort", "LoadBalancer"], ["ExternalName"]),
            resources=section(limits=st.dictionaries(st.just("memory"), quantities, max_size=1)),
        )
    )
    # Most running clusters get images the pod runner cannot run; a few run real processes.
    if small:
        engine["image"] = SIM_IMAGE if runnable else NOT_RUNNABLE
        router["image"] = "pdcluster/router:0.1.0" if runnable else "example/router:none"
        if runnable:
            engine["command"] = ["pdcluster-engine-sim", "serve"]
    sections = {
        "model": st.fixed_dictionaries(
            {"name": names}, optional={"servedModelName": texts, "maxModelLen": ints(1, 2**20, 4096)}
        ),
        "kvTransfer": section(
            connector=choice(["mooncake"], ["nixl"]),
            protocol=choice(["tcp", "rdma"], ["udp"]),
            devices=texts,
            bootstrapPort=ports,
        ),
        "rdma": section(
            mode=choice(["none", "none", "sharedDevicePlugin", "sriov", "hostNetwork"], ["infiniband"]),
            resourceName=st.sampled_from(["rdma/rdma_shared_device_a", "", "bad name!"]),
            resourceCount=ints(1, 16),
            networks=st.lists(st.sampled_from(["sriov-net", "", "ns/net"]), max_size=2),
            gidIndex=ints(0, 255, 3),
            hcas=st.lists(st.sampled_from(["mlx5_0", "mlx5_1", "", "x,y"]), max_size=2),
        ),
        "prefill": role(small),
        "decode": role(small),
        "mooncake": section(
            image=mostly(st.just(NOT_RUNNABLE), st.just("")),
            rpcPort=ports,
            metricsPort=ports,
            httpMetadataServer=st.booleans(),
            httpMetadataPort=ports,
            leaseTtlMs=ints(1, 600000, 10000),
            evictionHighWatermarkPercent=ints(1, 100, 90),
            evictionPercent=ints(1, 100, 5),
            store=section(
                enabled=st.booleans(),
                engineSegmentSize=quantities,
                engineBufferSize=quantities,
                replicas=ints(0, 2 if small else INT32_MAX),
                globalSegmentSize=quantities,
                localBufferSize=quantities,
                port=ports,
            ),
            highAvailability=section(
                enabled=st.booleans(),
                replicas=ints(2, 5, 3),
                etcdEndpoints=st.lists(
                    mostly(
                        st.sampled_from(["etcd-0.etcd:2379", "[::1]:2379"]),
                        st.sampled_from(["etcd", "a;b:1"]),
                    ),
                    max_size=3,
                ),
            ),
        ),
        "autoscaling": section(
            enabled=st.booleans(),
            mode=choice(["auto", "recommend", "external"], ["manual"]),
            slo=section(
                ttftMs=ints(1, 60000, 500),
                itlMs=ints(1, 1000, 25),
                quantile=choice(["p50", "p90", "p99"], ["p100"]),
            ),
            gpuBudget=ints(1, 64, 2, 8),
            intervalSeconds=ints(5, 3600, 30),
            windowSeconds=ints(15, 3600, 120),
            scaleUpStabilizationSeconds=ints(0, 600),
            scaleDownStabilizationSeconds=ints(0, 600, 300),
            cooldownSeconds=ints(0, 600),
            maxStep=ints(1, 8),
            tolerancePercent=ints(0, 100),
            scaleUpTimeoutSeconds=ints(30, 3600),
            prometheusUrl=st.sampled_from(["", "http://127.0.0.1:9", "not a url"]),
            profile=mostly(st.sampled_from(["h200-llama3.1-8b", "no-such-profile"]), st.just("")),
            ttftIncludesPrefill=st.booleans(),
        ),
        "paused": st.booleans() | st.just(False),
    }
    spec = draw(st.fixed_dictionaries({}, optional=sections))
    spec.update(suspend=suspend, engine=engine, router=router)
    if draw(one_in(20)):
        spec["bogusField"] = 1  # unknown fields are pruned (with a warning), not an error
    if not draw(one_in(INVALID_ONE_IN)):
        spec.setdefault("model", {"name": "meta-llama/Llama-3.1-8B-Instruct"})
    length = draw(choice([1, 2, 5, 20, 39, 40], [41, 63, 64]))
    shape = draw(choice(["ok"], ["UPPER", "under_score", "-dash", "ünï"]))
    return {"apiVersion": C.API_VERSION, "kind": C.KIND, "metadata": {"name": (length, shape)}, "spec": spec}


def shape_name(shape: tuple[Any, Any], serial: int) -> str:
    """A name of the drawn length and shape, unique through `serial`."""
    length, kind = shape
    if not isinstance(length, int) or length < 1:
        length = 5  # a wrong-typed draw: only names can have a length
    token = f"p{serial:x}"
    base = (token + "x" * length)[:length] if length >= len(token) else token[-length:]
    if kind == "UPPER":
        return base.upper()
    if kind == "under_score":
        return base[:-1] + "_" if length > 1 else "_"
    if kind == "-dash":
        return "-" + base[1:]
    if kind == "ünï":
        return base[:-1] + "ü"
    return base


# ---------------------------------------------------------------------- the check
@dataclass
class Outcome:
    name: str
    accepted: bool
    reason: str  # why it was rejected (the first field named), or the Degraded reason
    message: str  # the apiserver's or the Degraded condition's message
    problems: list[str] = field(default_factory=list)  # empty: the property holds


_INDEX = re.compile(r"\[\d+\]")


def _exists(node: Any, parts: list[str]) -> bool:
    """Is the dotted path in the document? Keys may hold dots themselves (nvidia.com/gpu)."""
    if not parts:
        return True
    if not isinstance(node, dict):
        return False
    return any(
        ".".join(parts[:n]) in node and _exists(node[".".join(parts[:n])], parts[n:])
        for n in range(1, len(parts) + 1)
    )


def rejection_problems(doc: dict[str, Any], error: ApiError) -> list[str]:
    """The message must name a field, and a field the document has (or the parent of a
    defaulted one, for rules comparing fields)."""
    if error.status not in (400, 422):
        return [f"rejected with {error.status} {error.reason}: {error.message}"]
    causes = (error.body.get("details") or {}).get("causes") or []
    fields = [c["field"] for c in causes if c.get("field") and c["field"] != "<nil>"]
    if not fields:
        return [] if "metadata.name" in error.message else [f"no field named: {error.message}"]
    return [
        f"names {f}, which is not in the document"
        for f in fields
        if not (_exists(doc, _INDEX.sub("", f).split(".")) or _exists(doc, _INDEX.sub("", f).split(".")[:-1]))
    ]


_in_use: dict[tuple[str, str], asyncio.Lock] = {}


async def check_spec(kube: Kube, namespace: str, doc: dict[str, Any], timeout: float = 120.0) -> Outcome:
    """Create `doc`; if accepted, wait for the reconcile of its generation, check it, and
    delete it again. Specs of the same name take turns (short names repeat): the later
    one is created right after the deletion of the earlier, while the garbage collector
    is still removing its children, which the operator must take over."""
    key = (namespace, doc["metadata"]["name"])
    lock = _in_use.setdefault(key, asyncio.Lock())
    async with lock:
        return await _check(kube, namespace, doc, timeout)


async def _check(kube: Kube, namespace: str, doc: dict[str, Any], timeout: float) -> Outcome:
    doc = {**doc, "metadata": {**doc["metadata"], "namespace": namespace}}
    name = doc["metadata"]["name"]
    try:
        created = await kube.create(doc)
    except ApiError as e:
        causes = (e.body.get("details") or {}).get("causes") or [{}]
        field = _INDEX.sub("[]", causes[0].get("field") or "<nil>")
        if field == "<nil>":  # a rule on the whole object: its message names the field
            field = e.message.partition("Invalid value: ")[2][:60] or e.message[:60]
        return Outcome(name, False, field, e.message, rejection_problems(doc, e))
    problems = []
    try:
        PDClusterSpec.model_validate(created["spec"])
    except ValidationError as e:
        problems.append(f"the CRD accepted what the models reject: {e.errors()[:2]}")
    body = created

    async def reconciled() -> bool:
        nonlocal body
        if (body.get("status") or {}).get("observedGeneration") == created["metadata"]["generation"]:
            return True
        body = await kube.get(C.API_VERSION, C.KIND, name, namespace) or {}
        return False

    try:
        await wait_until(reconciled, timeout=timeout, interval=0.25, message="its generation reconciled")
    except AssertionError:
        problems.append(f"no status for generation {created['metadata']['generation']} after {timeout:.0f} s")
    degraded = condition(body, "Degraded")
    reason = degraded["reason"] if degraded else "no Degraded condition"
    message = degraded["message"] if degraded else ""
    if degraded is None or condition(body, "Ready") is None or condition(body, "Progressing") is None:
        problems.append(
            f"conditions missing: {[c['type'] for c in body.get('status', {}).get('conditions', [])]}"
        )
    elif degraded["status"] == "True" and not degraded["message"]:
        problems.append(f"Degraded ({reason}) without a message")
    elif degraded["status"] == "False" and not body["spec"].get("paused"):
        # Nothing wrong reported: then every child is there.
        selector = f"{C.LABEL_CLUSTER}={name}"
        workloads = [
            o
            for kind in ("StatefulSet", "Deployment")
            for o in await kube.list(CHILD_KINDS[kind], kind, namespace, label_selector=selector)
        ]
        if len(workloads) < 4:
            problems.append(f"not degraded, yet only {len(workloads)} of 4 workloads exist")
    await kube.delete(C.API_VERSION, C.KIND, name, namespace)
    return Outcome(name, True, reason, message, problems)
