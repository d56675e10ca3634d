"""vLLM's MooncakeStoreConnector on the simulator: prefix blocks to and from a real
Mooncake store, under the keys vLLM writes (vllm/hashing.py: block_keys), so the router's
store lookups and the master see what they would see with real engines.

As the connector does (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/):
- a request that did not come with a hand-off looks up the leading run of its full
  blocks in the store, at most all but the prompt's last token, and loads it: those
  tokens count as `external_kv_transfer` and only the rest is computed;
- an engine whose store role writes (kv_both, kv_producer) puts the full blocks of
  every prompt it computed, after the prefill.
A load takes the profile's KV bytes over `--sim-kv-gbps`; the payloads in the store are
KV bytes / MOONCAKE_PAYLOAD_DIVISOR, as for the hand-off.
"""

from __future__ import annotations

import asyncio
import logging

from pdcluster.enginesim.kv.mooncake_client import MOONCAKE_PAYLOAD_DIVISOR, MooncakeStore
from pdcluster.perf import Profile
from pdcluster.vllm import kvtransfer as kvt
from pdcluster.vllm.hashing import block_keys, loadable_tokens

log = logging.getLogger(__name__)

WRITING_ROLES = kvt.WRITING_ROLES
LOADING_ROLES = kvt.LOADING_ROLES


class PrefixStore:
    def __init__(
        self,
        client: MooncakeStore,
        *,
        role: str,
        model: str,
        block_size: int,
        hash_seed: str | None,
        profile: Profile,
        gbps: float,
        time_scale: float,
    ):
        self.client = client
        self.writes = role in WRITING_ROLES
        self.loads = role in LOADING_ROLES
        self.model = model.rstrip("/").split("/")[-1]  # as vLLM's store worker names it
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.profile = profile
        self.gbps = gbps
        self.time_scale = time_scale
        self._saving: set[asyncio.Task[None]] = set()

    def keys(self, tokens: list[int]) -> list[str]:
        return block_keys(tokens, self.block_size, self.model, self.hash_seed)

    async def load(self, tokens: list[int]) -> int:
        """Prompt tokens loaded from the store (0 when it holds none, or cannot answer)."""
        keys = self.keys(tokens)
        if not self.loads or not keys:
            return 0
        found = await self.client.exist(keys)
        stored = loadable_tokens([f == 1 for f in found], self.block_size, len(tokens))
        blocks = -(-stored // self.block_size)
        if blocks:
            payloads = await self.client.get_many(keys[:blocks])
            got = next((i for i, p in enumerate(payloads) if not p), len(payloads))
            stored = min(stored, got * self.block_size)  # evicted since the lookup
        if stored and self.profile.kv_bytes_per_token:
            await asyncio.sleep(self.profile.kv_transfer_ms(stored, self.gbps) / 1000.0 / self.time_scale)
        return stored

    def save(self, tokens: list[int]) -> None:
        """In the background: the request does not wait for its blocks to be stored."""
        keys = self.keys(tokens)
        if not self.writes or not keys:
            return
        task = asyncio.get_running_loop().create_task(self._save(keys))
        self._saving.add(task)
        task.add_done_callback(self._saving.discard)

    async def _save(self, keys: list[str]) -> None:
        found = await self.client.exist(keys)
        new = [k for k, f in zip(keys, found, strict=True) if f == 0]
        size = self.block_size * self.profile.kv_bytes_per_token // MOONCAKE_PAYLOAD_DIVISOR
        if new and not await self.client.put_many(new, size):
            log.warning("store: putting %d blocks failed", len(new))

    async def close(self) -> None:
        for task in list(self._saving):
            task.cancel()
        await asyncio.gather(*self._saving, return_exceptions=True)
        await self.client.close()  # unmounts the segment (from a master that is gone, after retries)
