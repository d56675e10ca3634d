"""python -m localcluster.podrunner: started by `e2e/local/cluster up`, logs to podrunner.log."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from localcluster.podrunner.runner import Runner
from pdcluster.io.kube import Kube, KubeConfig


def main() -> None:
    p = argparse.ArgumentParser(prog="podrunner")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--bind-shim", type=Path, required=True)
    p.add_argument("--venv-bin", type=Path, required=True)
    p.add_argument("--apiserver", required=True, help="host:port the kubernetes Service forwards to")
    p.add_argument("--listen", required=True, help="host:port for /healthz and Prometheus' /targets")
    p.add_argument("--vllm", action="store_true", help="run vLLM's image on the real-vLLM runtime")
    args = p.parse_args()
    host, _, port = args.apiserver.rpartition(":")
    listen_host, _, listen_port = args.listen.rpartition(":")

    async def run() -> None:
        async with Kube(KubeConfig.from_file(args.kubeconfig)) as kube:
            runner = Runner(kube, run_dir=args.run_dir, bind_shim=args.bind_shim, venv_bin=args.venv_bin,
                            apiserver=(host, int(port)), listen=(listen_host, int(listen_port)), vllm=args.vllm)
            await runner.run()

    asyncio.run(run())


if __name__ == "__main__":
    main()
