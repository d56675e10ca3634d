"""`pdctl`: the PDCluster toolbox.

pdctl crd                     print the CustomResourceDefinition
pdctl docs                    print the API reference (Markdown)
pdctl render -f cluster.yaml  print the children a PDCluster becomes
pdctl validate -f cluster.yaml
pdctl plan --trace FILE ...   compare autoscaling policies on a real trace
pdctl profile --url URL --name NAME   measure an engine's latency profile (a ConfigMap)
pdctl bench -f cluster.yaml   print a Job that benchmarks the cluster with AIPerf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pdcluster import add_version_flag
from pdcluster import constants as C


def _load_clusters(path: str) -> list[dict[str, Any]]:
    """The PDClusters of a YAML file (or stdin); a file that cannot be read or parsed, or
    a PDCluster of another API version, ends the command with one clean line."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise SystemExit(f"pdctl: {path}: {e.strerror}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d]
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise SystemExit(f"pdctl: {path}: not YAML{line}: {getattr(e, 'problem', None) or e}") from None
    if not all(isinstance(d, dict) for d in docs):
        raise SystemExit(f"pdctl: {path}: every YAML document must be a mapping (an object)")
    clusters = [d for d in docs if d.get("kind") == C.KIND]
    if not clusters:
        raise SystemExit(f"pdctl: no {C.KIND} in {path}")
    for doc in clusters:
        if doc.get("apiVersion") != C.API_VERSION:
            name = (doc.get("metadata") or {}).get("name", "")
            raise SystemExit(f"pdctl: {name}: apiVersion must be {C.API_VERSION}, not {doc.get('apiVersion')!r}")
    return clusters


def _spec(doc: dict[str, Any]):
    from pdcluster.api.v1alpha1 import PDClusterSpec

    name = doc.get("metadata", {}).get("name", "")
    if not name:
        raise SystemExit("pdctl: metadata.name is required")
    if len(name) > C.MAX_CLUSTER_NAME_LEN:
        raise SystemExit(f"pdctl: metadata.name must be at most {C.MAX_CLUSTER_NAME_LEN} characters")
    try:
        return PDClusterSpec.model_validate(doc.get("spec") or {})
    except ValidationError as e:
        lines = [f"  spec.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise SystemExit(f"pdctl: {name}: invalid spec\n" + "\n".join(lines)) from None


def cmd_crd(args: argparse.Namespace) -> int:
    from pdcluster.api.crd import build_crd, build_scaler_crd, crd_yaml

    sys.stdout.write(crd_yaml(build_scaler_crd if args.scaler else build_crd))
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    from pdcluster.api.docs import api_reference

    sys.stdout.write(api_reference())
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """The apiserver's verdict: the API models (the CRD's structural schema) and the CRD's
    CEL rules offline, or with --server a dry-run apply against the cluster."""
    if args.server:
        return _validate_on_server(args)
    from pdcluster.api.validate import problems

    invalid = 0
    for doc in _load_clusters(args.filename):
        name = (doc.get("metadata") or {}).get("name", "")
        found = problems(doc)
        if found:
            invalid += 1
            print(f"pdctl: {name}: invalid\n" + "\n".join(f"  {p}" for p in found), file=sys.stderr)
        else:
            print(f"{name}: valid")
    return 1 if invalid else 0


def _validate_on_server(args: argparse.Namespace) -> int:
    import asyncio

    from pdcluster.io.kube import ApiError, Kube, KubeConfig

    async def dry_run() -> int:
        config = KubeConfig.load(args.kubeconfig)
        async with Kube(config) as kube:
            failed = 0
            for doc in _load_clusters(args.filename):
                doc = {**doc, "metadata": {"namespace": args.namespace or "default", **doc["metadata"]}}
                try:
                    await kube.apply(doc, field_manager="pdctl-validate", dry_run=True)
                    print(f"{doc['metadata']['name']}: valid (server dry-run)")
                except ApiError as e:
                    failed += 1
                    print(f"pdctl: {doc['metadata']['name']}: {e.message}", file=sys.stderr)
            return 1 if failed else 0

    return asyncio.run(dry_run())


def cmd_render(args: argparse.Namespace) -> int:
    from pdcluster.render import Owner, Replicas, render_all

    out = []
    for doc in _load_clusters(args.filename):
        spec = _spec(doc)
        meta = doc["metadata"]
        owner = Owner(meta["name"], args.namespace or meta.get("namespace", "default"), meta.get("uid", ""))
        out += render_all(spec, owner, Replicas.choose(spec, None))
    yaml.safe_dump_all(out, sys.stdout, sort_keys=False, width=120)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pdcluster import bench
    from pdcluster.render import Owner

    trace = None
    if args.trace:
        try:
            trace = Path(args.trace).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"pdctl: {args.trace}: {getattr(e, 'strerror', None) or e}") from None
    opts = bench.BenchOptions(
        requests=args.requests, concurrency=args.concurrency, rate=args.rate, input_tokens=args.input_tokens,
        input_stddev=args.input_stddev, output_tokens=args.output_tokens, tokenizer=args.tokenizer,
        tokenizer_claim=args.tokenizer_claim, image=args.image, install=args.install,
        keep_seconds=args.keep_seconds, seed=args.seed, name=args.name,
    )  # fmt: skip
    out = []
    for doc in _load_clusters(args.filename):
        spec, meta = _spec(doc), doc["metadata"]
        owner = Owner(meta["name"], args.namespace or meta.get("namespace", "default"), meta.get("uid", ""))
        try:
            out += bench.render(spec, owner, opts, trace)
        except bench.BenchError as e:
            raise SystemExit(f"pdctl bench: {e}") from None
    yaml.safe_dump_all(out, sys.stdout, sort_keys=False, width=120)
    return 0


