"""Probe and lifecycle-hook handlers (httpGet, tcpSocket, exec, sleep), run the way the
kubelet's prober runs them: HTTP 200-399 is success, redirects are not followed, exec
runs inside the container's namespaces with its environment."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

Obj = dict[str, Any]


@dataclass
class Target:
    """What a handler needs to know about the container it probes."""

    pod_ip: str
    ports: dict[str, int]  # named container ports
    pid: int  # the container's main process, for exec
    env: dict[str, str]
    workdir: str


def _port(value: int | str, target: Target) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    if value not in target.ports:
        raise ValueError(f"no container port named {value!r}")
    return target.ports[value]


async def _http_get(spec: Obj, target: Target, timeout: float, session: aiohttp.ClientSession) -> tuple[bool, str]:
    scheme = spec.get("scheme", "HTTP").lower()
    host = spec.get("host") or target.pod_ip
    path = spec.get("path", "/")
    if not path.startswith("/"):
        path = "/" + path
    url = f"{scheme}://{host}:{_port(spec['port'], target)}{path}"
    headers = {h["name"]: h["value"] for h in spec.get("httpHeaders", [])}
    async with session.get(url, headers=headers, allow_redirects=False, ssl=False,
                           timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        return 200 <= resp.status < 400, f"HTTP probe {url} answered {resp.status}"


async def _tcp(spec: Obj, target: Target, timeout: float) -> tuple[bool, str]:
    host, port = spec.get("host") or target.pod_ip, _port(spec["port"], target)
    _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    writer.close()
    return True, f"connected to {host}:{port}"


async def _exec(spec: Obj, target: Target, timeout: float) -> tuple[bool, str]:
    proc = await asyncio.create_subprocess_exec(
        "nsenter", f"--target={target.pid}", "--mount", "--uts", f"--wd={target.workdir}", "--", *spec["command"],
        env=target.env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    return proc.returncode == 0, out.decode(errors="replace")[-300:]


async def run(handler: Obj, target: Target, timeout: float, session: aiohttp.ClientSession) -> tuple[bool, str]:
    """(success, detail). Errors and timeouts are failures, as for the kubelet."""
    try:
        if "httpGet" in handler:
            return await _http_get(handler["httpGet"], target, timeout, session)
        if "tcpSocket" in handler:
            return await _tcp(handler["tcpSocket"], target, timeout)
        if "exec" in handler:
            return await _exec(handler["exec"], target, timeout)
        if "sleep" in handler:
            await asyncio.sleep(handler["sleep"]["seconds"])
            return True, "slept"
        return False, f"handler {sorted(handler)} is not supported by the local pod runner"
    except TimeoutError:
        return False, f"timed out after {timeout}s"
    except (OSError, ValueError, aiohttp.ClientError) as e:
        return False, f"{type(e).__name__}: {e}"


async def probe_loop(probe: Obj, target: Target, session: aiohttp.ClientSession,
                     on_change: Callable[[bool, str], Awaitable[None]], *, initially: bool = False) -> None:
    """Runs `probe` forever on its period and reports each flip of its result after
    successThreshold successes or failureThreshold failures."""
    await asyncio.sleep(probe.get("initialDelaySeconds", 0))
    state, streak = initially, 0
    period = probe.get("periodSeconds", 10)
    timeout = probe.get("timeoutSeconds", 1)
    while True:
        ok, detail = await run(probe, target, timeout, session)
        streak = streak + 1 if ok != state else 0
        needed = probe.get("successThreshold", 1) if ok else probe.get("failureThreshold", 3)
        if ok != state and streak >= needed:
            state, streak = ok, 0
            await on_change(ok, detail)
        await asyncio.sleep(period)
