"""Router throughput and added latency, side by side with a direct engine and with
Mooncake's shipped proxy, on loopback with zero-latency simulated engines.

    .venv/bin/python benchmarks/router_bench.py [--duration 8] [--concurrency 32]

Setups, all in front of the same two engine simulators (`--sim-profile zero`: no model
time, so what is measured is the HTTP path):
  ceiling  the load generator against a canned-answer server: its own limit
  direct   straight to the decode engine (it prefills locally, like vLLM without KV params)
  relay    the router's HTTP front, upstream client and protocol doing the two requests
           and nothing else: the most any router can reach on this machine
  router   pdcluster-router in front of 1 prefill + 1 decode
  mooncake python -m mooncake.vllm_v1_proxy_server in front of the same two (needs the
           `bench` extra: fastapi, uvicorn). It waits for the prefill answer before it
           calls decode, and with vLLM 0.33's in-tree connector it gets no KV parameters
           back, so decode recomputes; the simulators behave the same way.
Workloads: 64-token streams and 4-token non-streamed completions, closed loop.

Then, at a fixed moderate open-loop rate, the router's added latency: per request the
difference of its TTFT/latency percentiles to the direct path, and per token the delay
from the decode engine's write (the simulator's `--sim-stamp-tokens` stamp) to the
client's read, router minus direct.

The load generator is a separate process with a minimal HTTP/1.1 client on raw asyncio
protocols (uvloop), one keep-alive connection per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROMPT = " ".join(
    ["the quick brown fox jumps over the lazy dog"] * 40
)  # about 450 tokens by the 4-bytes rule
WORKLOADS = {
    "stream64": {"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True},
    "short4": {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True},
}
_STAMP = re.compile(rb'"sim_sent_at":([0-9.]+)')


# ---------------------------------------------------------------------------- load generator
class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; parses Content-Length and chunked answers."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.done: asyncio.Future[None] | None = None
        self.state = "head"
        self.remaining = 0
        self.status = 0
        self.first_data_at = 0.0
        self.tokens = 0
        self.body = bytearray()
        self.delays: list[float] | None = None
        self.streaming = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection closed"))

    def send(self, request: bytes, streaming: bool, delays: list[float] | None) -> asyncio.Future[None]:
        assert self.transport is not None
        self.streaming = streaming
        self.state, self.status, self.first_data_at, self.tokens = "head", 0, 0.0, 0
        self.body = bytearray()
        self.delays = delays
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        self.buf += data
        buf = self.buf
        while True:
            if self.state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[:end]).lower()
                del buf[: end + 4]
                self.status = int(head[9:12])
                if b"transfer-encoding: chunked" in head:
                    self.state = "size"
                else:
                    match = re.search(rb"content-length: *(\d+)", head)
                    self.remaining = int(match.group(1)) if match else 0
                    self.state = "body"
            elif self.state == "body":
                if len(buf) < self.remaining:
                    return
                self.body = buf[: self.remaining]
                del buf[: self.remaining]
                self._finish(now)
                return
            else:  # chunked
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(buf[:end].split(b";")[0], 16)
                if size == 0:
                    if len(buf) < end + 4:
                        return
                    del buf[: end + 4]
                    self._finish(now)
                    return
                if len(buf) < end + 2 + size + 2:
                    return
                chunk = bytes(buf[end + 2 : end + 2 + size])
                del buf[: end + 4 + size]
                self._on_chunk(chunk, now)

    def _on_chunk(self, chunk: bytes, now: float) -> None:
        if not self.streaming:  # a chunked JSON answer (uvicorn streams every answer)
            self.body += chunk
            return
        tokens = chunk.count(b'"text":')
        if tokens and not self.tokens:
            self.first_data_at = now
        self.tokens += tokens
        if self.delays is not None:
            self.delays.extend(now - float(t) for t in _STAMP.findall(chunk))

    def _finish(self, now: float) -> None:
        self.state = "head"
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


@dataclass
class _Sample:
    start: float
    end: float
    ttft: float
    ok: bool


@dataclass
class _Run:
    samples: list[_Sample] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)
    errors: int = 0


def _request_bytes(host: str, port: int, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload


async def _one(conn: _Conn, request: bytes, run: _Run, stream: bool, stamps: bool) -> None:
    start = time.monotonic()
    try:
        await conn.send(request, stream, run.delays if stamps else None)
    except ConnectionError:
        run.errors += 1
        raise
    end = time.monotonic()
    ok = conn.status == 200 and (conn.tokens > 0 if stream else b'"finish_reason"' in conn.body)
    if not ok:
        run.errors += 1
    run.samples.append(_Sample(start, end, (conn.first_data_at or end) - start, ok))


async def _connect(host: str, port: int) -> _Conn:
    _, conn = await asyncio.get_running_loop().create_connection(_Conn, host, port)
    return conn


async def loadgen(args: argparse.Namespace) -> dict[str, Any]:
    body = dict(WORKLOADS[args.workload], model="sim")
    request = _request_bytes(args.host, args.port, body)
    stream = bool(body.get("stream"))
    run = _Run()
    deadline = time.monotonic() + args.warmup + args.duration

    async def closed_loop_worker() -> None:
        conn = await _connect(args.host, args.port)
        while time.monotonic() < deadline:
            try:
                await _one(conn, request, run, stream, args.stamps)
            except ConnectionError:
                conn = await _connect(args.host, args.port)

    async def open_loop() -> None:
        idle = [await _connect(args.host, args.port) for _ in range(args.concurrency)]
        rng = random.Random(1)
        pending: set[asyncio.Task[None]] = set()

        async def fire(conn: _Conn) -> None:
            with contextlib.suppress(ConnectionError):
                await _one(conn, request, run, stream, args.stamps)
            idle.append(conn)

        next_at = time.monotonic()
        while next_at < deadline:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if idle:
                task = asyncio.get_running_loop().create_task(fire(idle.pop()))
                pending.add(task)
                task.add_done_callback(pending.discard)
            else:
                run.errors += 1  # more outstanding than connections: the target is overloaded
            next_at += rng.expovariate(args.rate)
        await asyncio.gather(*pending)

    started = time.monotonic()
    if args.rate:
        await open_loop()
    else:
        await asyncio.gather(*(closed_loop_worker() for _ in range(args.concurrency)))
    window_start = started + args.warmup
    kept = [s for s in run.samples if s.start >= window_start and s.end <= deadline and s.ok]
    latencies = [s.end - s.start for s in kept]
    ttfts = [s.ttft for s in kept]
    return {
        "served": len(run.samples),
        "requests": len(kept),
        "rps": len(kept) / args.duration,
        "errors": run.errors,
        "p50_ms": _pct(latencies, 50) * 1e3,
        "p99_ms": _pct(latencies, 99) * 1e3,
        "ttft_p50_ms": _pct(ttfts, 50) * 1e3,
        "ttft_p99_ms": _pct(ttfts, 99) * 1e3,
        "token_delay_p50_ms": _pct(run.delays, 50) * 1e3,
        "token_delay_p99_ms": _pct(run.delays, 99) * 1e3,
        "cpu_s": time.process_time(),
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


# ---------------------------------------------------------------------------- canned server
class _Canned(asyncio.Protocol):
    """Answers every request at once, with the shape of the simulator's answers."""

    STREAM = b"".join(
        b"%x\r\n%s\r\n" % (len(e), e)
        for e in [b'data: {"choices":[{"index":0,"text":" tok","finish_reason":null}]}\n\n'] * 64
        + [b"data: [DONE]\n\n"]
    )
    STREAM_RESPONSE = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        + STREAM
        + b"0\r\n\r\n"
    )
    BODY = b'{"choices":[{"index":0,"text":" a b c d","finish_reason":"length"}],"usage":{"completion_tokens":4}}'
    BODY_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(BODY),
        BODY,
    )

    def __init__(self) -> None:
        self.buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            match = re.search(rb"(?i)content-length: *(\d+)", self.buf[:end])
            size = int(match.group(1)) if match else 0
            if len(self.buf) < end + 4 + size:
                return
            body = bytes(self.buf[end + 4 : end + 4 + size])
            del self.buf[: end + 4 + size]
            self.transport.write(self.STREAM_RESPONSE if b'"stream": true' in body else self.BODY_RESPONSE)  # type: ignore[attr-defined]


