"""Day-long traces (sim/longload.py, `pdctl trace`): rate curves, length histograms, ServeGen
arrivals and a curve over a base trace, checked against their sources."""

from __future__ import annotations

import io

import numpy as np
import pytest

from pdcluster import cli, perf
from pdcluster.sim import longload
from pdcluster.sim.trace import Trace, TraceError, load_trace


def _servegen_dir():
    try:
        folder = perf.traces_dir() / "servegen"
    except FileNotFoundError:
        folder = None
    if folder is None or not folder.is_dir():
        pytest.skip("the ServeGen files (../shared/traces/servegen) are not here")
    return folder


def test_rate_curve_reads_windows_and_rejects_bad_rows(tmp_path):
    good = tmp_path / "curve.csv"
    good.write_text("t_s,rate_rps\n0,2\n3600,4\n7200,1\n")
    curve = longload.read_rate_curve(good)
    assert curve.end_s == 10800
    assert curve.expected_requests() == 3600 * (2 + 4 + 1)
    assert curve.rates_at(np.array([-1.0, 0.0, 3599.0, 3600.0, 10799.0, 10800.0])).tolist() == [0, 2, 2, 4, 1, 0]
    cut = curve.cut(1800, 3600)
    assert (cut.start_s, cut.rate_rps, cut.end_s) == ((0.0, 1800.0), (2.0, 4.0), 3600.0)

    for text, where in (
        ("time,rate\n0,1\n1,1\n", ":1:"),
        ("t_s,rate_rps\n0,1\nx,1\n", ":3:"),
        ("t_s,rate_rps\n0,1\n", "two rows"),
        ("t_s,rate_rps\n0,1\n0,2\n", "increase"),
        ("t_s,rate_rps\n0,-1\n5,2\n", ">= 0"),
    ):
        bad = tmp_path / "bad.csv"
        bad.write_text(text)
        with pytest.raises(TraceError, match=where):
            longload.read_rate_curve(bad)


def test_histogram_draws_each_bin_by_its_weight():
    hist = longload.LengthHistogram((1, 2, 4, 8, 16), (0.1, 0.0, 0.6, 0.3))
    drawn = hist.sample(np.random.default_rng(3), 50_000)
    assert drawn.min() >= 1 and drawn.max() < 16
    share = np.bincount(hist.bin_of(drawn), minlength=4) / len(drawn)
    assert share[1] == 0
    assert np.abs(share - np.array([0.1, 0.0, 0.6, 0.3])).max() < 0.01


def _clients(rate, weibull, shape, scale):
    as_array = [np.array(v, dtype=float) for v in (rate, weibull, shape, scale)]
    return longload.ClientRates(as_array[0], as_array[1].astype(bool), as_array[2], as_array[3])


