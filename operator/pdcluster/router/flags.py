"""`pdcluster-router`'s command line: the flags, in groups, and the checks across them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pdcluster import add_version_flag
from pdcluster.constants import KV_EVENTS_PORT, ROUTER_PORT
from pdcluster.router.http import BODY_TIMEOUT_S, HEAD_TIMEOUT_S, MAX_CONNECTIONS
from pdcluster.router.policy import POLICIES


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdcluster-router",
        description="Disaggregated prefill/decode router for vLLM's MooncakeConnector, and for pools of "
        "colocated engines. Backends come from the cluster's EndpointSlices or Pods (--kube) or from "
        "--prefill/--decode/--colocated. Prompt tokens are counted "
        "without a tokenizer (UTF-8 bytes / 4; token-id prompts exactly).",
    )
    add_version_flag(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=ROUTER_PORT)
    _add_backends(p)
    _add_routing(p)
    _add_admission(p)
    _add_store(p)
    _add_requests(p)
    _add_connections(p)
    _add_tracing(p)
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM"
    )
    p.add_argument("--log-level", default="INFO")
    return p


def _add_backends(p: argparse.ArgumentParser) -> None:
    members = p.add_argument_group("backends")
    members.add_argument("--kube", action="store_true", help="follow the cluster's engines in Kubernetes")
    members.add_argument("--namespace", help="namespace to watch (default: the service account's)")
    members.add_argument("--cluster", help="PDCluster name (label pdcluster.io/cluster)")
    members.add_argument(
        "--discovery",
        choices=("endpointslices", "pods"),
        default="endpointslices",
        help="with --kube: read ready engines from EndpointSlices, or from Pods where slices cannot hold "
        "the addresses (a loopback test cluster)",
    )
    members.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, in-cluster, ~/.kube/config)"
    )
    members.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL[#bootstrap=PORT]",
        help="a prefill engine, e.g. http://127.0.0.1:8100#bootstrap=8998 (bootstrap port default 8998); repeatable",
    )
    members.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="a decode engine; repeatable"
    )
    members.add_argument(
        "--colocated",
        action="append",
        default=[],
        metavar="URL",
        help="a colocated engine (prefill and decode in one, no KV hand-off); repeatable, with or "
        "without --prefill/--decode",
    )
    members.add_argument(
        "--flexible",
        action="append",
        default=[],
        metavar="URL[#bootstrap=PORT]",
        help="a flexible engine (MooncakeConnector kv_both), made prefill or decode by the router; "
        "repeatable, in pool order",
    )
    members.add_argument(
        "--prefill-engines",
        type=int,
        default=1,
        help="how many flexible engines act as prefill, the first ones in pool order (at least one of "
        "each role); with --kube the roles ConfigMap changes it",
    )
    members.add_argument(
        "--prefill-on-decode-below",
        type=int,
        default=0,
        metavar="TOKENS",
        help="a prompt shorter than this is prefilled by its decode engine, with no KV hand-off; 0: never",
    )
    members.add_argument(
        "--roles-configmap", help="with --kube: the ConfigMap whose prefillEngines sets the flexible split"
    )


def _add_routing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="served model name; requests naming another model get 404")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="least-loaded",
        help="precise-prefix: prefix-aware on the engines' KV events (vLLM --kv-events-config, ZMQ), "
        "guessing where an engine's events are not flowing",
    )
    events = p.add_argument_group("KV events (precise-prefix)")
    events.add_argument(
        "--kv-events-port",
        type=int,
        default=KV_EVENTS_PORT,
        help="the engines' KV event port (their endpoint's; a DP rank publishes on it plus its rank)",
    )
    events.add_argument(
        "--kv-events-replay-port",
        type=int,
        help="the engines' KV event replay port (their replay_endpoint's, plus the DP rank), where the "
        "router asks for the batches it missed; unset: none",
    )
    events.add_argument("--kv-events-topic", default="", help="the engines' KV event topic")
    events.add_argument(
        "--exact-timeout",
        type=float,
        default=0.1,
        help="seconds that hashing a prompt as the engines do (their /tokenize) may add to a request",
    )
    p.add_argument(
        "--hash-seed",
        help="the engines' PYTHONHASHSEED (it seeds vLLM's block hashes); unset: none",
    )


def _add_admission(p: argparse.ArgumentParser) -> None:
    slo = p.add_argument_group("admission")
    slo.add_argument("--admission-ttft-ms", type=float, default=500.0, help="TTFT target")
    slo.add_argument(
        "--admission-reject-factor",
        type=float,
        default=2.0,
        help="reject when predicted TTFT > target x factor",
    )
    slo.add_argument("--no-admission", action="store_true", help="admit everything")
    slo.add_argument(
        "--admission-ttft-plus-prefill",
        action="store_true",
        help="the TTFT target comes on top of each prompt's own prefill time",
    )
    slo.add_argument(
        "--admission-prefill-rate",
        type=float,
        default=20000.0,
        help="prefill tokens/s assumed for a backend before any measurement",
    )


def _add_store(p: argparse.ArgumentParser) -> None:
    store = p.add_argument_group("Mooncake store: prompts whose prefix is stored skip prefill")
    store.add_argument(
        "--store-master", metavar="URL", help="the master's HTTP port, e.g. http://master:9003"
    )
    store.add_argument(
        "--store-max-computed-tokens",
        type=int,
        default=512,
        help="send a prompt straight to decode when at most this many of its tokens are not stored",
    )
    store.add_argument(
        "--store-lookup-timeout", type=float, default=0.1, help="seconds a lookup may add to a request"
    )


def _add_requests(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request, streams included"
    )
    p.add_argument(
        "--api-key-file", type=Path, help="require `Authorization: Bearer <key>` with the key in this file"
    )
    p.add_argument(
        "--engine-api-key-file", type=Path, help="send engines `Authorization: Bearer <key>` (vLLM --api-key)"
    )
    probe = p.add_argument_group("KV hand-off verification")
    probe.add_argument(
        "--kv-probe-interval",
        type=float,
        default=60.0,
        help="seconds between re-checks of failed and sampled prefill -> decode pairs; 0: no probes",
    )
    probe.add_argument("--kv-probe-tokens", type=int, default=64, help="prompt tokens per probe")
    probe.add_argument(
        "--state-configmap", help="ConfigMap to write the probe verdicts to (needs --kube and --pod-name)"
    )
    probe.add_argument("--pod-name", default=os.environ.get("POD_NAME", ""), help="this router's pod")
    retry = p.add_argument_group("retries")
    retry.add_argument(
        "--max-attempts", type=int, default=3, help="attempts per request, each on engines not tried before"
    )
    retry.add_argument(
        "--prefill-timeout",
        type=float,
        default=120.0,
        help="seconds a prefill may take before another is tried",
    )
    retry.add_argument(
        "--max-fan-out",
        type=int,
        default=16,
        help="prefill/decode flows one request may need (n times its prompts); more is refused with a 400",
    )
    retry.add_argument(
        "--no-resume-streams",
        action="store_true",
        help="end a stream with an error when its decode engine dies, instead of resuming it",
    )


def _add_connections(p: argparse.ArgumentParser) -> None:
    conns = p.add_argument_group("client connections: what slow, silent or greedy clients may hold")
    conns.add_argument(
        "--head-timeout",
        type=float,
        default=HEAD_TIMEOUT_S,
        help="seconds for a request's whole head, from the connection's opening (or, kept alive, from the "
        "head's first byte), however it trickles; a connection that sends nothing is closed after as long",
    )
    conns.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help="seconds for a request's whole body, from the end of its head",
    )
    conns.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="open client connections; past it a new one gets a 503 and is closed, the open ones keep working",
    )


def _add_tracing(p: argparse.ArgumentParser) -> None:
    traces = p.add_argument_group("tracing")
    traces.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send OpenTelemetry spans of each request over OTLP/HTTP to this URL, e.g. "
        "http://collector:4318/v1/traces, and a traceparent to the engines; unset: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, else no tracing "
        "(headers, timeout and resource come from the other OTEL_* variables)",
    )
    traces.add_argument(
        "--trace-sample-ratio",
        type=float,
        help="the share of requests traced (a client's sampled traceparent is followed); unset: "
        "OTEL_TRACES_SAMPLER_ARG where OTEL_TRACES_SAMPLER is a traceidratio one, else 1",
    )


def problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags taken together, or None."""
    if args.kube and not args.cluster:
        return "--kube needs --cluster"
    if not args.kube and not (args.prefill and args.decode) and not args.colocated and not args.flexible:
        return "give --kube, at least one --prefill and one --decode, --colocated or --flexible"
    if args.head_timeout <= 0 or args.body_timeout <= 0 or args.max_connections < 1:
        return "--head-timeout and --body-timeout must be positive, --max-connections at least 1"
    if args.trace_sample_ratio is not None and not 0.0 <= args.trace_sample_ratio <= 1.0:
        return "--trace-sample-ratio must be between 0 and 1"
    if not args.kube and bool(args.prefill) != bool(args.decode):
        return "--prefill and --decode come together: a prefill needs a decode to hand its KV to"
    return None
