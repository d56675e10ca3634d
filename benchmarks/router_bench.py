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
  traced   the same with tracing on (--otlp-traces-endpoint): every request's spans
           exported over OTLP/HTTP to the canned server, which answers 200
  traced10 the same tracing 10% of requests (--trace-sample-ratio 0.1)
  mooncake python -m mooncake.vllm_v1_proxy_server in front of the same two (needs the
           `bench` extra: fastapi, uvicorn). It waits for the prefill answer before it
           calls decode, and with vLLM 0.33's in-tree connector it gets no KV parameters
           back, so decode recomputes; the simulators behave the same way.
Workloads: 64-token streams and 4-token non-streamed completions, closed loop.

The anchor, in the same rounds: SGLang's Rust router (`sglang-router`, pinned in the
`bench` extra) in PD mode, against ours, both in front of the same fake engine pair (a
raw asyncio server: prefill answers one token, decode the whole answer in one write),
which answers each router in its own PD protocol and counts requests that do not carry
it (ours: `kv_transfer_params` for prefill and decode; SGLang's: `bootstrap_room` on
both, sent at once). sglang-router 0.3.2 never sets TCP_NODELAY, which stalls each of
its streams about 44 ms (Nagle's algorithm against the client's delayed ACK), so it runs
twice: as shipped, and with the flag set on every socket it accepts or connects by a
small LD_PRELOAD library built here with the C compiler. Ratios ours / theirs are per
round, medians over the rounds; router CPU from /proc.

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
import statistics
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
        """Frames HTTP/1.1 requests (Content-Length bodies) and writes each answer."""
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end])
            match = re.search(rb"(?i)content-length: *(\d+)", head)
            size = int(match.group(1)) if match else 0
            if len(self.buf) < end + 4 + size:
                return
            body = bytes(self.buf[end + 4 : end + 4 + size])
            del self.buf[: end + 4 + size]
            self.transport.write(self.respond(head.split(b" ", 2), body))  # type: ignore[attr-defined]

    def respond(self, line: list[bytes], body: bytes) -> bytes:
        return self.STREAM_RESPONSE if re.search(rb'"stream": *true', body) else self.BODY_RESPONSE


async def canned(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_Canned, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------------------- fake PD engines
class _FakeEngine(_Canned):
    """One side of a PD pair for both routers, at no model cost: prefill answers one
    token, decode the whole answer in one write. GET /query is the Mooncake bootstrap
    server our router asks; /server_info and /model_info are 404 (sglang-router would
    otherwise fetch a tokenizer for the model path). Counts each completion by whether
    it carries the PD protocol of one of the two routers; GET /fake/stats returns them."""

    ONE_TOKEN = (
        b'{"choices":[{"index":0,"text":" a","finish_reason":"length"}],"usage":{"completion_tokens":1}}'
    )
    QUERY = b'{"0":{"engine_id":"fake-prefill","worker_addr":"127.0.0.1:1"}}'
    stats = {"ours": 0, "sglang": 0, "neither": 0}

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _answer(self, status: str, body: bytes, kind: bytes = b"application/json") -> bytes:
        return b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
            status.encode(),
            kind,
            len(body),
            body,
        )

    def respond(self, line: list[bytes], body: bytes) -> bytes:
        method, path = line[0], line[1]
        if method == b"GET":
            if path == b"/query":
                return self._answer("200 OK", self.QUERY)
            if path == b"/fake/stats":
                return self._answer("200 OK", json.dumps(self.stats).encode())
            if path in (b"/health", b"/metrics", b"/v1/models"):
                return self._answer("200 OK", b'{"data":[{"id":"sim"}]}' if path == b"/v1/models" else b"")
            return self._answer("404 Not Found", b"{}")
        if method != b"POST":  # e.g. an HTTP/2 preface ("PRI *"): HTTP/1.1 only here
            return self._answer("400 Bad Request", b"{}")
        flag = b"do_remote_decode" if self.role == "prefill" else b"do_remote_prefill"
        kind = "ours" if flag in body else "sglang" if b"bootstrap_room" in body else "neither"
        self.stats[kind] += 1
        if self.role == "prefill":
            return self._answer("200 OK", self.ONE_TOKEN)
        return super().respond(line, body)


async def fake_engine(port: int, role: str) -> None:
    server = await asyncio.get_running_loop().create_server(
        lambda: _FakeEngine(role), "127.0.0.1", port, backlog=1024
    )
    async with server:
        await server.serve_forever()


