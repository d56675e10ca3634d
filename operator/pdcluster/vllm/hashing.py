"""vLLM's prefix-cache block hash and the store keys built from it.

The block hash is sha256 of the pickled (parent hash, block token ids, extra keys),
chained from sha256(pickle(PYTHONHASHSEED, or "vllm-none-hash" without one))
(v1/core/kv_cache_utils.py: hash_block_tokens, init_none_hash; utils/hashing.py: sha256).
MooncakeStoreConnector keys a block, in its default layout, as
`{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{block hash hex}` (store/data.py).
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed when PYTHONHASHSEED is unset
SUPPORTED_HASH = "sha256"  # the default --prefix-caching-hash-algo; xxhash seeds are per process


def _pickle_sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def engine_block_hashes(tokens: list[int], block_size: int, hash_seed: str | None) -> list[bytes]:
    """vLLM's prefix-cache hashes of the prompt's full blocks, first block first."""
    parent = _pickle_sha256(hash_seed if hash_seed is not None else NONE_HASH_SEED)
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _pickle_sha256((parent, tuple(tokens[start : start + block_size]), None))
        hashes.append(parent)
    return hashes


def block_keys(tokens: list[int], block_size: int, model: str, hash_seed: str | None) -> list[str]:
    """The store keys of the prompt's full blocks, first block first."""
    prefix = f"{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"
    return [prefix + h.hex() for h in engine_block_hashes(tokens, block_size, hash_seed)]


def loadable_tokens(stored: list[bool], block_size: int, prompt_tokens: int) -> int:
    """Tokens an engine loads from the store: the leading run of stored blocks, and never
    the whole prompt (the last token is always computed)."""
    run = 0
    for present in stored:
        if not present:
            break
        run += 1
    return leading_cached_run(run, block_size, prompt_tokens)


def leading_cached_run(blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Tokens an engine need not compute when the first `blocks` full blocks of a prompt
    are cached: never the whole prompt, as vLLM always computes the last token
    (v1/core/kv_cache_manager.py: get_computed_blocks)."""
    return min(blocks * block_size, (prompt_tokens - 1) // block_size * block_size)
