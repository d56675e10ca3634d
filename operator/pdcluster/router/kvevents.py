"""vLLM's KV events, read by the router so that it knows which engine's prefix cache
holds which blocks (the `precise-prefix` policy).

The wire (vllm/distributed/kv_events.py, ZmqEventPublisher, vLLM 0.32): each engine
(`--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",...}'`) binds a PUB
socket on its endpoint's port plus its data-parallel rank and sends multipart messages
(topic, 8-byte big-endian sequence number, msgpack payload). The payload is an EventBatch,
array-like `[ts, events, data_parallel_rank]`; each event a tagged struct, a map with
"type" in vLLM 0.32 (older releases sent arrays with the tag first; both are read).
Block hashes are the sha256 digests of vLLM's prefix cache as bytes, or with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES their low 64 bits as an int
(kv_cache_utils.maybe_convert_block_hash); both become that int here, and the router
turns its own digests of a prompt (store.block_hashes) into the same.

Sequence numbers start at 0 in each engine process and go up by one per batch. A PUB
socket sends nothing from before a subscriber connected, so on each (re)connect (a
restarted engine is a new connection) and on a number skipped (lost events: a removal
may be among them) the feed asks the engine's replay socket (`replay_endpoint`, a
ROUTER: send the first sequence number wanted, get the buffered batches from it on, then
an end marker) for what it missed. A dropped connection, and a gap the replay cannot
fill, reset the engine's entry in the index, which is trusted again from its next batch
or replay: the index may miss blocks, never keep a removed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdcluster.router.policy import KvIndex

log = logging.getLogger(__name__)

KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_LOW64 = (1 << 64) - 1
SYNC_INTERVAL_S = 1.0  # how soon a new engine's events are followed
REPLAY_TIMEOUT_S = 1.0  # for an engine's replay socket's whole answer
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker

Event = tuple[str, list[int], str | None]


def block_id(block_hash: bytes | int) -> int:
    """The int vLLM sends for a block with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""
    if isinstance(block_hash, int):
        return block_hash & _LOW64
    return int.from_bytes(block_hash, "big") & _LOW64


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one EventBatch payload; events of kinds this router does not know
    are skipped. Raises ValueError on a payload that is not an EventBatch."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as e:
        raise ValueError(f"not msgpack: {e}") from e
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError(f"not an EventBatch: {str(batch)[:200]}")
    events: list[Event] = []
    for event in batch[1]:
        if isinstance(event, dict):
            kind, hashes, medium = event.get("type"), event.get("block_hashes") or [], event.get("medium")
        elif isinstance(event, list) and event:
            kind = event[0]
            # Array layout: BlockStored [tag, hashes, parent, token_ids, block_size, lora_id,
            # medium], BlockRemoved [tag, hashes, medium], AllBlocksCleared [tag].
            at = 6 if kind == "BlockStored" else 2
            hashes = event[1] if len(event) > 1 and kind != "AllBlocksCleared" else []
            medium = event[at] if len(event) > at else None
        else:
            raise ValueError(f"not an event: {str(event)[:200]}")
        if kind not in KINDS:
            continue
        if not isinstance(hashes, list) or not all(isinstance(h, (bytes, int)) for h in hashes):
            raise ValueError(f"{kind}: block_hashes is not a list of bytes or ints")
        events.append((kind, [block_id(h) for h in hashes], medium if isinstance(medium, str) else None))
    return events


