"""What the demo shows: a rich live view on a terminal, plain periodic lines otherwise
(CI logs), and the summary at the end. The SLO figures are the router's over the control
law's window, named and judged as the law names and judges them (pdcluster.slo); the
law's own verdict on its last window stands beside them."""

from __future__ import annotations

import math
import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pdcluster import constants as C
from pdcluster import perf, slo, timestamps
from pdcluster.api.v1alpha1 import Decision, SLOStatus
from pddemo.observe import Observer, Snapshot
from pddemo.replay import Outcomes

PLAIN_LINE_EVERY_S = 10


def make_console() -> Console:
    """Logs without a terminal get long lines rather than rich's 80 columns, each written
    at once (a pipe is block-buffered)."""
    if sys.stdout.isatty():
        return Console()
    sys.stdout.reconfigure(line_buffering=True)
    return Console(width=200)


def step(console: Console, message: str) -> None:
    console.print(f"[bold cyan]==>[/] {message}")


def ms(value_ms: float | None) -> str:
    return "-" if value_ms is None or math.isnan(value_ms) else f"{value_ms:.0f} ms"


def roles_line(s: Snapshot, separator: str = "  ") -> str:
    """'prefill 2/3  decode 1/1': ready/desired per role."""
    return separator.join(
        f"{r} {s.roles.get(r, (0, 0))[1]}/{s.roles.get(r, (0, 0))[0]}" for r in C.ENGINE_ROLES
    )


def clock(d: Decision) -> str:
    """The decision's time of day, UTC."""
    return timestamps.parse(d.time).strftime("%H:%M:%S")


def decision_line(d: Decision) -> str:
    return f"{d.action} at {clock(d)}: prefill {d.prefill}, decode {d.decode}: {d.summary or d.reason}"


