"""The demo's workload, pure: requests drawn from traces (real ones, or stand-ins
generated from distributions fitted to them), replayed in phases, and token ids whose
blocks repeat where the trace's block hashes do."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pdcluster import perf
from pdcluster.sim import synthetic
from pdcluster.sim.trace import MOONCAKE_BLOCK_TOKENS, Trace, TraceError, load_trace

REPO = Path(__file__).resolve().parents[3]
VOCABULARY = 128_000  # Llama 3's vocabulary size: token ids stay plausible


@dataclass(frozen=True)
class Engine:
    example: Path
    vocabulary: int
    phases: str
    length_divisor: int = 1  # prompt lengths / this, so they fit the model's context
    max_output: int | None = None


ENGINES = {
    # A mix shift: long-context conversations (Mooncake), calm then twice as fast, which
    # want prefill engines; then the Azure conversation trace's short prompts at six times
    # its rate with answers three times as long (as a reasoning model gives), which want
    # decode engines. Within the example's 8 GPUs the autoscaler (10 s interval, 30 s
    # window) moves GPUs from prefill to decode; it is given no latency profile.
    "sim": Engine(REPO / "examples" / "pdcluster-sim.yaml", VOCABULARY, "90:1,150:2,180:6:azure*3"),
    # Real vLLM on two cores: one prefill and one decode engine of a 2048-token vocabulary
    # and a 512-token context, and a two-minute replay (the trace's prompts are 12k
    # tokens on average: divided by 64, they fit with their prefixes still shared).
    "vllm": Engine(
        REPO / "examples" / "pdcluster-vllm-cpu.yaml",
        2048,
        "40:1,40:2,40:1",
        length_divisor=64,
        max_output=32,
    ),
}


@dataclass(frozen=True)
class Request:
    at_s: float  # seconds after the replay starts
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    salt: int  # makes the tokens past the trace's known blocks private to this request


class Phase(NamedTuple):
    seconds: float  # of wall-clock time
    speed: float  # seconds of trace played per second
    trace: str | None = None  # a name of TRACES; None: --trace
    output_scale: float = 1.0  # the trace's output lengths times this (answers of a reasoning model)


# Traces a phase may name: files of the traces folder when replaying real traces, and
# their generated stand-ins (pdcluster.sim.synthetic) otherwise.
TRACES = {
    "conv": "mooncake_conversation_trace.jsonl",
    "synthetic": "mooncake_synthetic_trace.jsonl",
    "azure": "AzureLLMInferenceTrace_conv_2023.csv",
}
GENERATED = {"conv": synthetic.MOONCAKE_CONVERSATION, "azure": synthetic.AZURE_CONVERSATION}
DEFAULT_TRACE = "conv"


def workload(traces: Trace | dict[str | None, Trace], start_s: float, phases: list[Phase]) -> list[Request]:
    """The traces from `start_s` on, replayed in phases: a phase at speed 3 plays three
    seconds of its trace each second; each trace goes on where its last phase stopped."""
    traces = traces if isinstance(traces, dict) else {None: traces}
    cursors = {key: t.arrival_s[0] + start_s for key, t in traces.items()}  # trace time where a phase starts
    salts = {key: k << 40 for k, key in enumerate(traces)}  # no two traces' requests share filler
    out = []
    wall = 0.0
    for phase in (Phase(*p) for p in phases):
        trace, cursor = traces[phase.trace], cursors[phase.trace]
        end = cursor + phase.seconds * phase.speed
        out += [
            Request(
                wall + (at - cursor) / phase.speed,
                trace.input_tokens[i],
                max(1, round(trace.output_tokens[i] * phase.output_scale)),
                trace.blocks[i],
                salts[phase.trace] + i,
            )
            for i, at in enumerate(trace.arrival_s)
            if cursor <= at < end
        ]
        cursors[phase.trace], wall = end, wall + phase.seconds
    return out


def parse_phases(text: str) -> list[Phase]:
    """'60:1,150:3,180:6:azure*4' -> phases: seconds, speed, and optionally a trace of
    TRACES with its output lengths multiplied. Raises argparse.ArgumentTypeError, as the
    type of a command-line option."""
    phases = []
    for part in text.split(","):
        seconds, _, rest = part.partition(":")
        speed, _, trace = rest.partition(":")
        trace, _, scale = trace.partition("*")
        try:
            phase = Phase(float(seconds), float(speed or 1), trace or None, float(scale or 1))
        except ValueError:
            phase = None
        if phase is None or phase.seconds <= 0 or phase.speed <= 0 or phase.output_scale <= 0:
            raise argparse.ArgumentTypeError(
                f"phases must be SECONDS:SPEED[:TRACE[*OUTPUT_SCALE]],... with positive numbers, not {text!r}"
            )
        if phase.trace is not None and phase.trace not in TRACES:
            raise argparse.ArgumentTypeError(
                f"unknown trace {phase.trace!r} in phases (known: {', '.join(TRACES)})"
            )
        phases.append(phase)
    if not phases:
        raise argparse.ArgumentTypeError("no phases")
    return phases


def describe_phases(phases: list[Phase]) -> str:
    """'90 s at 1x, 180 s at 6x of azure (answers x3)'."""
    return ", ".join(
        f"{p.seconds:g} s at {p.speed:g}x"
        + (f" of {p.trace}" if p.trace else "")
        + (f" (answers x{p.output_scale:g})" if p.output_scale != 1 else "")
        for p in phases
    )


def _block(seed: int, length: int, vocabulary: int) -> list[int]:
    """`length` token ids determined by `seed` (a multiplicative hash, cheap and spread)."""
    return [1 + (seed * 2654435761 + k * 40503) % (vocabulary - 1) for k in range(length)]


def prompt_ids(
    request: Request, block_tokens: int = MOONCAKE_BLOCK_TOKENS, vocabulary: int = VOCABULARY
) -> list[int]:
    """Token ids whose blocks repeat exactly where the trace's block hashes do."""
    ids: list[int] = []
    for h in request.blocks:
        if len(ids) >= request.input_tokens:
            break
        ids += _block(h, min(block_tokens, request.input_tokens - len(ids)), vocabulary)
    if len(ids) < request.input_tokens:
        ids += _block(request.salt + (1 << 48), request.input_tokens - len(ids), vocabulary)
    return ids


