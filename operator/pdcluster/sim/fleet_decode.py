"""The decode stage of the fleet: continuous batching on the least-loaded decode engine,
stepped in closed form between two changes of the batch, and each request's completion."""

from __future__ import annotations

import heapq

from pdcluster.sim import scrapes as M
from pdcluster.sim.engines import DecodeEngine, Engine
from pdcluster.sim.fleet_state import DECODE_WAKE, FleetState


class DecodeStage(FleetState):
    def to_decode(self, i: int) -> None:
        engines = self.ready["decode"]
        if not engines:
            self.backlog["decode"].append(i)
            return
        engine: DecodeEngine = self.decode_router.pick(engines)  # type: ignore[assignment]
        engine.waiting.append(i)
        engine.inflight_tokens += self.trace.input_tokens[i] + self.trace.output_tokens[i]
        engine.inflight_requests += 1
        if engine.batch == 0:
            self.decode_boundary(engine, start=True)
        else:
            self.schedule_wake(engine)

    def admissible(self, engine: DecodeEngine) -> bool:
        if not engine.waiting:
            return False
        i = engine.waiting[0]
        need = self.trace.input_tokens[i] + self.trace.output_tokens[i]
        # A sequence larger than the whole cache still runs alone (as vLLM would, slowly).
        return engine.reserved + need <= self.profile.max_kv_tokens or engine.batch == 0

    def schedule_wake(self, engine: DecodeEngine) -> None:
        step = engine.running[0][0] if engine.running else None
        if self.admissible(engine):
            join = engine.step0 + engine.steps_done(self.now) + 1
            step = join if step is None else min(step, join)
        if step is None:
            return
        engine.wake += 1
        self.push(engine.boundary_s(step), DECODE_WAKE, engine, engine.wake)

    def decode_boundary(self, engine: DecodeEngine, start: bool = False) -> None:
        """Close the epoch at the current step boundary: finish, admit, start the next."""
        tr = self.trace
        d0, d1, d2 = self.profile.decode_coef
        if start:
            step = engine.step0
            kv = engine.kv
        else:
            step = engine.step0 + engine.steps_done(self.now + 1e-9)
            n = step - engine.step0
            # A lone engine's streams are no decode engine's (flexible.acting_roles).
            if n > 0:
                for name in (M.ROUTER_ITL,) if engine.lone else (M.DECODE_ITL, M.ROUTER_ITL):
                    self.hist[name].observe_steps(
                        engine.step_ms / 1000.0, engine.growth / 1000.0, n, engine.batch, engine.fresh
                    )
            kv = engine.kv + engine.batch * n
            if not engine.lone:
                self.counters[M.DECODE_GENERATION_TOKENS] += engine.batch * n
        running = engine.running
        while running and running[0][0] <= step:
            _, i = heapq.heappop(running)
            size = tr.input_tokens[i] + tr.output_tokens[i]
            kv -= size
            engine.reserved -= size
            engine.inflight_tokens -= size
            engine.inflight_requests -= 1
            self.complete(i)
        joined = []
        while self.admissible(engine):
            i = engine.waiting.popleft()
            size = tr.input_tokens[i] + tr.output_tokens[i]
            heapq.heappush(running, (step + tr.output_tokens[i], i))
            engine.reserved += size
            kv += tr.input_tokens[i]
            joined.append(i)
        engine.batch = len(running)
        engine.t0 = self.now
        engine.step0 = step
        engine.kv = kv
        prompts_ms = self.twin_prompt_ms(engine)  # a step shared with a prompt batch takes its time
        engine.step_ms = (prompts_ms or d0) + d1 * engine.batch + d2 * kv
        engine.growth = d2 * engine.batch
        engine.fresh = len(joined)
        first = self.now + engine.step_ms / 1000.0
        ttft_hist, beyond_hist = self.hist[M.ROUTER_TTFT], self.hist[M.ROUTER_TTFT_BEYOND_PREFILL]
        prefill_hist, after_hist = self.hist[M.ROUTER_PREFILL], self.hist[M.ROUTER_AFTER_PREFILL]
        cutoff = self.cutoff
        for i in joined:
            self.first_token[i] = first
            self.ttft[i] = first - tr.arrival_s[i]
            ttft_hist.observe(self.ttft[i])
            beyond_hist.observe(max(self.ttft[i] - self.own_prefill_s[i], 0.0))
            if cutoff is not None:
                cutoff.first_token(i, self.ttft[i])
            prefill_hist.observe(self.prefilled_at[i] - tr.arrival_s[i])
            after_hist.observe(first - self.prefilled_at[i])
        if engine.batch:
            self.schedule_wake(engine)
        else:
            engine.wake += 1
            self.retire_if_empty(engine)

    def reshared(self, engine: Engine) -> None:
        """Close the epoch at the end of the step under way, so that the steps after it
        take the engine's new share (an earlier wake-up is never skipped: none is due
        before that step ends)."""
        if isinstance(engine, DecodeEngine) and engine.batch:
            engine.wake += 1
            step = engine.step0 + engine.steps_done(self.now) + 1
            self.push(engine.boundary_s(step), DECODE_WAKE, engine, engine.wake)

    def complete(self, i: int) -> None:
        tr = self.trace
        self.finish[i] = self.now
        self.done += 1
        out = tr.output_tokens[i]
        itl = (self.now - self.first_token[i]) / (out - 1) if out > 1 else 0.0  # the stream's mean
        if self.cutoff is not None:
            self.cutoff.finished(i, self.ttft[i], itl)
        self.counters[M.ROUTER_FINISHED] += 1
        self.counters[M.ROUTER_GENERATION_TOKENS] += out
        if out > 1:
            self.hist[M.ROUTER_TPOT].observe(itl)
        self.hist[M.REQUEST_DURATION].observe(self.now - tr.arrival_s[i])
        self.hist[M.INPUT_TOKENS].observe(tr.input_tokens[i])
        self.hist[M.OUTPUT_TOKENS].observe(tr.output_tokens[i])