class View:
    """A rich live view on a terminal; plain periodic lines otherwise (CI logs)."""

    def __init__(self, console: Console, title: str, total: int, plain: bool) -> None:
        self.console, self.title, self.total = console, title, total
        self.plain = plain or not console.is_terminal
        self.started = time.monotonic()
        self._last_line = 0.0
        self._printed_decisions = 0
        self.progress = Progress(
            TextColumn("replay"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("sent {task.fields[sent]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task("replay", total=total, sent=0)
        self.live = None if self.plain else Live(console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> View:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, out: Outcomes, observer: Observer, phase: str) -> None:
        self.progress.update(self.task, completed=out.done, sent=out.sent)
        if self.live:
            self.live.update(self._render(out, observer, phase))
        else:
            self._print_lines(out, observer, phase)

    def _elapsed(self) -> str:
        return f"[{time.monotonic() - self.started:5.0f}s]"

    def _print_lines(self, out: Outcomes, observer: Observer, phase: str) -> None:
        """A line for each new decision, and a status line every PLAIN_LINE_EVERY_S."""
        for d in observer.decisions[self._printed_decisions :]:
            self.console.print(f"{self._elapsed()} {decision_line(d)}")
        self._printed_decisions = len(observer.decisions)
        if time.monotonic() - self._last_line < PLAIN_LINE_EVERY_S:
            return
        self._last_line = time.monotonic()
        s = observer.snapshot
        self.console.print(
            f"{self._elapsed()} {phase}: sent {out.sent}/{self.total} ok {out.ok} rejected {out.rejected} "
            f"failed {out.failed} | ready/desired {roles_line(s)}"
        )
        self.console.print(f"{' ' * 9}{slo_line(s)}")
        if s.last_decision:
            last = s.last_decision
            self.console.print(f"{' ' * 9}last decision ({last.action}): {last.summary or last.reason}")

    def _render(self, out: Outcomes, observer: Observer, phase: str) -> Group:
        s = observer.snapshot
        top = Table.grid(expand=True)
        top.add_column()
        top.add_column()
        top.add_row(_replicas_table(s), self._latency_table(s, out))
        last = s.last_decision
        footer = (
            f"last decision ({last.action}): {last.summary or last.reason}"
            if last
            else "last decision: none yet (the autoscaler waits for a window of metrics)"
        )
        return Group(
            f"[bold]{self.title}[/]  ({phase}, Ready={s.ready})",
            self.progress,
            top,
            _decisions_table(observer.decisions[-8:]),
            footer,
        )

    def _latency_table(self, s: Snapshot, out: Outcomes) -> Table:
        r = s.reading
        latency = Table(title=f"router {r.quantile if r else ''}, Prometheus", expand=True)
        latency.add_column("metric")
        latency.add_column("value", justify="right")
        if r is not None:
            colour = {slo.MET: "green", slo.MISSED: "red"}.get(r.verdict, "yellow")
            latency.add_row(r.ttft_name, f"{ms(r.ttft_ms)} (SLO {r.ttft_target_ms} ms)")
            if r.ttft_name != "TTFT":
                latency.add_row("TTFT", ms(r.raw_ttft_ms))
            latency.add_row("ITL", f"{ms(r.itl_ms)} (SLO {r.itl_target_ms} ms)")
            latency.add_row("SLO", f"[{colour}]{r.verdict}[/]; operator: {operator_verdict(s.operator_slo)}")
        latency.add_row("requests/s", "-" if s.requests_rate is None else f"{s.requests_rate:.1f}")
        latency.add_row("ok / rejected / failed", f"{out.ok} / {out.rejected} / {out.failed}")
        return latency


def operator_verdict(status: SLOStatus | None) -> str:
    return "none yet" if status is None else status.verdict


def slo_line(s: Snapshot) -> str:
    """'TTFT beyond prefill p90 304 ms of 1000 ms (TTFT 1177 ms), ITL p90 17 ms of 25 ms: met
    (operator: met)': the router's window, and the law's verdict on its own last window."""
    reading = s.reading.line() if s.reading else "no figures yet"
    return f"{reading} (operator: {operator_verdict(s.operator_slo)})"


def _replicas_table(s: Snapshot) -> Table:
    replicas = Table(title="replicas", expand=True)
    for column in ("role", "desired", "ready"):
        replicas.add_column(column, justify="right" if column != "role" else "left")
    for role in C.ENGINE_ROLES:
        desired, ready = s.roles.get(role, (0, 0))
        replicas.add_row(role, str(desired), f"[{'green' if ready == desired else 'yellow'}]{ready}")
    return replicas


def _decisions_table(decisions: list[Decision]) -> Table:
    table = Table(title="scaling decisions (status.autoscaling.lastDecision)", expand=True)
    for column in ("time", "prefill", "decode", "summary"):
        table.add_column(column, overflow="fold")
    for d in decisions:
        table.add_row(clock(d), str(d.prefill), str(d.decode), d.summary or d.reason)
    return table


def _client_percentiles(values_s: list[float]) -> str:
    return "  ".join(
        f"p{q}: {ms(perf.percentile(values_s, q) * 1000 if values_s else None)}" for q in (50, 90, 99)
    )


def summary(console: Console, out: Outcomes, observer: Observer, seconds: float) -> None:
    table = Table(title="summary", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    table.add_row(
        "requests sent / ok / rejected (429) / failed",
        f"{out.sent} / {out.ok} / {out.rejected} / {out.failed}",
    )
    table.add_row("TTFT (client)", _client_percentiles(out.ttft_s))
    table.add_row("ITL (client, mean per request)", _client_percentiles(out.itl_s))
    table.add_row("SLO, router's last window", slo_line(observer.snapshot))
    counted = ", ".join(f"{verdict} {n}" for verdict, n in sorted(observer.verdicts.items()))
    table.add_row("SLO verdicts of the live line", counted or "none")
    table.add_row("scaling decisions", str(len(observer.decisions)))
    table.add_row("replicas now (ready/desired)", roles_line(observer.snapshot, ", "))
    table.add_row("replay and watch", f"{seconds:.0f} s")
    console.print(table)
    for d in observer.decisions:
        console.print(f"  {decision_line(d)}")
    if out.last_error:
        console.print(f"  last error: {out.last_error}")
