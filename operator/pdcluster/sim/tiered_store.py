"""The Mooncake store in the fleet simulator: prefix blocks shared by every engine, in a
DRAM tier and an optional SSD tier, each a bounded LRU.

As the engines use it (MooncakeStoreConnector): prefill writes every full block it
computes; a request loads the leading run of stored blocks of its prompt, never the
whole prompt (the last token is computed). Mooncake's master evicts from DRAM when it
fills (`--eviction_high_watermark_ratio`) and, with offload on, moves evicted blocks to
SSD (`--offload_on_evict`) and back to DRAM on a hit (`--promotion_on_hit`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoreConfig:
    dram_blocks: int  # capacity of the DRAM tier, in blocks of the trace's block size
    ssd_blocks: int = 0  # 0: no SSD tier
    dram_gbps: float = 200.0  # what one engine loads a stored block at
    ssd_gbps: float = 25.0
    max_computed_tokens: int | None = (
        512  # the router sends a prompt straight to decode at most this far from stored; None: never
    )


@dataclass(frozen=True)
class Found:
    blocks: int  # leading stored blocks
    from_ssd: int  # of which on SSD (slower to load)


class TieredStore:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.dram: OrderedDict[int, None] = OrderedDict()
        self.ssd: OrderedDict[int, None] = OrderedDict()

    def find(self, blocks: tuple[int, ...]) -> Found:
        """The leading run of the prompt's blocks the store holds; a hit refreshes them."""
        n = ssd = 0
        for h in blocks:
            if h in self.dram:
                self.dram.move_to_end(h)
            elif h in self.ssd:
                ssd += 1
                del self.ssd[h]
                self._to_dram(h)  # promoted on a hit
            else:
                break
            n += 1
        return Found(n, ssd)

    def write(self, blocks: tuple[int, ...]) -> None:
        for h in blocks:
            if h in self.dram:
                self.dram.move_to_end(h)
            else:
                self.ssd.pop(h, None)
                self._to_dram(h)

    def _to_dram(self, h: int) -> None:
        self.dram[h] = None
        while len(self.dram) > self.config.dram_blocks:
            evicted, _ = self.dram.popitem(last=False)
            if self.config.ssd_blocks:
                self.ssd[evicted] = None
                while len(self.ssd) > self.config.ssd_blocks:
                    self.ssd.popitem(last=False)

    def load_s(self, found: Found, block_bytes: float) -> float:
        """Time one engine takes to load `found` (DRAM blocks, then SSD ones)."""
        c = self.config
        dram = (found.blocks - found.from_ssd) * block_bytes * 8 / (c.dram_gbps * 1e9)
        ssd = found.from_ssd * block_bytes * 8 / (c.ssd_gbps * 1e9) if found.from_ssd else 0.0
        return dram + ssd


def reusable_fraction(blocks: list[tuple[int, ...]], block_tokens: int, input_tokens: list[int]) -> float:
    """The share of the trace's prompt tokens an unbounded store could serve: blocks of a
    prompt's leading run that an earlier prompt already had (the last token excluded)."""
    seen: set[int] = set()
    reusable = total = 0
    for prompt, length in zip(blocks, input_tokens, strict=True):
        run = 0
        for h in prompt:
            if h not in seen:
                break
            run += 1
        reusable += min(run * block_tokens, max(length - 1, 0) // block_tokens * block_tokens)
        total += length
        seen.update(prompt)
    return reusable / total if total else 0.0