def _bench_arguments(sp: argparse.ArgumentParser) -> None:
    from pdcluster import bench

    d = bench.BenchOptions()
    sp.add_argument("-f", "--filename", required=True, help="PDCluster YAML, or - for stdin")
    sp.add_argument("-n", "--namespace", help="the PDCluster's namespace (default: the object's, else default)")
    load = sp.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="requests in flight (default 4 without --rate)")
    load.add_argument("--rate", type=float, help="requests per second instead of a concurrency")
    sp.add_argument("--requests", type=int, default=d.requests, help="requests of a synthetic mix")
    sp.add_argument("--input-tokens", type=int, default=d.input_tokens, help="synthetic prompt length, mean")
    sp.add_argument("--input-stddev", type=int, default=d.input_stddev, help="its standard deviation")
    sp.add_argument("--output-tokens", type=int, default=d.output_tokens, help="tokens per answer")
    sp.add_argument("--trace", help="replay a Mooncake-format trace (JSON lines) instead of a synthetic mix")
    sp.add_argument("--tokenizer", help="hub id or path (default: spec.model.name)")
    sp.add_argument(
        "--tokenizer-claim", help="PersistentVolumeClaim holding a Hugging Face cache (HF_HOME) with the tokenizer"
    )
    sp.add_argument("--image", default=d.image, help="the client's image")
    sp.add_argument(
        "--no-install", dest="install", action="store_false", help=f"the image has aiperf {bench.AIPERF_VERSION}"
    )
    sp.add_argument("--keep-seconds", type=int, default=d.keep_seconds, help="keep the pod for kubectl cp")
    sp.add_argument("--seed", type=int, default=d.seed, help="AIPerf's random seed")
    sp.add_argument("--name", help="the Job's name (default: <cluster>-bench)")
    sp.set_defaults(func=cmd_bench)


def cmd_plan(args: argparse.Namespace) -> int:
    from pdcluster.sim import plan_cli

    return plan_cli.run(args)


def cmd_trace(args: argparse.Namespace) -> int:
    from pdcluster.sim import trace_cli

    return trace_cli.run(args)


def cmd_profile(args: argparse.Namespace) -> int:
    from pdcluster import profiling

    return profiling.run(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_version_flag(p)
    sub = p.add_subparsers(dest="command", required=True)
    crd = sub.add_parser("crd", help="print the PDCluster CRD")
    crd.add_argument("--scaler", action="store_true", help="print the PDRoleScaler CRD instead")
    crd.set_defaults(func=cmd_crd)
    sub.add_parser("docs", help="print the API reference").set_defaults(func=cmd_docs)
    for name, func, text in (
        ("render", cmd_render, "print the children"),
        ("validate", cmd_validate, "check a spec"),
    ):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("-f", "--filename", required=True, help="PDCluster YAML, or - for stdin")
        sp.add_argument(
            "-n", "--namespace", help="namespace to render into or dry-run in (default: the object's, else default)"
        )
        if name == "validate":
            sp.add_argument("--server", action="store_true", help="a server-side dry-run against the cluster")
            sp.add_argument("--kubeconfig", help="with --server (default: $KUBECONFIG, in-cluster, ~/.kube/config)")
        sp.set_defaults(func=func)
    _bench_arguments(sub.add_parser("bench", help="print a Job that benchmarks the cluster with AIPerf"))
    plan_parser = sub.add_parser("plan", help="compare autoscaling policies on a trace (fleet simulator)")
    from pdcluster.sim import plan_cli

    plan_cli.add_arguments(plan_parser)
    plan_parser.set_defaults(func=cmd_plan)
    from pdcluster.sim import trace_cli

    trace_parser = sub.add_parser("trace", help="rate curves and day-long request traces for plan")
    trace_cli.add_arguments(trace_parser)
    trace_parser.set_defaults(func=cmd_trace)
    from pdcluster import profiling

    profile_parser = sub.add_parser(
        "profile", help="measure an engine's latency profile, print it as a ConfigMap"
    )
    profiling.add_arguments(profile_parser)
    profile_parser.set_defaults(func=cmd_profile)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