async def canned(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_Canned, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------------------- bare relay
async def relay(port: int, prefill: str, bootstrap: str, decode: str) -> None:
    """The router's own HTTP front, upstream client and connector protocol doing the
    prefill and decode requests and nothing else: no checks, policy, admission, metrics
    or timeouts. What is left is the transport, so its req/s bounds any router here."""
    import aiohttp

    from pdcluster.router import openai
    from pdcluster.router.http import HttpServer, Request, Response, Stream
    from pdcluster.router.protocol import BootstrapError, MooncakeProtocol
    from pdcluster.router.upstream import Origin, UpstreamPool

    protocol, pool = MooncakeProtocol(), UpstreamPool()
    async with aiohttp.ClientSession() as session:
        for _ in range(300):  # the prefill engine starts alongside
            with contextlib.suppress(BootstrapError):
                engine = (await protocol.query(session, bootstrap))[0]
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"no engine at {bootstrap}")
    p_origin, d_origin = Origin.parse(prefill), Origin.parse(decode)
    headers = b"Content-Type: application/json\r\n"

    async def handle(request: Request) -> Response | Stream:
        body = json.loads(request.body)
        transfer_id = f"xfer-{random.getrandbits(128):032x}"
        prefill_body = json.dumps(protocol.prefill_body(body, transfer_id)).encode()
        decode_body = json.dumps(protocol.decode_body(body, transfer_id, engine)).encode()
        path = request.path.encode()
        decode_task = asyncio.create_task(pool.request(d_origin, b"POST", path, headers, decode_body))
        prefill_headers = headers + b"X-data-parallel-rank: 0\r\n"
        answer = await pool.request(p_origin, b"POST", path, prefill_headers, prefill_body)
        await answer.read()
        answer.close()
        answer = await decode_task
        try:
            if not body.get("stream"):
                return Response(answer.status, await answer.read(), "application/json")
            stream = request.stream(200, [("Content-Type", "text/event-stream")])
            async for chunk in answer.iter_chunks():
                await stream.write(chunk)
            await stream.write_eof()
            return stream
        finally:
            answer.close()

    server = HttpServer(handle, openai.error_body, 64 * 1024 * 1024)
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------- orchestration
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


