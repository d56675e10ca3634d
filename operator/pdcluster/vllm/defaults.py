"""vLLM's OpenAI-server defaults on an H100/H200-class GPU (70 GiB or more), which the
simulators, the capacity models and the engine simulator all assume: vllm/engine/
arg_utils.py, _set_default_max_num_seqs_and_batched_tokens_args (get_batch_defaults)."""

from __future__ import annotations

MAX_NUM_SEQS = 1024
MAX_NUM_BATCHED_TOKENS = 8192
