"""`pdctl`: the PDCluster toolbox.

pdctl crd                     print the CustomResourceDefinition
pdctl docs                    print the API reference (Markdown)
pdctl render -f cluster.yaml  print the children a PDCluster becomes
pdctl validate -f cluster.yaml
pdctl plan --trace FILE ...   compare autoscaling policies on a real trace
pdctl profile --url URL --name NAME   measure an engine's latency profile (a ConfigMap)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml
from pydantic import ValidationError

from pdcluster import add_version_flag
from pdcluster import constants as C


def _load_clusters(path: str) -> list[dict[str, Any]]:
    stream = sys.stdin if path == "-" else open(path)  # noqa: SIM115 - closed below
    try:
        docs = [d for d in yaml.safe_load_all(stream) if d]
    finally:
        if stream is not sys.stdin:
            stream.close()
    clusters = [d for d in docs if d.get("kind") == C.KIND]
    if not clusters:
        raise SystemExit(f"pdctl: no {C.KIND} in {path}")
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
    for doc in _load_clusters(args.filename):
        _spec(doc)
        print(f"{doc['metadata']['name']}: valid")
    return 0


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


def cmd_plan(args: argparse.Namespace) -> int:
    from pdcluster.sim import plan

    return plan.run(args)


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
        if name == "render":
            sp.add_argument(
                "-n", "--namespace", help="namespace to render into (default: the object's, else default)"
            )
        sp.set_defaults(func=func)
    plan_parser = sub.add_parser("plan", help="compare autoscaling policies on a trace (fleet simulator)")
    from pdcluster.sim import plan

    plan.add_arguments(plan_parser)
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
