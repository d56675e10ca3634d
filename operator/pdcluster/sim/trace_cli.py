"""`pdctl trace`: rate curves and day-long request traces for `pdctl plan` (sim/longload.py).

    pdctl trace curve --servegen-rates servegen_rates_10min.csv --model m-large > day.csv
    pdctl trace curve --azure2024 azure2024_code_hourly_digitized.csv --start-h 72 --hours 24 > wd.csv
    pdctl trace generate --rate-curve wd.csv --trace AzureLLMInferenceTrace_code_2023.csv \\
        --rate-scale 0.05 -o weekday.jsonl
    pdctl trace generate --servegen DIR --model m-large --start-s 1036800 --hours 24 \\
        --rate-factor 0.1 -o day.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdcluster.sim import longload
from pdcluster.sim.trace import TraceError, load_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", required=True)
    curve = sub.add_parser("curve", help="print a rate curve (t_s,rate_rps) from a public long-horizon source")
    source = curve.add_mutually_exclusive_group(required=True)
    source.add_argument("--servegen-rates", help="ServeGen's servegen_rates_10min.csv (with --model)")
    source.add_argument("--azure2024", help="an Azure 2024 *_hourly_digitized.csv")
    source.add_argument("--rate-curve", help="a t_s,rate_rps CSV (to cut or scale it)")
    curve.add_argument("--model", default="m-large", help="ServeGen model (default m-large)")
    _add_window(curve)
    curve.add_argument("--scale", type=float, default=1.0, help="multiply every rate")
    curve.set_defaults(trace_func=_curve)

    gen = sub.add_parser("generate", help="write a Mooncake JSONL trace from a rate curve and a length source")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--rate-curve", help="t_s,rate_rps CSV; lengths and burstiness from --trace")
    source.add_argument("--servegen", help="the folder of ServeGen's files (client rates and length histograms)")
    gen.add_argument("--trace", help="with --rate-curve: the base trace (Mooncake JSONL or Azure CSV)")
    gen.add_argument("--rate-scale", type=float, default=1.0, help="with --rate-curve: multiply its rates")
    gen.add_argument("--model", default="m-large", help="with --servegen: the model (default m-large)")
    gen.add_argument("--rate-factor", type=float, default=1.0, help="with --servegen: multiply every client's rate")
    _add_window(gen)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("-o", "--output", required=True, help="the JSONL file to write, or - for stdout")
    gen.set_defaults(trace_func=_generate)


def _add_window(p: argparse.ArgumentParser) -> None:
    p.add_argument("--start-s", type=float, help="start of the window, seconds from the source's t = 0")
    p.add_argument("--start-h", type=float, help="the same in hours")
    p.add_argument("--hours", type=float, help="length of the window (default: to the end)")


def run(args: argparse.Namespace) -> int:
    try:
        return args.trace_func(args)
    except (TraceError, OSError) as e:
        print(f"pdctl trace: {e}", file=sys.stderr)
        return 1


def _window(args: argparse.Namespace, curve: longload.RateCurve) -> longload.RateCurve:
    start = args.start_s if args.start_s is not None else (args.start_h or 0.0) * 3600.0
    duration = args.hours * 3600.0 if args.hours else curve.end_s - start
    return curve.cut(start, duration) if (start, duration) != (curve.start_s[0], curve.span_s) else curve


def _positive(value: float, flag: str) -> float:
    if not value > 0:
        raise TraceError(f"{flag} must be > 0, not {value:g}")
    return value


def _curve(args: argparse.Namespace) -> int:
    if args.servegen_rates:
        curve = longload.servegen_curve(args.servegen_rates, args.model)
    elif args.azure2024:
        curve = longload.azure2024_curve(args.azure2024)
    else:
        curve = longload.read_rate_curve(args.rate_curve)
    longload.write_rate_curve(_window(args, curve).scaled(_positive(args.scale, "--scale")), sys.stdout)
    return 0


def _generate(args: argparse.Namespace) -> int:
    if args.rate_curve:
        if not args.trace:
            raise TraceError("--rate-curve needs --trace, the base trace whose lengths it keeps")
        curve = _window(args, longload.read_rate_curve(args.rate_curve))
        base = load_trace(args.trace, seed=args.seed)
        scale = _positive(args.rate_scale, "--rate-scale")
        trace = longload.curve_over_trace(base, curve.scaled(scale), seed=args.seed)
    else:
        folder = Path(args.servegen)
        clients = longload.read_servegen_clients(folder / "servegen_client_rate_traces.tar.xz", args.model)
        lengths = longload.servegen_lengths(folder / "servegen_length_hist_6h.csv", args.model)
        start = args.start_s if args.start_s is not None else (args.start_h or 0.0) * 3600.0
        span = clients.rate_rps.shape[1] * longload.SERVEGEN_WINDOW_S
        trace = longload.servegen_trace(
            clients,
            lengths,
            start_s=start,
            duration_s=args.hours * 3600.0 if args.hours else span - start,
            rate_factor=_positive(args.rate_factor, "--rate-factor"),
            seed=args.seed,
            name=f"servegen-{args.model}",
        )
    if args.output == "-":
        written = longload.write_mooncake(trace, sys.stdout)
    else:
        with open(args.output, "w") as out:
            written = longload.write_mooncake(trace, out)
    print(f"pdctl trace: {written} requests over {trace.span_s / 3600:.2f} h", file=sys.stderr)
    return 0
