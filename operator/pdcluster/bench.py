"""`pdctl bench`: a Job that benchmarks a PDCluster from inside the cluster with AIPerf,
NVIDIA's benchmark client, against the router's Service (docs/benchmarking.md).

The Job installs AIPerf (pinned) into a scratch volume unless the image has it, runs
`aiperf profile` on a synthetic mix or a Mooncake-format trace (a ConfigMap beside the
Job), prints AIPerf's summary to the log (`kubectl logs`) and keeps the pod running a
while so that `kubectl cp` can fetch the whole report. Every flag is AIPerf 0.13.0's own
(aiperf/config/flags/cli_config.py in its wheel). Pure: a spec in, manifests out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdcluster import constants as C
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.render.names import Owner

AIPERF_VERSION = "0.13.0"
DEFAULT_IMAGE = "python:3.12-slim"
RESULTS_DIR = "/results"
INSTALL_DIR = "/opt/aiperf"
SITE_DIR = f"{INSTALL_DIR}/site"
HF_CACHE_DIR = "/hf-cache"  # a Hugging Face cache (HF_HOME) from --tokenizer-claim
TRACE_DIR = "/trace"
TRACE_KEY = "trace.jsonl"
# The apiserver stores objects up to 1 MiB (etcd's request limit); room left for metadata.
TRACE_LIMIT_BYTES = 1_000_000
# What a Mooncake-format trace line carries (aiperf/dataset/loader/models.py, MooncakeTrace).
TRACE_FIELDS = ("input_length", "output_length")
RUN_AS = 65532  # any non-root user: the install and the report live in writable volumes
LABEL_BENCH = "pdcluster-bench"


class BenchError(ValueError):
    """Bad options or a bad trace: the message says what to fix."""


@dataclass(frozen=True)
class BenchOptions:
    requests: int = 200
    concurrency: int | None = None  # requests in flight; the default when no rate is set
    rate: float | None = None  # requests per second instead of a concurrency
    input_tokens: int = 1024  # synthetic prompt length, mean
    input_stddev: int = 0
    output_tokens: int = 128
    tokenizer: str | None = None  # a hub id (or a path in the image); the model's name when unset
    tokenizer_claim: str | None = None  # a PersistentVolumeClaim holding a Hugging Face cache with it
    image: str = DEFAULT_IMAGE
    install: bool = True  # pip-install AIPerf at start (an image without it)
    keep_seconds: int = 600  # the pod stays this long after the run, for kubectl cp
    seed: int = 0
    name: str | None = None


def check(opts: BenchOptions) -> None:
    if opts.rate is not None and opts.concurrency is not None:
        raise BenchError("give a request rate or a concurrency, not both")
    numbers = {
        "--requests": opts.requests,
        "--input-tokens": opts.input_tokens,
        "--output-tokens": opts.output_tokens,
    }
    for flag, value in numbers.items():
        if value < 1:
            raise BenchError(f"{flag} must be at least 1, not {value}")
    if (opts.rate is not None and opts.rate <= 0) or (opts.concurrency is not None and opts.concurrency < 1):
        raise BenchError("the request rate and the concurrency must be positive")
    if opts.input_stddev < 0 or opts.keep_seconds < 0:
        raise BenchError("--input-stddev and --keep-seconds cannot be negative")
    if opts.tokenizer_claim and (opts.tokenizer or "").startswith("/"):
        raise BenchError("with --tokenizer-claim, --tokenizer is the hub id in that cache, not a path")


def check_tokenizer_for_trace(opts: BenchOptions) -> None:
    """AIPerf 0.13.0 turns a trace's hash ids into prompts in worker processes that load
    the tokenizer from the hub cache offline (aiperf/dataset/generator/parallel_decode.py):
    a tokenizer given as a directory fails there."""
    if (opts.tokenizer or "").startswith("/"):
        raise BenchError(
            "with --trace, give the tokenizer as a hub id (AIPerf replays a trace with the tokenizer from the "
            "hub's cache); --tokenizer-claim mounts a local cache"
        )


def check_trace(text: str) -> int:
    """The number of requests in a Mooncake-format trace (JSON lines), or why it is not one."""
    if len(text.encode()) > TRACE_LIMIT_BYTES:
        raise BenchError(f"the trace is over {TRACE_LIMIT_BYTES} bytes, too large for a ConfigMap: cut it")
    count = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"trace line {number}: not JSON ({e.msg})") from None
        missing = [f for f in TRACE_FIELDS if not isinstance(entry, dict) or f not in entry]
        if missing:
            raise BenchError(f"trace line {number}: no {', '.join(missing)} (a Mooncake trace line has both)")
        count += 1
    if not count:
        raise BenchError("the trace has no requests")
    return count


def job_name(owner: Owner, opts: BenchOptions) -> str:
    return opts.name or f"{owner.name}-bench"


def router_url(spec: PDClusterSpec, owner: Owner) -> str:
    return f"http://{owner.child(C.ROLE_ROUTER)}.{owner.namespace}.svc:{spec.router.port}"


def goodput(spec: PDClusterSpec) -> str:
    """AIPerf's SLOs for goodput (`metric:ms`): the client sees the whole TTFT, so the TTFT
    target only when it applies to the whole (`ttftIncludesPrefill`)."""
    slo = spec.autoscaling.slo
    parts = [f"time_to_first_token:{slo.ttft_ms}"] if spec.autoscaling.ttft_includes_prefill else []
    return " ".join([*parts, f"inter_token_latency:{slo.itl_ms}"])


def aiperf_args(spec: PDClusterSpec, owner: Owner, opts: BenchOptions, trace: bool) -> list[str]:
    args = ["profile", "--model", spec.served_model_name, "--url", router_url(spec, owner)]
    args += ["--endpoint-type", "completions", "--streaming"]
    args += ["--tokenizer", opts.tokenizer or spec.model.name, "--random-seed", str(opts.seed)]
    if trace:  # timestamps drive the schedule (AIPerf's fixed schedule for trace datasets)
        args += ["--input-file", f"{TRACE_DIR}/{TRACE_KEY}", "--custom-dataset-type", "mooncake_trace"]
    else:
        args += ["--request-count", str(opts.requests)]
        args += ["--synthetic-input-tokens-mean", str(opts.input_tokens)]
        args += ["--synthetic-input-tokens-stddev", str(opts.input_stddev)]
        args += ["--output-tokens-mean", str(opts.output_tokens), "--output-tokens-stddev", "0"]
        args += ["--extra-inputs", "ignore_eos:true"]  # every answer as long as asked
        if opts.rate is not None:
            args += ["--request-rate", f"{opts.rate:g}"]
        else:
            args += ["--concurrency", str(opts.concurrency or 4)]
    args += ["--goodput", goodput(spec), "--artifact-dir", RESULTS_DIR, "--ui-type", "none"]
    if spec.router.api_key_secret is not None:
        args += ["--api-key", "$(ROUTER_API_KEY)"]  # the kubelet expands it from the env
    return args


def script(opts: BenchOptions) -> str:
    """Install (unless the image has AIPerf), run, print the report, hold for kubectl cp."""
    install = (
        f"pip install --no-cache-dir --target {SITE_DIR} aiperf=={AIPERF_VERSION} && " if opts.install else ""
    )
    report = f"{RESULTS_DIR}/profile_export_aiperf.csv"
    return (
        f'{install}python -m aiperf "$@"; status=$?; cat {report} 2>/dev/null; '
        f'echo "pdctl bench: aiperf exited $status; report in {RESULTS_DIR}, kept {opts.keep_seconds} s"; '
        f"sleep {opts.keep_seconds}; exit $status"
    )


def _env(spec: PDClusterSpec, opts: BenchOptions) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": f"{INSTALL_DIR}/home"},  # pip's cache, and the hub's unless mounted
        {"name": "PYTHONPATH", "value": SITE_DIR},
    ]
    if opts.tokenizer_claim:  # the tokenizer from the mounted cache, never the network
        env += [{"name": "HF_HOME", "value": HF_CACHE_DIR}, {"name": "HF_HUB_OFFLINE", "value": "1"}]
    secrets = (("ROUTER_API_KEY", spec.router.api_key_secret), ("HF_TOKEN", spec.engine.hf_token_secret))
    for name, ref in secrets:
        if ref is not None:
            env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def _volumes(owner: Owner, opts: BenchOptions, trace: bool) -> tuple[list[dict], list[dict]]:
    volumes = [
        {"name": "results", "emptyDir": {}},
        {"name": "aiperf", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "results", "mountPath": RESULTS_DIR},
        {"name": "aiperf", "mountPath": INSTALL_DIR},
        {"name": "tmp", "mountPath": "/tmp"},  # AIPerf's services talk over IPC sockets there
    ]
    if trace:
        volumes.append({"name": "trace", "configMap": {"name": trace_configmap_name(owner, opts)}})
        mounts.append({"name": "trace", "mountPath": TRACE_DIR, "readOnly": True})
    if opts.tokenizer_claim:
        claim = {"claimName": opts.tokenizer_claim, "readOnly": True}
        volumes.append({"name": "tokenizer", "persistentVolumeClaim": claim})
        mounts.append({"name": "tokenizer", "mountPath": HF_CACHE_DIR, "readOnly": True})
    return volumes, mounts


def trace_configmap_name(owner: Owner, opts: BenchOptions) -> str:
    return f"{job_name(owner, opts)}-trace"


def _labels(owner: Owner) -> dict[str, str]:
    return {C.LABEL_NAME: LABEL_BENCH, C.LABEL_INSTANCE: owner.name, C.LABEL_PART_OF: C.APP_NAME}


def render(
    spec: PDClusterSpec, owner: Owner, opts: BenchOptions, trace: str | None = None
) -> list[dict[str, Any]]:
    """The Job (and the trace's ConfigMap) that benchmark this PDCluster."""
    check(opts)
    if trace is not None:
        check_trace(trace)
        check_tokenizer_for_trace(opts)
    volumes, mounts = _volumes(owner, opts, trace is not None)
    container = {
        "name": "aiperf",
        "image": opts.image,
        "command": ["sh", "-c", script(opts), "aiperf"],
        "args": aiperf_args(spec, owner, opts, trace is not None),
        "env": _env(spec, opts),
        "volumeMounts": mounts,
        "resources": {
            "requests": {"cpu": "2", "memory": "4Gi", "ephemeral-storage": "4Gi"}
        },  # AIPerf: 1.2 GB installed
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    pod = {
        "restartPolicy": "Never",
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }  # fmt: skip
    meta = {"name": job_name(owner, opts), "namespace": owner.namespace, "labels": _labels(owner)}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 0,  # a failed benchmark is a result, not something to retry
            "template": {"metadata": {"labels": _labels(owner)}, "spec": pod},
        },
    }
    if trace is None:
        return [job]
    cm_meta = {**meta, "name": trace_configmap_name(owner, opts)}
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": cm_meta, "data": {TRACE_KEY: trace}}, job]
