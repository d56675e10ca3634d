"""vLLM's prefix cache on the simulator, and the KV events it publishes.

With `--enable-prefix-caching` (off by default here, unlike vLLM, so that a repeated
prompt costs the same unless asked) an engine keeps the full blocks of the prompts it
computed in an LRU of its KV capacity, under vLLM's block hashes (router/store_hits.py:
engine_block_hashes), and a new prompt computes only what follows its leading cached
run (at most all but its last token, as vLLM recomputes that one).

With `--kv-events-config` (publisher "zmq") it publishes what its cache stores and
evicts as vLLM does (vllm/distributed/kv_events.py, ZmqEventPublisher): a PUB socket on
the endpoint's port plus the DP rank, multipart (topic, 8-byte big-endian sequence
number, msgpack EventBatch `[ts, events, dp_rank]`), events as maps tagged "type"; and
with a `replay_endpoint`, a ROUTER socket that answers a sequence number with the
buffered batches from it on (`buffer_steps` of them) and an end marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from pdcluster.vllm.hashing import engine_block_hashes, leading_cached_run

log = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's name for its own block pool's blocks
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _rank_endpoint(endpoint: str, dp_rank: int) -> str:
    """vLLM's offset_endpoint_port: a TCP port plus the DP rank."""
    if not dp_rank or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + dp_rank}"


class EventPublisher:
    """One DP rank's KV event socket."""

    def __init__(self, config: dict[str, Any], dp_rank: int):
        endpoint = _rank_endpoint(str(config.get("endpoint") or "tcp://*:5557"), dp_rank)
        self.dp_rank = dp_rank
        self.topic = str(config.get("topic") or "").encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=int(config.get("buffer_steps") or 10_000))
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._replay: asyncio.Task[None] | None = None
        if config.get("replay_endpoint"):
            replay = _rank_endpoint(str(config["replay_endpoint"]), dp_rank)
            self._replay = asyncio.get_running_loop().create_task(self._serve_replay(replay))
        log.info("KV events of DP rank %d on %s", dp_rank, endpoint)

    def publish(self, events: list[dict[str, Any]]) -> None:
        payload = msgpack.packb([time.time(), events, self.dp_rank])
        # A PUB socket drops at its high-water mark rather than block: as vLLM's does.
        self._socket.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload))
        self._buffer.append((self._seq, payload))
        self._seq += 1

    async def _serve_replay(self, endpoint: str) -> None:
        socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(endpoint)
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    log.warning("invalid KV event replay request: %s", frames)
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        await socket.send_multipart(
                            (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                        )
                await socket.send_multipart((client, b"", b"", END_SEQ, b""))
        finally:
            socket.close(linger=0)

    async def close(self) -> None:
        self._socket.close(linger=0)
        if self._replay is not None:
            self._replay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay


class PrefixCache:
    def __init__(
        self,
        capacity_blocks: int,
        block_size: int,
        hash_seed: str | None,
        publisher: EventPublisher | None = None,
    ):
        self.capacity_blocks = max(capacity_blocks, 1)
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.publisher = publisher
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self, tokens: list[int]) -> list[bytes]:
        return engine_block_hashes(tokens, self.block_size, self.hash_seed)

    def cached_tokens(self, hashes: list[bytes], prompt_tokens: int) -> int:
        """Tokens of a prompt its engine need not compute: the leading cached run."""
        run = 0
        for h in hashes:
            if h not in self._blocks:
                break
            run += 1
        return leading_cached_run(run, self.block_size, prompt_tokens)

    def insert(self, hashes: list[bytes], tokens: list[int]) -> None:
        """A prompt was computed: its full blocks are cached, the least recently used go."""
        stored: list[bytes] = []
        first_new = None
        for i, h in enumerate(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
                stored.append(h)
                first_new = i if first_new is None else first_new
        evicted: list[bytes] = []
        while len(self._blocks) > self.capacity_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
        if self.publisher is None or not (stored or evicted):
            return
        events: list[dict[str, Any]] = []
        if stored:
            assert first_new is not None
            start = first_new * self.block_size
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": stored,
                    "parent_block_hash": hashes[first_new - 1] if first_new else None,
                    "token_ids": tokens[start : start + len(stored) * self.block_size],
                    "block_size": self.block_size,
                    "lora_id": None,
                    "medium": MEDIUM,
                    "lora_name": None,
                }
            )
        if evicted:
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": MEDIUM})
        self.publisher.publish(events)
