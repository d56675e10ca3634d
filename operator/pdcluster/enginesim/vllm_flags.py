"""Which `vllm serve` flags take no value (vLLM 0.33.0).

The simulator accepts every flag `vllm serve` accepts so that the operator renders the
same command line for both; it only needs to know which flags to skip without
consuming the next word. Taken from vllm==0.33.0: the dataclass fields that become
`argparse.BooleanOptionalAction` (engine/arg_utils.py `_compute_kwargs`, and the
frontend dataclasses in entrypoints/common/cli_args.py), plus the explicit
`store_true` flags. `--no-X` is generated for each, and `--enable-X`/`--disable-X`
pair up as in vllm/utils/argparse_utils.py `EnableDisableAction`.
"""

from __future__ import annotations

import re

_BOOLEAN_NAMES = """
allow-credentials allow-deprecated-quantization async-scheduling cohere-is-reasoning-model
cudagraph-metrics data-parallel-external-lb data-parallel-hybrid-lb dcp-q-replicate
disable-cascade-attn disable-chunked-mm-input disable-custom-all-reduce disable-fastapi-docs
disable-hybrid-kv-cache-manager disable-nccl-for-dp-synchronization disable-sliding-window
disable-uvicorn-access-log enable-auto-tool-choice enable-batch-sharded-sampling
enable-chunked-prefill enable-cumem-allocator enable-dbo enable-elastic-ep enable-ep-weight-filter
enable-eplb enable-expert-parallel enable-fault-tolerance enable-flash-late-interaction
enable-flashinfer-autotune enable-force-include-usage enable-hc-sp enable-layerwise-nvtx-tracing
enable-log-deltas enable-log-outputs enable-log-requests enable-logging-iteration-details
enable-lora enable-mamba-cache-stochastic-rounding enable-mamba-shared-prefix-checkpoint
enable-mfu-metrics enable-mixed-moe-lora-format enable-mm-embeds enable-moe-shared-loras
enable-nccl-comm-suspend enable-offline-docs enable-per-request-metrics enable-prefix-caching
enable-prompt-embeds enable-prompt-tokens-details enable-request-id-headers
enable-return-routed-experts enable-scale-out enable-server-load-tracking enable-shm-tensor-arena
enable-sleep-mode enable-ssl-refresh enable-tokenizer-info-endpoint enable-tower-connector-lora
enable-trace-replay enforce-eager exclude-tools-when-tool-choice-none fail-on-environ-validation
fully-sharded-loras interleave-mm-strings jit-monitor-verbose kv-cache-metrics
kv-sharing-fast-prefill language-model-only log-error-stack long-prefill-token-threshold-adaptive
mm-device-do-normalize mm-encoder-only monokernel numa-bind ray-workers-use-nsight
return-sampling-mask return-tokens-as-token-ids scheduler-reserve-full-isl skip-mm-profiling
skip-tokenizer-init sleep-mode-offload-cudagraph specialize-active-lora swa-bounded-replay
tokens-only trust-remote-code trust-request-chat-template trust-request-mm-kwargs
use-fp64-gumbel use-replayssm use-tqdm-on-load
"""
_STORE_TRUE = (
    "--headless",
    "--grpc",
    "--disable-log-stats",
    "--aggregate-engine-logging",
    "--data-parallel-multi-port-external-lb",
    "-dpm",
)
_SHORT_BOOLEAN = ("-dpe", "-dph", "-ep")  # aliases of boolean flags above
# Flags whose value is optional (bool | str | None fields get nargs="?").
OPTIONAL_VALUE = frozenset({"--hf-token"})


def _spellings(name: str) -> list[str]:
    out = [f"--{name}", f"--no-{name}"]
    for prefix, inverse in (("enable-", "disable-"), ("disable-", "enable-")):
        if name.startswith(prefix):
            out.append(f"--{inverse}{name.removeprefix(prefix)}")
    return out


VALUELESS = frozenset(s for name in _BOOLEAN_NAMES.split() for s in _spellings(name)) | frozenset(
    _STORE_TRUE + _SHORT_BOOLEAN
)


def human_readable_int(value: str) -> int:
    """vLLM's human_readable_int (vllm/utils/argparse_utils.py): '8k' = 8000, '8K' = 8192."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if not match:
        return int(value)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
    return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)
