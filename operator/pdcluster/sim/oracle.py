"""The benchmark's bound: a policy that knows the load before it comes.

Every interval it sizes each role for the requests that will arrive while what it asks
for now is in place: engines it adds now serve from `startup_s` on, engines it removes
are gone now, so it keeps what the busiest stretch of [now, now + startup + interval]
needs. Sizes come from the capacity models with the simulated engines' true profile
(plan.size_for) and each stretch's own prompt lengths. It is the best a controller
using these models could do; it sees no metrics.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from pdcluster.sim.fleet import Fleet
from pdcluster.sim.trace import Trace

# (requests/s, prompt lengths, output lengths) -> (prefill, decode) engines
Sizer = Callable[[float, list[int], list[int]], tuple[int, int]]


class Oracle:
    name = "oracle"

    def __init__(self, trace: Trace, size: Sizer, engines: int, startup_s: float, interval_s: float = 30.0):
        self.trace, self.size, self.engines = trace, size, engines
        self.startup_s, self.interval_s = startup_s, interval_s
        self.last_reason = ""

    def _need(self, start: float, end: float) -> tuple[int, int] | None:
        tr = self.trace
        lo, hi = bisect_left(tr.arrival_s, start), bisect_left(tr.arrival_s, end)
        if hi <= lo:
            return None
        return self.size((hi - lo) / (end - start), tr.input_tokens[lo:hi], tr.output_tokens[lo:hi])

    def _plan(self, now: float) -> tuple[int, int]:
        horizon = now + self.startup_s + self.interval_s
        needs = []
        t = now
        while t < horizon:
            need = self._need(t, min(t + self.interval_s, horizon))
            if need:
                needs.append(need)
            t += self.interval_s
        if not needs:
            return 1, 1
        p, d = max(n[0] for n in needs), max(n[1] for n in needs)
        engines = self.engines
        if p + d > engines:  # the budget: in proportion to the needs, one engine each at least
            p = min(max(round(engines * p / (p + d)), 1), engines - 1)
            d = engines - p
        self.last_reason = f"sized for [{now:.0f}, {horizon:.0f}) s"
        return p, d

    def initial(self) -> tuple[int, int]:
        return self._plan(self.trace.arrival_s[0] if len(self.trace) else 0.0)

    def decide(self, now_s: float, fleet: Fleet) -> tuple[int, int] | None:
        return self._plan(now_s)
