"""A discrete-event simulation of a prefill/decode fleet.

What happens to a request, and the model behind each step:

- The router picks a prefill engine with the router's policy (prefix-aware by default)
  the moment the request arrives; the engine queues it (FIFO).
- A prefill engine runs one batch at a time: whole prompts from the head of its queue up
  to vLLM's token budget. A batch takes a + sum(b * new + c * (L^2 - cached^2)) ms
  (perf.Profile; `new` are the tokens not in the engine's prefix cache, whose blocks
  come from the trace's prefix hashes and live in a bounded LRU).
- The whole prompt's KV then moves to a decode engine over a link of `link_gbps`.
- The router picks the least-loaded decode engine when the transfer is due. A decode
  engine admits a sequence at its next step when its KV (prompt + output) fits, and
  steps every running sequence by one token in d0 + d1 * B + d2 * K ms. Steps between
  two changes of the batch are summed in closed form (K grows by B per step), so the
  cost of a request is a handful of events, not one per token.
- The first token reaches the user after the first decode step; TTFT and the mean ITL
  of each request are scored exactly, while policies see only scraped histograms.
- Engines take `startup_s` to become ready and hold their GPUs from scheduling on; a
  removed engine drains (takes no new work, leaves when empty). A new engine waits
  (Pending) while the cluster has no free GPU.

- With a Mooncake store (`FleetConfig.store`, sim/tiered_store.py) prefill writes every block
  it computes to a shared DRAM (and SSD) LRU; at arrival the router looks the prompt up:
  when at most `max_computed_tokens` are not stored, the request skips prefill, loads
  its prefix from the store and decode computes the rest (that compute delays only its
  own first token); otherwise prefill loads the stored prefix (asynchronously, as vLLM
  does: the request waits for it, the engine does not) and computes the rest.

Simplifications, all deliberate: no step-time noise, no preemption (admission reserves
prompt + output, which the trace knows), a long prompt is prefilled in one piece
(no chunking overhead), KV transfers do not contend for the link, and the router never
rejects (no admission control).

Here is the event loop; the engines are in sim/engines.py, the fleet's state and shape
in sim/fleet_state.py, and the two stages in sim/fleet_prefill.py and sim/fleet_decode.py.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from pdcluster.perf import Profile
from pdcluster.sim import scrapes as M
from pdcluster.sim.cutoff import Cutoff
from pdcluster.sim.engines import READY, STARTING, Engine
from pdcluster.sim.fleet_decode import DecodeStage
from pdcluster.sim.fleet_prefill import PrefillStage
from pdcluster.sim.fleet_state import (
    ARRIVE,
    CONTROL,
    DECODE_WAKE,
    ENGINE_READY,
    PREFILL_DONE,
    SCRAPE,
    STORE_LOADED,
    TRANSFER_DONE,
    FleetConfig,
    Policy,
)
from pdcluster.sim.trace import Trace


@dataclass
class Result:
    policy: str
    ttft_s: list[float]
    itl_s: list[float]  # mean ITL per request (0 for one-token outputs)
    finished: list[bool]
    gpu_seconds: float
    end_s: float
    timeline: list[
        tuple[float, int, int, int, int, int]
    ]  # t, P ready, D ready, P target, D target, GPUs held
    decisions: list[tuple[float, int, int, str]] = field(default_factory=list)
    prefill_gpu_seconds: float = 0.0  # GPU-seconds prefill engines spent on batches
    bypassed: int = 0  # requests that skipped prefill (their prefix was stored)
    store_tokens: int = 0  # prompt tokens loaded from the store (by prefill or decode)
    reused_tokens: int = 0  # prompt tokens not computed: an engine's prefix cache or the store
    flips: int = 0  # flexible fleets: engines moved between the roles
    cut_s: float | None = None  # when a cut-off stopped the run (sim/cutoff.py); None: it ran out


class Fleet(PrefillStage, DecodeStage):
    """A fleet under a policy: the event loop over the prefill and decode stages."""

    def run(self) -> Result:
        p, d = self.policy.initial()
        self.scale(p, d, initial=True)
        for i, t in enumerate(self.trace.arrival_s):
            self.push(t + self.ingress_s, ARRIVE, None, i)
        self.push(0.0, SCRAPE)
        if math.isfinite(self.policy.interval_s):
            self.push(self.policy.interval_s, CONTROL)
        total = len(self.trace)
        events = self.events
        pop = heapq.heappop
        cut_s = None
        while events and self.done < total:
            t, _, kind, obj, arg = pop(events)
            if t > self.cfg.max_time_s:
                break
            self.now = t
            if kind == ARRIVE:
                self.arrive(arg)
            elif kind == DECODE_WAKE:
                if obj.wake == arg:  # type: ignore[union-attr]
                    self.decode_boundary(obj)  # type: ignore[arg-type]
            elif kind == PREFILL_DONE:
                self.prefill_done(obj)  # type: ignore[arg-type]
            elif kind == TRANSFER_DONE:
                self.to_decode(arg)
            elif kind == SCRAPE:
                if self.cutoff is not None and self.cutoff.hopeless(t, self.first_token):
                    cut_s = t
                    break
                self.scrape()
                self.push(t + self.cfg.scrape_s, SCRAPE)
            elif kind == CONTROL:
                self.control()
                self.push(t + self.policy.interval_s, CONTROL)
            elif kind == ENGINE_READY:
                self.engine_ready(obj)  # type: ignore[arg-type]
            elif kind == STORE_LOADED:
                self.arrive(arg, counted=True)
        self.account()
        itl = []
        for i in range(total):
            out = self.trace.output_tokens[i]
            span = self.finish[i] - self.first_token[i]
            itl.append(span / (out - 1) if out > 1 else 0.0)
        return Result(
            self.policy.name,
            list(self.ttft),
            itl,
            [not math.isnan(f) for f in self.finish],
            self.gpu_seconds,
            self.now,
            self.timeline,
            self.decisions,
            self.prefill_gpu_seconds,
            self.bypassed,
            self.store_tokens,
            self.reused_tokens,
            self.flips,
            cut_s,
        )

    def engine_ready(self, engine: Engine) -> None:
        if engine.state != STARTING:
            return
        engine.state = READY
        self.ready[engine.role].append(engine)
        if engine.role == "decode":
            self.relieve_lone()
        else:
            self.go_lone()
        self.events_from(engine)
        self.mark()
        self.serve_backlog(engine.role)

    def serve_backlog(self, role: str) -> None:
        """Requests that found no ready engine of a role, once one is ready."""
        backlog = self.backlog[role]
        while backlog and self.ready[role]:
            i = backlog.popleft()
            if role == "prefill":
                self.arrive(i, counted=True)
            else:
                self.to_decode(i)

    # ---------------------------------------------------------------- control
    def control(self) -> None:
        wanted = self.policy.decide(self.now, self)
        if wanted is not None and wanted != self.targets:
            self.decisions.append((self.now, *wanted, getattr(self.policy, "last_reason", "")))
            self.scale(*wanted)
            for role in self.backlog:  # a flip can give a role its first ready engine
                self.serve_backlog(role)

    def scrape(self) -> None:
        # A lone engine's decode half is no decode engine to the operator: the pod acts
        # as prefill (flexible.acting_roles), and its series are filed there.
        prefill, decode = self.ready["prefill"], [e for e in self.ready["decode"] if not e.lone]
        gauges = {
            M.PREFILL_WAITING: float(sum(len(e.queue) for e in prefill)),  # type: ignore[attr-defined]
            M.DECODE_RUNNING: float(sum(e.batch for e in decode)),  # type: ignore[attr-defined]
            M.PREFILL_READY: float(len(prefill)),
            M.DECODE_READY: float(len(decode)),
        }
        if decode:
            cap = self.profile.max_kv_tokens
            used = 0.0
            for e in decode:
                used += e.kv + e.batch * e.steps_done(self.now)  # type: ignore[attr-defined]
            gauges[M.DECODE_KV_USAGE] = used / cap / len(decode)
        self.scrapes.record(
            M.Sample(
                self.now,
                {name: h.snapshot() for name, h in self.hist.items()},
                dict(self.counters),
                gauges,
            )
        )


def simulate(
    trace: Trace, profile: Profile, policy: Policy, config: FleetConfig, cutoff: Cutoff | None = None
) -> Result:
    return Fleet(trace, profile, policy, config, cutoff).run()
