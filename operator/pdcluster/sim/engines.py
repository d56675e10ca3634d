"""The simulated engines: router backends (pdcluster.router.policy) with a lifecycle, a
prefill queue and prefix cache, or a decode batch stepped in closed form."""

from __future__ import annotations

import math
from collections import OrderedDict, deque

from pdcluster.router.policy import Backend

PENDING, STARTING, READY, DRAINING, GONE = range(5)


class Engine(Backend):
    """An engine is a router backend (pdcluster.router.policy) with a lifecycle.

    `inflight_tokens` is what the router's policies read: prompt tokens not yet
    prefilled on a prefill engine, KV tokens reserved (running and waiting) on a decode one.
    """

    def __init__(self, ident: int, role: str, ordinal: int, gpus: int) -> None:
        super().__init__(f"{role}-{ident}", role)
        self.ordinal = ordinal
        self.gpus = gpus
        self.state = PENDING
        # Flexible fleets: the same GPUs in the other role, while one of the two drains.
        self.twin: Engine | None = None
        # A flexible pool of one engine: the decode half of an engine that serves requests
        # whole (its twin computes the prompts); not a pod of its own.
        self.lone = False


class PrefillEngine(Engine):
    def __init__(self, ident: int, ordinal: int, gpus: int, cache_blocks: int) -> None:
        super().__init__(ident, "prefill", ordinal, gpus)
        self.queue: deque[int] = deque()
        self.busy = False
        self.batch_ms = 0.0  # the prompt batch under way
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.cache_blocks = cache_blocks

    def idle(self) -> bool:
        return not self.busy and not self.queue


class DecodeEngine(Engine):
    """Continuous batching with closed-form stepping between batch changes."""

    def __init__(self, ident: int, ordinal: int, gpus: int) -> None:
        super().__init__(ident, "decode", ordinal, gpus)
        self.running: list[tuple[int, int]] = []  # heap of (finish step, request)
        self.waiting: deque[int] = deque()
        self.batch = 0
        self.kv = 0  # KV tokens at the start of the epoch
        self.t0 = 0.0  # epoch start (s)
        self.step0 = 0  # step index at the epoch start
        self.step_ms = 0.0  # duration of the epoch's first step
        self.growth = 0.0  # each later step is this much longer (ms)
        self.fresh = 0  # sequences that joined at the epoch start
        self.reserved = 0  # prompt + output tokens of running sequences
        self.wake = 0  # token of the one valid wake-up event

    def idle(self) -> bool:
        return self.batch == 0 and not self.waiting

    def boundary_s(self, step: int) -> float:
        n = step - self.step0
        return self.t0 + (n * self.step_ms + self.growth * n * (n - 1) / 2) / 1000.0

    def steps_done(self, t: float) -> int:
        """Whole steps finished by time t in this epoch."""
        elapsed = (t - self.t0) * 1000.0
        if elapsed <= 0 or self.batch == 0:
            return 0
        a, d = self.step_ms, self.growth
        if d <= 0:
            return int(elapsed // a)
        b = a - d / 2
        n = int((-b + math.sqrt(b * b + 2 * d * elapsed)) / d)
        while n > 0 and self.boundary_s(self.step0 + n) > t:
            n -= 1
        while self.boundary_s(self.step0 + n + 1) <= t:
            n += 1
        return n
