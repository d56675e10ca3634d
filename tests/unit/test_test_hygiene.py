"""The suite's own rules on time: a test waits for a condition with a
deadline, never for a fixed time, and never asserts a bound on how long something took.
A sleep makes a test slow where the machine is fast and flaky where it is loaded; so does
a bound on a measured duration or rate.

The scanner reads the test sources with `ast` (a comment or a string that mentions
`sleep(` is no finding), and every finding must be in ALLOWED with its reason. Entries
name the file, the enclosing function and the call or comparison as written, not a line
number, so that they survive edits elsewhere in the file."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent

SLEEP = "sleep"
TIMING = "timing"
DEADLINE = "deadline"
# A wait's deadline only ends a broken test; one this short is a bound on how long the
# awaited thing may take, which a loaded machine breaks.
SHORTEST_DEADLINE_S = 5.0
# Waits with a deadline: where their deadline argument is (position, keyword).
WAITS = {
    "wait_for": (1, "timeout"),
    "wait_until": (1, "timeout"),
    "timeout": (0, "delay"),
    "poll": (1, "timeout"),
}


@dataclass(frozen=True, order=True)
class Finding:
    path: str  # relative to tests/
    function: str  # qualified name of the enclosing function, "<module>" outside one
    kind: str  # SLEEP, TIMING or DEADLINE
    code: str  # the call or the comparison, as written (whitespace collapsed)
    line: int = 0  # for the message only; not part of what the allow-list matches

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.path, self.function, self.kind, self.code)


# (path, function, kind, code) -> why it is not a wait for a condition or a bound on time.
ALLOWED: dict[tuple[str, str, str, str], str] = {
    # The one wait helper: it polls its condition until a deadline.
    ("e2e/harness.py", "wait_until", SLEEP, "asyncio.sleep(interval)"):
        "the polling interval of the shared wait for a condition, which has a deadline",
    # Helpers that start a server as a plain (not async) context manager or call, where
    # the async wait_until cannot run.
    ("integration/loopback.py", "MasterProcess.start", SLEEP, "time.sleep(0.1)"):
        "a synchronous start-up helper polling the master's /health until its deadline",
    ("integration/loopback.py", "prometheus", SLEEP, "time.sleep(0.1)"):
        "a synchronous start-up helper polling Prometheus' /-/ready until its deadline",
    # Load generation, slow peers and faults, where when things happen is what is under test.
    ("unit/test_router_http.py", "App.__call__", SLEEP, "asyncio.sleep(60)"):
        "a handler that is still working when its client leaves, the case under test",
    ("unit/test_router_store.py", "Fake.request", SLEEP, "asyncio.sleep(self.master_delay_s)"):
        "a slow store master, the case under test",
    ("integration/test_autoscaling.py", "load", SLEEP, "asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))"):
        "paces the load generator at `rate` requests a second",
    ("integration/test_router_fuzz_edges.py", "test_clients_leaving_at_any_point_leak_nothing", SLEEP, "asyncio.sleep(wait)"):
        "a client that waits a generated time before it reads and leaves is the case under test",
    ("integration/test_router_retries.py", "test_prefills_killed_at_random_points_lose_no_request", SLEEP, "asyncio.sleep(rng.uniform(0.0, 0.3))"):
        "kills the prefill at a random point of the requests in flight, which is the fault under test",
    ("e2e/test_operator_faults.py", "_kill_at_random_point", SLEEP, "asyncio.sleep(rng.uniform(0, 0.05))"):
        "kills the operator at a random point just after its k-th write, the fault under test",
    ("e2e/test_operator_faults.py", "_kill_at_random_point", SLEEP, "asyncio.sleep(delay)"):
        "kills the operator after a random delay, the fault under test",
    ("e2e/chaosfaults.py", "Injector._inject", SLEEP, "asyncio.sleep(PROMETHEUS_DOWN_S)"):
        "Prometheus stays stopped for a minute, the fault under test",
    ("e2e/chaosfaults.py", "Injector.inject", SLEEP, "asyncio.sleep(1.0)"):
        "a fault whose injection met a restarting apiserver is tried again a second later",
    ("e2e/chaosfaults.py", "Injector._operator_fault", SLEEP, "asyncio.sleep(self.rng.uniform(*OPERATOR_DOWN_S))"):
        "the operator stays dead a random while before its restart, the fault under test",
    ("e2e/chaosfaults.py", "run_schedule.at", SLEEP, "asyncio.sleep(max(0.0, started + fault.at - time.monotonic()))"):
        "each fault lands at its time on the seeded schedule, the chaos under test",
    ("e2e/chaosfaults.py", "run_chaos", SLEEP, "asyncio.sleep(max(0.0, started + duration - time.monotonic()))"):
        "the load runs for the chaos run's set duration while the faults land",
    ("e2e/test_operator_faults.py", "_kill_at_random_point", SLEEP, "asyncio.sleep(0.05)"):
        "follows the operator's log to the k-th write at which to kill it, within a deadline",
    ("e2e/test_operator_faults.py", "test_foreign_edits_are_reverted_without_a_write_storm", SLEEP, "asyncio.sleep(1.0)"):
        "paces the foreign writer (an HPA or a person) at one edit a second, the load under test",
    # Samplers: they watch an invariant for the whole scenario; nothing waits on them.
    ("e2e/test_autoscaling_faults.py", "test_unschedulable_scale_up_times_out_within_budget.watch_budget", SLEEP, "asyncio.sleep(0.5)"):
        "samples the replica counts throughout, to check the GPU budget is never exceeded",
    ("e2e/test_engine_faults.py", "test_an_engine_change_rolls_both_roles_and_never_pairs_revisions.sample", SLEEP, "asyncio.sleep(0.3)"):
        "samples the engines' request records throughout the rollout, to check no pair mixes revisions",
}  # fmt: skip


# ---------------------------------------------------------------------- the scanner
def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return f"{_dotted(node.func)}()"
    return "?"


def is_clock_call(node: ast.AST) -> bool:
    """time.monotonic(), time.perf_counter(), time.time() (and the _ns forms), loop.time()."""
    if not isinstance(node, ast.Call):
        return False
    name = _dotted(node.func)
    last = name.rsplit(".", 1)[-1]
    if last in {"monotonic", "perf_counter", "monotonic_ns", "perf_counter_ns", "time_ns"}:
        return True
    return name == "time.time" or (last == "time" and "loop" in name)


def is_sleep_call(node: ast.AST) -> bool:
    """time.sleep(x) or asyncio.sleep(x) with x not a literal 0: `sleep(0)` only lets the
    other tasks run, it waits for no time."""
    if not isinstance(node, ast.Call) or _dotted(node.func) not in {"time.sleep", "asyncio.sleep", "sleep"}:
        return False
    first = node.args[0] if node.args else None
    return not (isinstance(first, ast.Constant) and first.value == 0)


def deadline_of(node: ast.Call) -> ast.expr | None:
    """The deadline argument of asyncio.wait_for, asyncio.timeout, wait_until or poll."""
    where = WAITS.get(_dotted(node.func).rsplit(".", 1)[-1])
    if where is None:
        return None
    position, keyword = where
    named = [k.value for k in node.keywords if k.arg == keyword]
    return named[0] if named else (node.args[position] if len(node.args) > position else None)


class _Scope(ast.NodeVisitor):
    """Collects the findings of one function body (nested functions get their own scope,
    but see the names of the enclosing ones, as closures do)."""

    def __init__(
        self, source: str, path: str, qualname: str, durations: set[str], readings: set[str]
    ) -> None:
        self.source, self.path, self.qualname = source, path, qualname
        self.durations, self.readings = set(durations), set(readings)
        self.findings: list[Finding] = []
        self.asserting = False

    # -- names of clock readings and of measured durations, to a fixed point
    def learn(self, body: list[ast.stmt]) -> None:
        assigns = [
            (target, value)
            for stmt in body
            for node in _walk_scope(stmt)
            for target, value in _assignments(node)
        ]
        changed = True
        while changed:
            changed = False
            for target, value in assigns:
                if self.is_duration(value) and target not in self.durations:
                    self.durations.add(target)
                    changed = True
                elif self.is_reading(value) and target not in self.readings | self.durations:
                    self.readings.add(target)
                    changed = True

    def is_reading(self, node: ast.expr) -> bool:
        """A point in time: a clock call, or a name or deadline made from one."""
        if is_clock_call(node) or (isinstance(node, ast.Name) and node.id in self.readings):
            return True
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.is_reading(node.left) or self.is_reading(node.right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
            return self.is_reading(node.left) and not self.is_reading(node.right)
        return False

    def is_offset_reading(self, node: ast.expr) -> bool:
        """A point in time written as another one plus or minus an amount, as in
        `sent > deleted_at + 1.0`: a bound on the time between the two."""
        return isinstance(node, ast.BinOp) and self.is_reading(node)

    def bounds_time(self, node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in node.ops)
            and any(
                self.is_duration(operand) or self.is_offset_reading(operand)
                for operand in [node.left, *node.comparators]
            )
        )

    def is_duration(self, node: ast.expr) -> bool:
        """An expression that holds a measured time: the difference of two readings, or
        anything computed from one (a rate, milliseconds, a sum)."""
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in self.durations:
                return True
            if (
                isinstance(sub, ast.BinOp)
                and isinstance(sub.op, ast.Sub)
                and self.is_reading(sub.left)
                and self.is_reading(sub.right)
            ):
                return True
        return False

    def add(self, kind: str, node: ast.AST) -> None:
        code = " ".join((ast.get_source_segment(self.source, node) or "").split())
        self.findings.append(Finding(self.path, self.qualname, kind, code, getattr(node, "lineno", 0)))

    # -- the findings
    def visit_Call(self, node: ast.Call) -> None:
        if is_sleep_call(node):
            self.add(SLEEP, node)
        deadline = deadline_of(node)
        if (
            isinstance(deadline, ast.Constant)
            and isinstance(deadline.value, (int, float))
            and deadline.value < SHORTEST_DEADLINE_S
        ):
            self.add(DEADLINE, node)
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        for sub in ast.walk(node.test):
            if self.bounds_time(sub):
                self.add(TIMING, sub)
        self.asserting = True
        self.generic_visit(node)
        self.asserting = False

    def visit_comprehension(self, node: ast.comprehension) -> None:
        # A filter picks what a test then asserts on (`late = [r for r in ... if ...]`);
        # one inside an assert has been searched with it.
        if not self.asserting:
            for condition in node.ifs:
                for sub in ast.walk(condition):
                    if self.bounds_time(sub):
                        self.add(TIMING, sub)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scan_inner(node, self.durations, self.readings)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scan_inner(node, set(), set())  # a method does not see the class body's names

    def _scan_inner(
        self,
        node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef,
        durations: set[str],
        readings: set[str],
    ) -> None:
        qualname = node.name if self.qualname == "<module>" else f"{self.qualname}.{node.name}"
        inner = _Scope(self.source, self.path, qualname, durations, readings)
        inner.learn(node.body)
        for stmt in node.body:
            inner.visit(stmt)
        self.findings.extend(inner.findings)


def _walk_scope(node: ast.AST) -> Iterator[ast.AST]:
    """ast.walk that does not enter nested functions or classes."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield from _walk_scope(child)