def _wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
            if resp.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


class _Procs:
    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.logdir / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each server process has used so far."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for name, proc in self.procs.items():
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _machine_cpu_seconds() -> float:
    """Busy CPU time of the whole machine so far (all processes, ours or not)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _run_loadgen(
    procs: _Procs,
    port: int,
    workload: str,
    args: argparse.Namespace,
    *,
    rate: float = 0.0,
    stamps: bool = False,
) -> dict[str, Any]:
    argv = [
        sys.executable, __file__, "_loadgen", "--port", str(port), "--workload", workload,
        "--duration", str(args.duration), "--warmup", str(args.warmup), "--concurrency", str(args.concurrency),
    ]  # fmt: skip
    if rate:
        argv += ["--rate", str(rate), "--concurrency", "64"]
    if stamps:
        argv.append("--stamps")
    before, machine_before = procs.cpu_seconds(), _machine_cpu_seconds()
    out = subprocess.run(argv, check=True, capture_output=True, timeout=args.duration + args.warmup + 60)
    after, machine = procs.cpu_seconds(), _machine_cpu_seconds() - machine_before
    result = json.loads(out.stdout)
    served = max(result["served"], 1)
    result["cpu_us"] = {name: (after[name] - before[name]) / served * 1e6 for name in after}
    result["cpu_us"]["loadgen"] = result["cpu_s"] / served * 1e6
    ours = sum(after[n] - before[n] for n in after) + result["cpu_s"]
    result["cpu_us"]["other"] = max(machine - ours, 0.0) / served * 1e6
    return result


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:.{digits}f}"  # NaN -> "-"


def orchestrate(args: argparse.Namespace) -> None:
    logdir = Path(tempfile.mkdtemp(prefix="router-bench-"))
    procs = _Procs(logdir)
    names = ("prefill", "bootstrap", "decode", "router", "relay", "mooncake", "canned", "rt-prefill",
             "rt-bootstrap", "rt-decode", "rt-router")  # fmt: skip
    ports = {name: _free_port() for name in names}
    kv = '{"kv_connector":"MooncakeConnector","kv_role":"%s"}'
    sim = [_bin("pdcluster-engine-sim"), "serve", "sim", "--host", "127.0.0.1", "--sim-profile", "zero"]
    try:
        procs.start("canned", [sys.executable, __file__, "_canned", "--port", str(ports["canned"])])

        def pd_with_router(prefix: str, engine: list[str]) -> None:
            """A prefill and a decode simulator and a pdcluster-router in front of them."""
            procs.start(
                f"{prefix}prefill",
                [
                    *engine,
                    "--port",
                    str(ports[f"{prefix}prefill"]),
                    "--kv-transfer-config",
                    kv % "kv_producer",
                ],
                {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(ports[f"{prefix}bootstrap"])},
            )
            procs.start(
                f"{prefix}decode",
                [*engine, "--port", str(ports[f"{prefix}decode"]), "--kv-transfer-config", kv % "kv_consumer",
                 "--sim-stamp-tokens"],
            )  # fmt: skip
            procs.start(
                f"{prefix}router",
                [
                    _bin("pdcluster-router"), "--host", "127.0.0.1", "--port", str(ports[f"{prefix}router"]),
                    "--log-level", "WARNING",
                    "--prefill", f"http://127.0.0.1:{ports[f'{prefix}prefill']}#bootstrap={ports[f'{prefix}bootstrap']}",
                    "--decode", f"http://127.0.0.1:{ports[f'{prefix}decode']}",
                ],
            )  # fmt: skip

        pd_with_router("", sim)
        # A second pair at real time for per-token latency: zero-latency engines emit a
        # stream's tokens in one burst, which measures relay throughput, not latency.
        pd_with_router("rt-", [_bin("pdcluster-engine-sim"), "serve", "sim", "--host", "127.0.0.1"])
        procs.start(
            "relay",
            [sys.executable, __file__, "_relay", "--port", str(ports["relay"]),
             "--prefill", f"http://127.0.0.1:{ports['prefill']}", "--decode", f"http://127.0.0.1:{ports['decode']}",
             "--bootstrap", f"http://127.0.0.1:{ports['bootstrap']}"],
        )  # fmt: skip
        have_mooncake = _mooncake_proxy_available()
        if have_mooncake:
            procs.start(
                "mooncake",
                [
                    sys.executable, "-m", "mooncake.vllm_v1_proxy_server", "--host", "127.0.0.1",
                    "--port", str(ports["mooncake"]), "--prefiller-host", "127.0.0.1",
                    "--prefiller-port", str(ports["prefill"]), "--decoder-host", "127.0.0.1",
                    "--decoder-port", str(ports["decode"]),
                ],
            )  # fmt: skip
        _wait_http(f"http://127.0.0.1:{ports['prefill']}/health")
        _wait_http(f"http://127.0.0.1:{ports['decode']}/health")
        _wait_http(f"http://127.0.0.1:{ports['router']}/ready")
        _wait_http(f"http://127.0.0.1:{ports['rt-router']}/ready")
        _wait_port(ports["relay"])
        if have_mooncake:
            _wait_http(f"http://127.0.0.1:{ports['mooncake']}/healthcheck")

        setups = [("ceiling", "canned"), ("direct", "decode"), ("relay", "relay"), ("router", "router")]
        if have_mooncake:
            setups.append(("mooncake", "mooncake"))
        # Rounds interleave the setups; each setup keeps its best round, which damps
        # the noise of other programs sharing the machine.
        results: dict[tuple[str, str], dict[str, Any]] = {}
        for round_ in range(args.rounds):
            for workload in WORKLOADS:
                for setup, target in setups:
                    r = _run_loadgen(procs, ports[target], workload, args)
                    print(
                        f"  round {round_ + 1} {workload:8s} {setup:8s} {r['rps']:8.0f} req/s  "
                        f"p50 {_fmt(r['p50_ms'])} ms  p99 {_fmt(r['p99_ms'])} ms",
                        file=sys.stderr,
                    )
                    best = results.get((workload, setup))
                    if best is None or r["rps"] > best["rps"]:
                        results[(workload, setup)] = r
        _print_throughput(results, setups, args, have_mooncake)
        _print_added_latency(procs, ports, args)
        if not have_mooncake:
            print("\nMooncake proxy skipped: install the `bench` extra (fastapi, uvicorn)")
        print(f"\nlogs in {logdir}")
    finally:
        procs.stop()


def _print_throughput(
    results: dict[tuple[str, str], dict[str, Any]],
    setups: list[tuple[str, str]],
    args: argparse.Namespace,
    have_mooncake: bool,
) -> None:
    print(
        f"\nclosed loop, concurrency {args.concurrency}, best of {args.rounds} rounds of {args.duration:g} s "
        f"(after {args.warmup:g} s warm-up), zero-latency engines, {os.cpu_count()} CPUs\n"
    )
    head = f"{'workload':9s} {'setup':9s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} {'TTFT50':>7s} {'TTFT99':>7s} {'err':>4s}"
    print(head + "   CPU us/request: proxy  prefill decode loadgen other")
    for workload in WORKLOADS:
        for setup, _ in setups:
            r = results[(workload, setup)]
            cpu = r["cpu_us"]
            proxy = cpu.get(setup, math.nan) if setup in ("router", "relay", "mooncake") else math.nan
            engines = (cpu["prefill"], cpu["decode"]) if setup != "ceiling" else (math.nan, math.nan)
            print(
                f"{workload:9s} {setup:9s} {r['rps']:7.0f} {_fmt(r['p50_ms']):>7s} {_fmt(r['p99_ms']):>7s} "
                f"{_fmt(r['ttft_p50_ms']):>7s} {_fmt(r['ttft_p99_ms']):>7s} {r['errors']:4d}"
                f"   {'':15s}{_fmt(proxy, 0):>5s} {_fmt(engines[0], 0):>7s} {_fmt(engines[1], 0):>6s} "
                f"{_fmt(cpu['loadgen'], 0):>7s} {_fmt(cpu['other'], 0):>5s}"
            )
    print()
    for workload in WORKLOADS:
        router, direct = results[(workload, "router")], results[(workload, "direct")]
        bare = results[(workload, "relay")]
        line = (
            f"{workload}: router {router['rps'] / direct['rps']:.0%} of direct req/s "
            f"(bare relay {bare['rps'] / direct['rps']:.0%})"
        )
        mooncake = results.get((workload, "mooncake"))
        if have_mooncake and mooncake and mooncake["rps"]:
            line += (
                f"; {router['rps'] / mooncake['rps']:.1f}x Mooncake proxy req/s, "
                f"p99 {router['p99_ms'] / mooncake['p99_ms']:.2f}x of its p99"
            )
        print(line)


def _print_added_latency(procs: _Procs, ports: dict[str, int], args: argparse.Namespace) -> None:
    """Router minus direct at a fixed moderate open-loop rate. Per request: zero-latency
    engines, so the difference is the router's hop plus the prefill/decode hand-off.
    Per token: real-time engines (default profile), from the decode engine's write of a
    token (its --sim-stamp-tokens stamp) to the client's read."""
    rate, token_rate = args.moderate_rate, args.moderate_rate / 5
    print("\nadded latency, router minus direct (open loop; p50 and p99 of each, then their difference):")
    print(f"{'metric':38s} {'direct p50':>10s} {'router p50':>10s} {'added':>7s} "
          f"{'direct p99':>10s} {'router p99':>10s} {'added':>7s}")  # fmt: skip
    rows = []
    for workload, label in (
        ("short4", f"4-token request ms, {rate:g} req/s"),
        ("stream64", f"64-token stream ms, {rate:g} req/s"),
    ):
        direct = _run_loadgen(procs, ports["decode"], workload, args, rate=rate)
        router = _run_loadgen(procs, ports["router"], workload, args, rate=rate)
        rows.append((label, direct, router, "p50_ms", "p99_ms", 2))
        if workload == "stream64":
            rows.append((f"TTFT ms, {rate:g} req/s", direct, router, "ttft_p50_ms", "ttft_p99_ms", 2))
    direct = _run_loadgen(procs, ports["rt-decode"], "stream64", args, rate=token_rate, stamps=True)
    router = _run_loadgen(procs, ports["rt-router"], "stream64", args, rate=token_rate, stamps=True)
    rows.append(
        (
            f"per-token delay ms, {token_rate:g} streams/s",
            direct,
            router,
            "token_delay_p50_ms",
            "token_delay_p99_ms",
            3,
        )
    )
    for label, direct, router, p50, p99, digits in rows:
        print(
            f"{label:38s} {_fmt(direct[p50], digits):>10s} {_fmt(router[p50], digits):>10s} "
            f"{_fmt(router[p50] - direct[p50], digits):>7s} {_fmt(direct[p99], digits):>10s} "
            f"{_fmt(router[p99], digits):>10s} {_fmt(router[p99] - direct[p99], digits):>7s}"
        )


