"""Command line of e2e/local/cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from pathlib import Path

from localcluster import cluster, kubeconfig, nodes
from pdcluster.io.kube import Kube, KubeConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cluster", description="Local Kubernetes control plane with fake GPU nodes.")
    p.add_argument("--name", default="pdcluster", help="cluster name (default: %(default)s)")
    # --name may also follow the subcommand (`cluster down --name demo`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default=argparse.SUPPRESS, help="cluster name")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", parents=[common], help="start the cluster, or reuse it if it is already up")
    defaults = nodes.NodePool()
    up.add_argument("--gpu-nodes", type=int, default=defaults.gpu_nodes)
    up.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node)
    up.add_argument("--rdma-resource", default=defaults.rdma_resource)
    up.add_argument("--rdma-per-node", type=int, default=defaults.rdma_per_node)
    up.add_argument("--gpu-product", default=defaults.gpu_product)
    up.add_argument("--cpu-nodes", type=int, default=defaults.cpu_nodes)
    up.add_argument("--scrape-interval", default="2s", help="Prometheus scrape interval (default: %(default)s)")
    up.add_argument("--vllm", action="store_true", help="run pods of vLLM's image on the real-vLLM runtime")

    sub.add_parser("down", parents=[common], help="stop everything and remove the run directory")
    st = sub.add_parser("status", parents=[common], help="components, addresses and nodes")
    st.add_argument("--json", action="store_true")

    kc = sub.add_parser("kubeconfig", parents=[common], help="print the admin kubeconfig path, or mint one for a ServiceAccount")
    kc.add_argument("--service-account", metavar="NAMESPACE/NAME", help="write a token kubeconfig for this SA")
    kc.add_argument("--output", type=Path, help="where to write the ServiceAccount kubeconfig")
    kc.add_argument("--expiration-seconds", type=int, default=86400)

    rs = sub.add_parser("restart", parents=[common], help="stop one component and start it again, same argv")
    rs.add_argument("component", choices=cluster.COMPONENTS)

    sub.add_parser("env", parents=[common], help="shell exports: eval \"$(e2e/local/cluster env)\"")
    return p


def _require(name: str) -> cluster.State:
    state = cluster.load_state(name)
    if state is None:
        raise SystemExit(f"cluster {name!r} is not up; run: e2e/local/cluster --name {name} up")
    return state


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "up":
        pool = nodes.NodePool(
            gpu_nodes=args.gpu_nodes, gpus_per_node=args.gpus_per_node, rdma_resource=args.rdma_resource,
            rdma_per_node=args.rdma_per_node, gpu_product=args.gpu_product, cpu_nodes=args.cpu_nodes,
        )
        state = cluster.up(args.name, pool, scrape_interval=args.scrape_interval, vllm=args.vllm)
        print(f"kubeconfig: {state.kubeconfig}\nprometheus: {state.prometheus_url}\nrun dir:    {state.run_dir}")
    elif args.command == "down":
        if not cluster.down(args.name):
            print(f"cluster {args.name!r} was not up", file=sys.stderr)
    elif args.command == "status":
        info = cluster.status(args.name)
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            for key, value in info.items():
                print(f"{key}: {value}")
        return 0 if info["up"] else 1
    elif args.command == "kubeconfig":
        state = _require(args.name)
        if not args.service_account:
            print(state.kubeconfig)
            return 0
        namespace, _, sa = args.service_account.partition("/")
        output = args.output or Path(state.run_dir) / f"sa-{namespace}-{sa}.kubeconfig"

        async def mint() -> Path:
            async with Kube(KubeConfig.from_file(state.kubeconfig)) as kube:
                return await kubeconfig.for_service_account(
                    kube, output, namespace, sa, expiration_seconds=args.expiration_seconds
                )

        print(asyncio.run(mint()))
    elif args.command == "restart":
        _require(args.name)
        cluster.restart(args.name, args.component)
        print(f"{args.component} restarted")
    elif args.command == "env":
        state = _require(args.name)
        exports = {
            "KUBECONFIG": state.kubeconfig,
            "PDCLUSTER_PROMETHEUS_URL": state.prometheus_url,
            "PDCLUSTER_CLUSTER_RUN_DIR": state.run_dir,
        }
        for key, value in exports.items():
            print(f"export {key}={shlex.quote(value)}")
        print(f"export PATH={shlex.quote(state.bin_dir)}:\"$PATH\"")
    return 0