def test_servegen_arrivals_keep_each_clients_rate_and_burstiness():
    # Two clients over four windows: a Poisson one (Gamma shape 1) and a bursty one
    # (Gamma shape 0.25: gaps with a CV of 2), silent in the third window.
    clients = _clients(
        rate=[[2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 0.0, 1.0]],
        weibull=[[0] * 4, [0] * 4],
        shape=[[1.0] * 4, [0.25] * 4],
        scale=[[1.0] * 4, [8.0] * 4],
    )
    hist = longload.LengthHistogram((1, 2), (1.0,))
    lengths = [longload.WindowLengths(0.0, hist, hist)]
    trace = longload.servegen_trace(clients, lengths, start_s=0, duration_s=2400, rate_factor=5.0, seed=7)
    t = np.asarray(trace.arrival_s)
    per_window = np.bincount((t // 600).astype(int), minlength=4)
    expected = np.array([3, 3, 2, 3]) * 5.0 * 600
    assert np.abs(per_window / expected - 1).max() < 0.1
    assert trace.input_tokens == [1] * len(trace)

    bursty = _clients(rate=[[1.0] * 40], weibull=[[0] * 40], shape=[[0.25] * 40], scale=[[8.0] * 40])
    gaps = np.diff(longload.servegen_trace(bursty, lengths, start_s=0, duration_s=24000, rate_factor=1.0).arrival_s)
    assert abs(gaps.std() / gaps.mean() - 2.0) < 0.2


def test_servegen_day_follows_the_sources_rates_and_length_histograms():
    folder = _servegen_dir()
    clients = longload.read_servegen_clients(folder / "servegen_client_rate_traces.tar.xz", "m-large")
    lengths = longload.servegen_lengths(folder / "servegen_length_hist_6h.csv", "m-large")
    curve = longload.servegen_curve(folder / "servegen_rates_10min.csv", "m-large")
    # The client files add up to the summed rate file.
    assert np.allclose(clients.total_rps, curve.rate_rps, atol=1e-3)

    start, factor = 1_036_800, 0.02
    trace = longload.servegen_trace(
        clients, lengths, start_s=start, duration_s=86_400, rate_factor=factor, seed=1
    )
    t = np.asarray(trace.arrival_s)
    day = curve.cut(start, 86_400).scaled(factor)
    assert abs(len(trace) / day.expected_requests() - 1) < 0.03
    hourly = np.bincount((t // 3600).astype(int), minlength=24)
    hourly_expected = np.array([day.rates_at(h * 3600 + np.arange(0, 3600, 600)).sum() * 600 for h in range(24)])
    assert np.abs(hourly / hourly_expected - 1).max() < 0.15

    inputs, outputs = np.asarray(trace.input_tokens), np.asarray(trace.output_tokens)
    for quarter in range(4):
        at = (t // 21_600) == quarter
        window = longload._lengths_at(lengths, start + quarter * 21_600)
        for drawn, hist in ((inputs[at], window.input), (outputs[at], window.output)):
            share = np.bincount(hist.bin_of(drawn), minlength=len(hist.weights)) / at.sum()
            weights = np.asarray(hist.weights) / sum(hist.weights)
            assert 0.5 * np.abs(share - weights).sum() < 0.02  # total variation distance


def _base(n=1000, span=100.0):
    rng = np.random.default_rng(0)
    arrival = np.sort(rng.uniform(0, span, n)).tolist()
    return Trace("base", arrival, list(range(1, n + 1)), [7] * n, [(i,) for i in range(n)])


def test_curve_over_trace_follows_the_curve_and_keeps_the_base_lengths():
    base = _base()  # 10 requests/s over 100 s
    curve = longload.RateCurve((0.0, 150.0), (5.0, 20.0), 300.0)
    trace = longload.curve_over_trace(base, curve, seed=2)
    t = np.asarray(trace.arrival_s)
    assert t.min() >= 0 and t.max() < 300
    first, second = (t < 150).sum(), (t >= 150).sum()
    assert abs(first / 750 - 1) < 0.1 and abs(second / 3000 - 1) < 0.1
    assert set(trace.input_tokens) <= set(base.input_tokens)
    # A copy is another user: its prefix blocks are its own.
    assert len(set(trace.blocks)) == len(trace)


def test_a_generated_trace_reads_back_as_it_was_written(tmp_path):
    trace = longload.curve_over_trace(_base(), longload.RateCurve((0.0,), (3.0,), 200.0), seed=1)
    path = tmp_path / "day.jsonl"
    with path.open("w") as out:
        assert longload.write_mooncake(trace, out) == len(trace)
    back = load_trace(path)
    assert len(back) == len(trace)
    assert back.input_tokens == trace.input_tokens and back.blocks == trace.blocks
    start = trace.arrival_s[0]
    assert np.abs(np.asarray(back.arrival_s) - (np.asarray(trace.arrival_s) - start)).max() <= 0.0005


def test_pdctl_trace_commands(tmp_path, capsys):
    base = tmp_path / "base.jsonl"
    with base.open("w") as out:
        longload.write_mooncake(_base(), out)
    curve = tmp_path / "curve.csv"
    curve.write_text("t_s,rate_rps\n0,2\n100,8\n")
    out = tmp_path / "out.jsonl"
    assert cli.main(["trace", "generate", "--rate-curve", str(curve), "--trace", str(base), "-o", str(out)]) == 0
    generated = load_trace(out)
    assert abs(len(generated) / 1000 - 1) < 0.15  # 2/s and 8/s for 100 s each

    assert cli.main(["trace", "curve", "--rate-curve", str(curve), "--scale", "0.5", "--start-s", "50"]) == 0
    assert capsys.readouterr().out == "t_s,rate_rps\n0,1\n50,4\n"

    assert cli.main(["trace", "generate", "--rate-curve", str(curve), "-o", str(out)]) == 1
    assert "needs --trace" in capsys.readouterr().err
    assert cli.main(["trace", "curve", "--rate-curve", str(tmp_path / "missing.csv")]) == 1
    assert "missing.csv" in capsys.readouterr().err


def test_write_rate_curve_round_trips(tmp_path):
    curve = longload.RateCurve((0.0, 600.0, 1200.0), (1.5, 0.0, 2.25), 1800.0)
    text = io.StringIO()
    longload.write_rate_curve(curve, text)
    path = tmp_path / "c.csv"
    path.write_text(text.getvalue())
    assert longload.read_rate_curve(path) == curve
