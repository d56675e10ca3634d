"""Free ports for the local cluster's own listeners (etcd, apiserver, pod runner, ...).

A port that bind(0) hands out comes from the kernel's ephemeral range, the same range
every outgoing connection takes its source port from. The cluster starts its processes
one after another over several seconds, and in that time a client connection can take
the port a later component is about to listen on ("address already in use"). Ports just
below the ephemeral range are never handed to connections, so only a listener of
another program can take them.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_handed_out: set[int] = set()  # free until bound: not twice to the same cluster


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    top = _ephemeral_start()
    candidates = range(max(1024, top - 12000), top)
    for port in random.sample(candidates, min(200, len(candidates))):
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # a crowded range: let the kernel pick
        s.bind((host, 0))
        return s.getsockname()[1]