@dataclass(frozen=True)
class Source:
    """Where one routable engine publishes: its host and the ports of its DP rank."""

    engine: str  # the router's backend id
    host: str
    port: int
    replay_port: int | None = None

    def endpoint(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{port}"


class BatchOrder:
    """The order of one engine's batches: what a batch's sequence number says."""

    def __init__(self) -> None:
        self.expected: int | None = None  # None: nothing known since the last reset

    def see(self, seq: int) -> str:
        """'first' (nothing known before it), 'next', 'gap' (batches from `expected` on
        were lost) or 'old' (had already, from a replay)."""
        if self.expected is not None and seq < self.expected:
            return "old"
        seen = "first" if self.expected is None else "next" if seq == self.expected else "gap"
        if seen != "gap":
            self.expected = seq + 1
        return seen

    def reset(self) -> None:
        self.expected = None


class KvEventFeed:
    """Follows the KV events of every engine the policy picks among (prefill ranks and
    colocated engines), one SUB socket each, into `index`. `sources` says which engines
    there are now; the feed follows them level-based, every SYNC_INTERVAL_S."""

    def __init__(
        self,
        index: KvIndex,
        sources: Callable[[], Iterable[Source]],
        *,
        topic: str = "",
        on_batch: Callable[[str], None] = lambda engine: None,
        on_loss: Callable[[str, str], None] = lambda engine, reason: None,
    ):
        self.index = index
        self.sources = sources
        self.topic = topic.encode()
        self.on_batch = on_batch
        self.on_loss = on_loss
        self._ctx = zmq.asyncio.Context.instance()
        self._followed: dict[Source, asyncio.Task[None]] = {}

    async def run(self) -> None:
        try:
            while True:
                self.sync()
                await asyncio.sleep(SYNC_INTERVAL_S)
        finally:
            await self.close()

    def sync(self) -> None:
        wanted = set(self.sources())
        for source in [s for s in self._followed if s not in wanted]:
            self._followed.pop(source).cancel()
            self.index.reset(source.engine)
        loop = asyncio.get_running_loop()
        for source in wanted - self._followed.keys():
            self._followed[source] = loop.create_task(self._follow(source))

    async def close(self) -> None:
        tasks = list(self._followed.values())
        self._followed.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, source: Source) -> None:
        engine = source.engine
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(source.endpoint(source.port))
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        order = BatchOrder()
        try:
            while True:
                for socket, _ in await poller.poll():
                    if socket is sub:
                        await self._receive(source, await sub.recv_multipart(), order)
                        continue
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        self._lost(engine, "disconnect", order)
                    elif event == zmq.EVENT_CONNECTED:
                        # A new subscriber gets nothing sent before: ask for it.
                        await self._catch_up(source, order, 0)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _receive(self, source: Source, frames: Sequence[bytes], order: BatchOrder) -> None:
        engine = source.engine
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning(
                "KV events of %s: a message of %d frames, not (topic, seq, payload)", engine, len(frames)
            )
            return
        seq = int.from_bytes(frames[1], "big")
        missed = order.expected
        seen = order.see(seq)
        if seen == "old":
            return
        if seen == "gap":
            assert missed is not None
            await self._catch_up(source, order, missed, seq)
            order.see(seq)
        self._apply(engine, frames[2], order)

    async def _catch_up(self, source: Source, order: BatchOrder, start: int, stop: int | None = None) -> None:
        """Apply the batches from `start` (before `stop`) that the engine's replay buffer
        holds. From a gap, anything short of all of them resets the engine's entry."""
        replayed = await self._replay(source, start, stop)
        complete = replayed is not None and [seq for seq, _ in replayed] == list(
            range(start, start + len(replayed) if stop is None else stop)
        )
        if stop is not None and not complete:
            self._lost(source.engine, "gap", order)  # forget, then learn anew
        elif stop is None and replayed is not None:
            self.index.batch(source.engine, [])  # known from here, even with nothing replayed
        for seq, payload in replayed or []:
            if order.see(seq) != "old":
                self._apply(source.engine, payload, order)

    def _apply(self, engine: str, payload: bytes, order: BatchOrder) -> None:
        try:
            events = decode_batch(payload)
        except ValueError as e:
            log.warning("KV events of %s: %s", engine, e)
            self._lost(engine, "undecodable", order)
            return
        self.index.batch(engine, events)
        self.on_batch(engine)

    async def _replay(self, source: Source, start: int, stop: int | None) -> list[tuple[int, bytes]] | None:
        """Batches from `start` (before `stop`) that the engine's replay buffer still
        holds, in order; None when it has no replay socket or does not answer in time."""
        if source.replay_port is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(source.endpoint(source.replay_port))
        got: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await dealer.recv_multipart()  # (empty, topic, seq, payload)
                    if len(frames) != 4 or frames[2] == END_SEQ:
                        return got
                    seq = int.from_bytes(frames[2], "big")
                    if seq >= start and (stop is None or seq < stop):
                        got.append((seq, frames[3]))
        except TimeoutError:
            log.info("KV events of %s: no replay from %s", source.engine, source.endpoint(source.replay_port))
            return None
        finally:
            dealer.close(linger=0)

    def _lost(self, engine: str, reason: str, order: BatchOrder) -> None:
        log.info("KV events of %s: %s; its cache is unknown until its next batch", engine, reason)
        self.index.reset(engine)
        order.reset()
        self.on_loss(engine, reason)
