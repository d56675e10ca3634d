"""The local cluster's listener ports stay out of the range outgoing connections take
their source ports from (e2e/local/localcluster/ports.py)."""

from __future__ import annotations

import socket

from localcluster import ports


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    start = ports._ephemeral_start()
    given = [ports.free_port() for _ in range(20)]
    assert len(set(given)) == len(given)
    for port in given:
        assert 1024 <= port < start
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_or_already_handed_out_is_skipped(monkeypatch):
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("127.0.0.1", 0))
        probe.bind(("127.0.0.1", 0))
        taken, free = held.getsockname()[1], probe.getsockname()[1]
        probe.close()
        monkeypatch.setattr(ports, "_handed_out", {12345})
        monkeypatch.setattr(ports.random, "sample", lambda population, k: [taken, 12345, free])
        assert ports.free_port() == free
        assert free in ports._handed_out


def test_a_crowded_range_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(ports, "_bindable", lambda host, port: False)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
