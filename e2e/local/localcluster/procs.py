"""Background processes that outlive the command that started them.

A process is identified by (pid, start time in clock ticks) so that a recycled pid is
never mistaken for ours, and it leads its own process group so that stopping it also
stops whatever it spawned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Proc:
    pid: int
    start_ticks: int

    def to_json(self) -> list[int]:
        return [self.pid, self.start_ticks]

    @classmethod
    def from_json(cls, value: Sequence[int]) -> Proc:
        return cls(int(value[0]), int(value[1]))


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) from /proc/<pid>/stat, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may contain spaces
    return fields[0], int(fields[19])


def identify(pid: int) -> Proc:
    stat = _stat(pid)
    return Proc(pid, stat[1] if stat else 0)


def alive(proc: Proc) -> bool:
    stat = _stat(proc.pid)
    if stat is None or stat[1] != proc.start_ticks:
        return False
    if stat[0] in ("Z", "X"):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(proc.pid, os.WNOHANG)  # reap it if it was our child
        return False
    return True


def spawn(argv: Sequence[str], log: Path, *, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Proc:
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
        )
    return identify(popen.pid)


def stop(procs: Sequence[Proc], timeout: float = 10.0) -> None:
    """SIGTERM each process group, then SIGKILL whatever is left after `timeout`."""
    live = [p for p in procs if alive(p)]
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = [p for p in live if alive(p)]
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in live:
        while alive(p) and time.monotonic() < deadline + 5:
            time.sleep(0.02)