def _mooncake_proxy_available() -> bool:
    try:
        import fastapi  # noqa: F401
        import mooncake.vllm_v1_proxy_server  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    lg = sub.add_parser("_loadgen")
    lg.add_argument("--host", default="127.0.0.1")
    lg.add_argument("--port", type=int, required=True)
    lg.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    lg.add_argument("--concurrency", type=int, default=32)
    lg.add_argument("--duration", type=float, default=8.0)
    lg.add_argument("--warmup", type=float, default=2.0)
    lg.add_argument("--rate", type=float, default=0.0, help="open loop at this many req/s (0: closed loop)")
    lg.add_argument("--stamps", action="store_true")
    cn = sub.add_parser("_canned")
    cn.add_argument("--port", type=int, required=True)
    rl = sub.add_parser("_relay")
    for flag in ("--prefill", "--bootstrap", "--decode"):
        rl.add_argument(flag, required=True)
    rl.add_argument("--port", type=int, required=True)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--moderate-rate", type=float, default=100.0, help="req/s for the added-latency runs")
    p.add_argument("--rounds", type=int, default=2, help="runs per setup; the best is reported")
    args = p.parse_args()
    try:
        import uvloop
    except ImportError:
        run = asyncio.run
    else:
        run = uvloop.run
    if args.command == "_loadgen":
        print(json.dumps(run(loadgen(args))))
    elif args.command == "_canned":
        run(canned(args.port))
    elif args.command == "_relay":
        run(relay(args.port, args.prefill, args.bootstrap, args.decode))
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