def _assignments(node: ast.AST) -> list[tuple[str, ast.expr]]:
    """(name, value) for `name = value`, `a, b = x, y` (pairwise), `name: T = value` and
    `name += value` (the name keeps what it was and gains what the value is)."""
    if isinstance(node, ast.Assign):
        pairs: list[tuple[str, ast.expr]] = []
        for target in node.targets:
            if isinstance(target, ast.Name):
                pairs.append((target.id, node.value))
            elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs += [
                    (t.id, v)
                    for t, v in zip(target.elts, node.value.elts, strict=False)
                    if isinstance(t, ast.Name)
                ]
        return pairs
    if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and isinstance(node.target, ast.Name):
        return [(node.target.id, node.value)] if node.value is not None else []
    return []


def scan_source(
    source: str, path: str = "snippet.py", kinds: tuple[str, ...] = (SLEEP, TIMING, DEADLINE)
) -> list[Finding]:
    """The sleeps, the bounds on measured time and the short deadlines in one file's source."""
    scope = _Scope(source, path, "<module>", set(), set())
    tree = ast.parse(source)
    scope.learn(tree.body)
    for stmt in tree.body:
        scope.visit(stmt)
    return sorted(f for f in scope.findings if f.kind in kinds)


def scan_tests() -> list[Finding]:
    """The findings in every test and helper under tests/."""
    findings = []
    for file in sorted(TESTS.rglob("*.py")):
        findings += scan_source(file.read_text(), file.relative_to(TESTS).as_posix())
    return sorted(findings)


