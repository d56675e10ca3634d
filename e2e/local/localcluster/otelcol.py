"""A real OpenTelemetry Collector for tests that check the traces a component sends.

The collector (gomod/otelcol, built by build.sh) receives OTLP on 127.0.0.1 and writes
each request it gets as one line of OTLP JSON to a file; `read_spans` turns that file
into `Span`s. Its own telemetry is off, so it opens no port but the receiver's.

    with Collector(tmp_path) as collector:
        ...  # point the component at collector.http_endpoint (OTLP/HTTP)
        [span] = collector.wait_for_spans(lambda s: s.name == "route")
"""

from __future__ import annotations

import base64
import json
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from localcluster import paths
from localcluster.ports import free_port

HOST = "127.0.0.1"
_READY = "Everything is ready."  # logged once every pipeline has started


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str  # 32 hex digits, as W3C traceparent writes it
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    attributes: dict[str, Any]
    service_name: str | None  # the resource's service.name
    resource: dict[str, Any]  # all the resource's attributes


def config(output: Path, *, http_port: int, grpc_port: int | None = None) -> dict[str, Any]:
    """Collector configuration: OTLP/HTTP (and gRPC when given a port) on 127.0.0.1, traces
    to `output` as OTLP JSON lines, flushed every 100 ms; no telemetry of its own."""
    protocols: dict[str, Any] = {"http": {"endpoint": f"{HOST}:{http_port}"}}
    if grpc_port is not None:
        protocols["grpc"] = {"endpoint": f"{HOST}:{grpc_port}"}
    return {
        "receivers": {"otlp": {"protocols": protocols}},
        "exporters": {"file": {"path": str(output), "flush_interval": "100ms"}},
        "service": {
            # Its own metrics would be served on localhost:8888 by default.
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
            "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}},
        },
    }


def _value(v: dict[str, Any]) -> Any:
    """An OTLP JSON AnyValue as a Python value (int64 values come as strings)."""
    if "stringValue" in v:
        return v["stringValue"]
    if "boolValue" in v:
        return v["boolValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "bytesValue" in v:
        return base64.b64decode(v["bytesValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    if "kvlistValue" in v:
        return _attributes(v["kvlistValue"].get("values", []))
    return None


def _attributes(kvs: list[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value", {})) for kv in kvs}


def read_spans(path: Path) -> list[Span]:
    """Every span in the collector's output file, in the order received (a last line still
    being written is left for the next read)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    spans = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n") or not line.strip():
            continue
        for rs in json.loads(line).get("resourceSpans", []):
            resource = _attributes(rs.get("resource", {}).get("attributes", []))
            for ss in rs.get("scopeSpans", []):
                spans.extend(
                    Span(
                        name=s.get("name", ""),
                        trace_id=s.get("traceId", ""),
                        span_id=s.get("spanId", ""),
                        parent_span_id=s.get("parentSpanId", ""),
                        attributes=_attributes(s.get("attributes", [])),
                        service_name=resource.get("service.name"),
                        resource=resource,
                    )
                    for s in ss.get("spans", [])
                )
    return spans


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


class Collector:
    """The collector as a subprocess with its config, output and log in `workdir`."""

    def __init__(self, workdir: Path, *, grpc: bool = False, binary: Path | None = None) -> None:
        self.workdir = workdir
        self.binary = binary or paths.otelcol_binary(paths.bin_dir())
        self.http_port = free_port(HOST)
        self.grpc_port = free_port(HOST) if grpc else None
        self.output = workdir / "otelcol-traces.jsonl"
        self.log = workdir / "otelcol.log"
        self.config_path = workdir / "otelcol.yaml"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def http_endpoint(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT for OTLP/HTTP (traces go to <this>/v1/traces)."""
        return f"http://{HOST}:{self.http_port}"

    @property
    def grpc_endpoint(self) -> str | None:
        return f"{HOST}:{self.grpc_port}" if self.grpc_port is not None else None

    def start(self, timeout: float = 30) -> Collector:
        """Writes the config, starts the collector and waits until it says it is ready (its
        exporters start before its receivers) and its receivers listen."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = config(self.output, http_port=self.http_port, grpc_port=self.grpc_port)
        self.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                [str(self.binary), f"--config={self.config_path}"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        ports = [p for p in (self.http_port, self.grpc_port) if p is not None]
        deadline = time.monotonic() + timeout
        while not (_READY in self._log_since(offset) and all(_listening(p) for p in ports)):
            if self._proc.poll() is not None:
                tail = "\n".join(self._log_since(offset).splitlines()[-20:])
                raise RuntimeError(
                    f"otelcol exited with {self._proc.returncode}; its log ({self.log}):\n{tail}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"otelcol: not ready after {timeout:.0f}s; see {self.log}")
            time.sleep(0.05)
        return self

    def _log_since(self, offset: int) -> str:
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM (the file exporter flushes on shutdown), SIGKILL after `timeout`."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def spans(self) -> list[Span]:
        return read_spans(self.output)

    def wait_for_spans(
        self, match: Callable[[Span], bool] = lambda _: True, *, count: int = 1, timeout: float = 10
    ) -> list[Span]:
        """The spans that `match`, once there are at least `count` of them."""
        deadline = time.monotonic() + timeout
        while True:
            found = [s for s in self.spans() if match(s)]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(found)} of {count} matching spans after {timeout:.0f}s in {self.output}"
                )
            time.sleep(0.1)

    def __enter__(self) -> Collector:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
