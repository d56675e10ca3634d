"""The prefill stage of the fleet: routing a request to a prefill engine (or past it,
with a store), batching prompts within the token budget, the prefix caches, and the KV
transfer to decode."""

from __future__ import annotations

from pdcluster.router.policy import ExactBlocks
from pdcluster.sim import scrapes as M
from pdcluster.sim.engines import PrefillEngine
from pdcluster.sim.fleet_state import PREFILL_DONE, STORE_LOADED, TRANSFER_DONE, FleetState
from pdcluster.sim.tiered_store import Found
from pdcluster.vllm.hashing import leading_cached_run


class PrefillStage(FleetState):
    def arrive(self, i: int, counted: bool = False) -> None:
        if not counted:
            self.counters[M.REQUESTS_ARRIVED] += 1
            self.counters[M.ROUTER_PROMPT_TOKENS] += self.trace.input_tokens[i]
            if self.store is not None and self.look_up(i):
                return
        engines = self.ready["prefill"]
        if not engines:
            self.backlog["prefill"].append(i)
            return
        blocks = self.trace.blocks[i]
        exact = ExactBlocks(self.trace.block_tokens, blocks) if self.kv_index is not None else None
        engine: PrefillEngine = self.router.pick(engines, self.trace.input_tokens[i], blocks, exact)  # type: ignore[assignment]
        self.router.record(engine.id, blocks)
        engine.queue.append(i)
        engine.inflight_tokens += self.trace.input_tokens[i]
        engine.inflight_requests += 1
        if not engine.busy:
            self.start_prefill(engine)

    def look_up(self, i: int) -> bool:
        """The router's store lookup; True when the request is on its way without prefill
        queueing it now (straight to decode, or loading its prefix first)."""
        assert self.store is not None
        tr, c = self.trace, self.store.config
        length = tr.input_tokens[i]
        found = self.store.find(tr.blocks[i])
        stored = leading_cached_run(found.blocks, tr.block_tokens, length)
        if stored <= 0:
            return False
        found = Found(stored // tr.block_tokens, min(found.from_ssd, stored // tr.block_tokens))
        load_s = self.store.load_s(found, tr.block_tokens * self.profile.kv_bytes_per_token)
        if c.max_computed_tokens is None or length - stored > c.max_computed_tokens:
            # Prefill loads it and computes the rest: the request queues once it is loaded.
            self.stored[i] = stored
            self.push(self.now + load_s, STORE_LOADED, None, i)
            return True
        # Decode loads the prefix and computes the rest itself: no prefill.
        _, b, cq = self.profile.prefill_coef
        compute_s = (b * (length - stored) + cq * (length * length - stored * stored)) / 1000.0
        self.bypassed += 1
        self.store_tokens += stored
        self.reused_tokens += stored
        self.prefilled_at[i] = self.now
        self.push(self.now + load_s + compute_s, TRANSFER_DONE, None, i)
        return True

    def start_prefill(self, engine: PrefillEngine) -> None:
        _, b, c = self.profile.prefill_coef
        tr = self.trace
        budget = self.cfg.max_batched_tokens
        batch: list[tuple[int, int]] = []
        ms = self.prefill_fixed_ms
        used = 0
        queue_hist = self.hist[M.PREFILL_QUEUE_TIME]
        while engine.queue:
            i = engine.queue[0]
            length = tr.input_tokens[i]
            cached = min(self.cached_blocks(engine, tr.blocks[i]) * tr.block_tokens, length - 1)
            stored = self.stored.get(i, 0)
            loaded = max(stored - cached, 0)  # what the store adds to the engine's own cache
            cached = max(cached, stored)
            new = length - cached
            if batch and used + new > budget:
                break
            engine.queue.popleft()
            self.stored.pop(i, None)
            used += new
            ms += b * new + c * (length * length - cached * cached)
            self.store_tokens += loaded
            batch.append((i, cached))
            queue_hist.observe(self.now - tr.arrival_s[i])
            self.counters[M.PREFIX_QUERIES] += length
            self.counters[M.PREFIX_HITS] += cached
            self.reused_tokens += cached
        engine.busy = True
        engine.batch_ms = ms
        self.hist[M.PREFILL_STEPS].observe(used)  # one engine step (a batch within the token budget)
        took_s = (ms + self.twin_streams_ms(engine)) / 1000.0
        self.push(self.now + took_s, PREFILL_DONE, (engine, batch, took_s))
        if engine.twin is not None:
            self.reshared(engine.twin)

    def cached_blocks(self, engine: PrefillEngine, blocks: tuple[int, ...]) -> int:
        cache = engine.cache
        n = 0
        for h in blocks:
            if h not in cache:
                break
            n += 1
        return n

    def prefill_done(self, payload: tuple[PrefillEngine, list[tuple[int, int]], float]) -> None:
        engine, batch, took_s = payload
        tr = self.trace
        cache = engine.cache
        self.prefill_gpu_seconds += took_s * engine.gpus
        ttft_hist = self.hist[M.PREFILL_TTFT]
        prefill_hist = self.hist[M.PREFILL_TIME]
        prompt_hist = self.hist[M.PREFILL_REQUEST_PROMPT_TOKENS]
        for i, _ in batch:
            if self.store is not None:
                self.store.write(tr.blocks[i])
            added = []
            for h in tr.blocks[i]:
                if h in cache:
                    cache.move_to_end(h)
                else:
                    cache[h] = None
                    added.append(h)
            evicted = [cache.popitem(last=False)[0] for _ in range(len(cache) - engine.cache_blocks)]
            if self.kv_index is not None:
                self.kv_index.batch(
                    engine.id, [("BlockStored", added, None), ("BlockRemoved", evicted, None)]
                )
            ttft_hist.observe(self.now - tr.arrival_s[i])
            prefill_hist.observe(took_s)  # each request of a batch is in PREFILL the whole batch
            self.counters[M.PREFILL_PROMPT_TOKENS] += tr.input_tokens[i]
            self.counters[M.PREFILL_SUCCESS] += 1
            prompt_hist.observe(tr.input_tokens[i])
            engine.inflight_tokens -= tr.input_tokens[i]
            engine.inflight_requests -= 1
            transfer = 0.0  # a lone engine's KV stays where it is
            if engine.twin is None or not engine.twin.lone:
                transfer = tr.input_tokens[i] * self.profile.kv_bytes_per_token / self.bytes_per_s
                self.hist[M.PREFILL_KV_HANDOFF].observe(transfer)
            self.prefilled_at[i] = self.now
            self.own_prefill_s[i] = took_s  # scheduled to first token, as vLLM's per-request metrics
            self.push(self.now + transfer, TRANSFER_DONE, None, i)
        engine.busy = False
        if engine.queue:
            self.start_prefill(engine)
        elif engine.twin is not None:
            self.reshared(engine.twin)
        self.retire_if_empty(engine)