# ---------------------------------------------------------------------- the rules
def unlisted(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.key not in ALLOWED]


def test_every_sleep_bound_on_time_and_short_deadline_is_allowed_with_a_reason() -> None:
    left = unlisted(scan_tests())
    assert not left, (
        "wait for the condition instead (the wait_until fixture, tests/e2e/harness.py), with a "
        f"deadline of {SHORTEST_DEADLINE_S:g} s or more; check the value or the order that a bound "
        "on time stood for; if a sleep is the behaviour under test, add it to ALLOWED with its "
        "reason:\n" + "\n".join(f"  {f.path}:{f.line} in {f.function}: {f.kind} {f.code}" for f in left)
    )


def test_every_allowed_entry_still_matches_a_finding() -> None:
    found = {f.key for f in scan_tests()}
    stale = [key for key in ALLOWED if key not in found]
    assert not stale, f"no longer in the tests, remove from ALLOWED: {stale}"


def test_every_allowed_entry_has_a_reason() -> None:
    assert all(len(reason.split()) >= 4 for reason in ALLOWED.values())


# ---------------------------------------------------------------------- the scanner can fail
def snippet(code: str) -> list[tuple[str, str, str]]:
    return [(f.function, f.kind, f.code) for f in scan_source(textwrap.dedent(code))]