NODELAY_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
static void nodelay(int fd) { int one = 1; setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); }
int accept(int fd, struct sockaddr *a, socklen_t *n) {
    static int (*real)(int, struct sockaddr *, socklen_t *);
    if (!real) real = dlsym(RTLD_NEXT, "accept");
    int r = real(fd, a, n); if (r >= 0) nodelay(r); return r;
}
int accept4(int fd, struct sockaddr *a, socklen_t *n, int flags) {
    static int (*real)(int, struct sockaddr *, socklen_t *, int);
    if (!real) real = dlsym(RTLD_NEXT, "accept4");
    int r = real(fd, a, n, flags); if (r >= 0) nodelay(r); return r;
}
int connect(int fd, const struct sockaddr *a, socklen_t n) {
    static int (*real)(int, const struct sockaddr *, socklen_t);
    if (!real) real = dlsym(RTLD_NEXT, "connect");
    int r = real(fd, a, n); int saved = errno;
    if (r == 0 || errno == EINPROGRESS) nodelay(fd);
    errno = saved; return r;
}
"""


def _nodelay_shim(logdir: Path) -> Path | None:
    """The LD_PRELOAD library that sets TCP_NODELAY on every TCP socket (None: no cc)."""
    source, library = logdir / "nodelay.c", logdir / "nodelay.so"
    source.write_text(NODELAY_SHIM)
    try:
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"], check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return library


def _sglang_available() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


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
             "rt-bootstrap", "rt-decode", "rt-router", "fk-prefill", "fk-decode", "fk-router", "sglang",
             "sglang-nodelay", "sglang-metrics", "sglang-nodelay-metrics", "traced", "traced10")  # fmt: skip
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
        # The same router and engines with tracing on: every request's spans exported over
        # OTLP/HTTP to the canned server (it answers 200), so the figure is the router's own cost.
        for name, ratio in (("traced", "1"), ("traced10", "0.1")):
            procs.start(
                name,
                [
                    _bin("pdcluster-router"), "--host", "127.0.0.1", "--port", str(ports[name]),
                    "--log-level", "WARNING",
                    "--prefill", f"http://127.0.0.1:{ports['prefill']}#bootstrap={ports['bootstrap']}",
                    "--decode", f"http://127.0.0.1:{ports['decode']}",
                    "--otlp-traces-endpoint", f"http://127.0.0.1:{ports['canned']}/v1/traces",
                    "--trace-sample-ratio", ratio,
                ],
            )  # fmt: skip
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
        anchor = _start_anchor(procs, ports, logdir)
        _wait_http(f"http://127.0.0.1:{ports['prefill']}/health")
        _wait_http(f"http://127.0.0.1:{ports['decode']}/health")
        _wait_http(f"http://127.0.0.1:{ports['router']}/ready")
        _wait_http(f"http://127.0.0.1:{ports['rt-router']}/ready")
        _wait_http(f"http://127.0.0.1:{ports['traced']}/ready")
        _wait_http(f"http://127.0.0.1:{ports['traced10']}/ready")
        _wait_port(ports["relay"])
        if have_mooncake:
            _wait_http(f"http://127.0.0.1:{ports['mooncake']}/healthcheck")

        setups = [("ceiling", "canned"), ("direct", "decode"), ("relay", "relay"), ("router", "router"),
                  ("traced", "traced"), ("traced10", "traced10")]  # fmt: skip
        if have_mooncake:
            setups.append(("mooncake", "mooncake"))
        setups += [(name, name) for name in anchor]
        # Rounds interleave the setups; each setup keeps its best round, which damps
        # the noise of other programs sharing the machine.
        results: dict[tuple[str, str], dict[str, Any]] = {}
        rounds: list[dict[tuple[str, str], dict[str, Any]]] = []
        for round_ in range(args.rounds):
            rounds.append({})
            for workload in WORKLOADS:
                # Reversed every other round, so that no setup always runs first.
                for setup, target in setups if round_ % 2 == 0 else setups[::-1]:
                    r = _run_loadgen(procs, ports[target], workload, args)
                    rounds[-1][(workload, setup)] = r
                    print(
                        f"  round {round_ + 1} {workload:8s} {setup:8s} {r['rps']:8.0f} req/s  "
                        f"p50 {_fmt(r['p50_ms'])} ms  p99 {_fmt(r['p99_ms'])} ms",
                        file=sys.stderr,
                    )
                    best = results.get((workload, setup))
                    if best is None or r["rps"] > best["rps"]:
                        results[(workload, setup)] = r
        _print_throughput(results, [sp for sp in setups if sp[0] not in anchor], args, have_mooncake)
        _print_tracing(rounds)
        if anchor:
            _print_anchor(rounds, anchor, procs, ports, args)
        else:
            print("\nsglang-router skipped: install the `bench` extra")
        _print_added_latency(procs, ports, args)
        if not have_mooncake:
            print("\nMooncake proxy skipped: install the `bench` extra (fastapi, uvicorn)")
        print(f"\nlogs in {logdir}")
    finally:
        procs.stop()


def _print_tracing(rounds: list[dict[tuple[str, str], dict[str, Any]]]) -> None:
    """What tracing costs the router: per-round ratios against the same router untraced
    (one round's setups run back to back, so they share that round's neighbours)."""
    print(f"\ntracing on / off, medians over {len(rounds)} rounds of per-round ratios:")
    for workload in WORKLOADS:
        for name in ("traced", "traced10"):
            pairs = [(r[(workload, name)], r[(workload, "router")]) for r in rounds]
            rps = statistics.median(t["rps"] / o["rps"] for t, o in pairs if o["rps"])
            cpu = statistics.median(t["cpu_us"][name] / o["cpu_us"]["router"] for t, o in pairs)
            print(f"  {workload:9s} {name:9s} req/s {rps:.2f}x  router CPU per request {cpu:.2f}x")


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
            proxy = cpu.get(setup, math.nan) if setup in ("router", "traced", "traced10", "relay", "mooncake") else math.nan
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


def _start_anchor(procs: _Procs, ports: dict[str, int], logdir: Path) -> list[str]:
    """The fake engine pair, our router and sglang-router (as shipped, and with
    TCP_NODELAY forced when a C compiler can build the shim) in front of it; the names of
    the setups started."""
    if not _sglang_available():
        return []
    for role in ("prefill", "decode"):
        procs.start(
            f"fk-{role}",
            [sys.executable, __file__, "_fake", "--port", str(ports[f"fk-{role}"]), "--role", role],
        )
    prefill, decode = (f"http://127.0.0.1:{ports[f'fk-{r}']}" for r in ("prefill", "decode"))
    _wait_port(ports["fk-prefill"])
    _wait_port(ports["fk-decode"])
    procs.start(
        "fk-router",
        [_bin("pdcluster-router"), "--host", "127.0.0.1", "--port", str(ports["fk-router"]), "--log-level",
         "WARNING", "--kv-probe-interval", "0", "--prefill", f"{prefill}#bootstrap={ports['fk-prefill']}",
         "--decode", decode],
    )  # fmt: skip
    shim = _nodelay_shim(logdir)
    started = ["fk-router"]
    for name, preload in (("sglang", None), ("sglang-nodelay", shim)):
        if name == "sglang-nodelay" and preload is None:
            print("sglang-router with TCP_NODELAY skipped: no C compiler for the shim", file=sys.stderr)
            continue
        procs.start(
            name,
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(ports[name]),
             "--pd-disaggregation", "--prefill", prefill, "8998", "--decode", decode, "--policy", "round_robin",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports[f"{name}-metrics"])],
            {"LD_PRELOAD": str(preload)} if preload else None,
        )  # fmt: skip
        started.append(name)
    _wait_http(f"http://127.0.0.1:{ports['fk-router']}/ready")
    for name in started[1:]:
        _wait_http(f"http://127.0.0.1:{ports[name]}/health", timeout=60)
    return started


def _print_anchor(
    rounds: list[dict[tuple[str, str], dict[str, Any]]],
    anchor: list[str],
    procs: _Procs,
    ports: dict[str, int],
    args: argparse.Namespace,
) -> None:
    """Ours against sglang-router, both in front of the fake pair: per-round ratios."""
    print("\nthe anchor: pdcluster-router (fk-router) and sglang-router in PD mode, same fake engines")
    print(f"{'workload':9s} {'setup':15s} {'req/s':>7s} {'p99 ms':>7s} {'router CPU us/req':>18s}")
    for workload in WORKLOADS:
        for setup in anchor:
            rows = [r[(workload, setup)] for r in rounds]
            print(
                f"{workload:9s} {setup:15s} {statistics.median(r['rps'] for r in rows):7.0f} "
                f"{_fmt(statistics.median(r['p99_ms'] for r in rows)):>7s} "
                f"{statistics.median(r['cpu_us'][setup] for r in rows):18.0f}"
            )
    print(f"\nours / theirs, medians over {len(rounds)} rounds of per-round ratios:")
    for workload in WORKLOADS:
        for theirs in anchor[1:]:
            pairs = [(r[(workload, "fk-router")], r[(workload, theirs)]) for r in rounds]
            rps = statistics.median(o["rps"] / t["rps"] for o, t in pairs if t["rps"])
            p99 = statistics.median(o["p99_ms"] / t["p99_ms"] for o, t in pairs if t["p99_ms"])
            cpu = statistics.median(o["cpu_us"]["fk-router"] / t["cpu_us"][theirs] for o, t in pairs)
            print(
                f"  {workload:9s} vs {theirs:15s} req/s {rps:.2f}x  p99 {p99:.2f}x  CPU per request {cpu:.2f}x"
            )
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['fk-prefill']}/fake/stats") as r:
        prefill = json.loads(r.read())
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['fk-decode']}/fake/stats") as r:
        decode = json.loads(r.read())
    print(f'  protocol check: prefill saw {prefill}, decode saw {decode} ("neither" must be 0)')


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
    fk = sub.add_parser("_fake")
    fk.add_argument("--port", type=int, required=True)
    fk.add_argument("--role", choices=("prefill", "decode"), required=True)
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
    elif args.command == "_fake":
        run(fake_engine(args.port, args.role))
    elif args.command == "_relay":
        run(relay(args.port, args.prefill, args.bootstrap, args.decode))
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