def fit(requests: list[Request], engine: Engine, max_model_len: int | None) -> list[Request]:
    """The trace's requests scaled to an engine with a short context: prompt lengths
    divided (the block structure with them) and outputs capped, within the context."""
    if engine.length_divisor == 1 and engine.max_output is None:
        return requests
    out = []
    for r in requests:
        output = min(r.output_tokens, engine.max_output or r.output_tokens)
        room = (max_model_len or 1 << 30) - output
        out.append(
            Request(
                r.at_s, max(1, min(room, r.input_tokens // engine.length_divisor)), output, r.blocks, r.salt
            )
        )
    return out


def _generated_traces(
    names: dict[str | None, str], phases: list[Phase], start_s: float
) -> dict[str | None, Trace]:
    unknown = sorted(n for n in names.values() if n not in GENERATED)
    if unknown:
        raise TraceError(
            f"no generated stand-in for {', '.join(unknown)}: replay the real trace with --trace "
            f"or PDCLUSTER_TRACES (generated: {', '.join(GENERATED)})"
        )
    # Long enough for the slice: every phase's seconds at its speed, from the start.
    span = start_s + sum(p.seconds * p.speed for p in phases) + 60.0
    return {
        key: synthetic.generate(GENERATED[name], span, seed=k) for k, (key, name) in enumerate(names.items())
    }


def _real_traces(names: dict[str | None, str]) -> dict[str | None, Trace]:
    try:
        folder = perf.traces_dir()
    except FileNotFoundError:
        folder = None
    traces = {}
    for key, name in names.items():
        file = TRACES.get(name, name)
        path = Path(file) if "/" in file else (folder / file if folder else None)
        if path is None or not path.is_file():
            raise TraceError(
                f"trace {file!r} not found (set PDCLUSTER_TRACES to the folder of the public traces, "
                "give --trace a path, or leave both out for the generated workload)"
            )
        traces[key] = load_trace(path)
    return traces


def load_traces(trace: str | None, phases: list[Phase], start_s: float) -> dict[str | None, Trace]:
    """The traces the phases replay: generated ones unless a real trace is asked for (a
    --trace, or the traces folder in PDCLUSTER_TRACES). Raises TraceError, naming what is
    missing, before anything starts."""
    names = {None: trace or DEFAULT_TRACE} | {p.trace: p.trace for p in phases if p.trace}
    if trace is None and not os.environ.get("PDCLUSTER_TRACES"):
        return _generated_traces(names, phases, start_s)
    return _real_traces(names)


def build(
    engine: Engine, phases: list[Phase], trace: str | None, start_s: float, max_model_len: int | None
) -> list[Request]:
    """The requests of one replay, fitted to the engine's context."""
    return fit(workload(load_traces(trace, phases, start_s), start_s, phases), engine, max_model_len)


def source(trace: str | None) -> str:
    """Where the requests come from, in words."""
    if trace:
        return Path(trace).name
    if os.environ.get("PDCLUSTER_TRACES"):
        return f"{TRACES[DEFAULT_TRACE]} (PDCLUSTER_TRACES)"
    return "a generated conversation workload"