def test_the_scanner_finds_sleeps_but_not_a_yield_to_the_loop() -> None:
    found = snippet(
        """
        import asyncio, time

        async def test_x():
            await asyncio.sleep(0.5)
            time.sleep(1)
            await asyncio.sleep(0)  # only lets other tasks run
            text = "time.sleep(3)"  # a string is no call

            def inner():
                time.sleep(delay)
        """
    )
    assert found == [
        ("test_x", SLEEP, "asyncio.sleep(0.5)"),
        ("test_x", SLEEP, "time.sleep(1)"),
        ("test_x.inner", SLEEP, "time.sleep(delay)"),
    ]


def test_the_scanner_finds_bounds_on_measured_durations_and_rates() -> None:
    found = snippet(
        """
        import time

        async def test_x():
            started = time.monotonic()
            await work()
            elapsed = time.monotonic() - started
            assert elapsed < 2
            assert time.perf_counter() - started >= 0.5
            rate = 100 / elapsed
            assert rate > 10
            t0, t1 = time.time(), time.time()
            assert 0 <= t1 - t0 <= 1.0
            assert time.monotonic() < started + 5
            late = [r for r in sent if sent_at[r] > started + 1.0]
            assert not late
        """
    )
    assert [code for _, kind, code in found if kind == TIMING] == [
        "0 <= t1 - t0 <= 1.0",
        "elapsed < 2",
        "rate > 10",
        "sent_at[r] > started + 1.0",
        "time.monotonic() < started + 5",
        "time.perf_counter() - started >= 0.5",
    ]


def test_the_scanner_leaves_deadlines_and_values_alone() -> None:
    found = snippet(
        """
        import time

        async def test_x():
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # a deadline, not an assertion
                pass
            assert time.monotonic() < deadline  # a point in time, not a duration
            started = time.monotonic()
            elapsed = time.monotonic() - started
            print(f"{elapsed:.3f} s")  # reported, not bounded
            assert count < 2
            assert elapsed  # no bound
            after = [r for r in sent if sent_at[r] > started]  # an order of two readings
            assert [n for n in counts if n > 2]
        """
    )
    assert found == []


def test_the_scanner_finds_deadlines_short_enough_to_bound_time() -> None:
    found = snippet(
        """
        async def test_x(wait_until):
            await wait_until(ready, timeout=1.0, interval=0.02)
            await asyncio.wait_for(task, 1)
            async with asyncio.timeout(0.5):
                pass
            await wait_until(ready)  # the default deadline, 30 s
            await asyncio.wait_for(task, 30)
            await wait_until(ready, timeout=limit)  # not a literal: not judged
        """
    )
    assert [code for _, kind, code in found if kind == DEADLINE] == [
        "asyncio.timeout(0.5)",
        "asyncio.wait_for(task, 1)",
        "wait_until(ready, timeout=1.0, interval=0.02)",
    ]


def test_a_new_sleep_fails_the_rule_and_a_listed_one_does_not() -> None:
    new = scan_source("import time\ndef test_x():\n    time.sleep(1)\n", "integration/test_new.py")
    assert [f.key for f in unlisted(new)] == [("integration/test_new.py", "test_x", SLEEP, "time.sleep(1)")]
    listed = scan_source(
        "import asyncio\ndef load():\n    asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))\n",
        "integration/test_autoscaling.py",
    )
    assert listed and unlisted(listed) == []


def test_test_files_have_unique_names() -> None:
    # pytest imports test files by their basename (no packages under tests/): two files of one
    # name in different folders stop the whole run at collection.
    seen: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
