"""The command line the operator renders for the router."""

from __future__ import annotations

import pytest

from pdcluster.router.flags import parser
from pdcluster.router.main import main


def test_the_flags_the_operator_renders() -> None:
    args = parser().parse_args(
        ["--host", "0.0.0.0", "--port", "8000", "--kube", "--namespace", "ns", "--cluster", "c1",
         "--model", "llama", "--policy", "prefix-aware", "--admission-ttft-ms", "500",
         "--admission-reject-factor", "2.0", "--no-admission", "--request-timeout", "600",
         "--api-key-file", "/etc/pdcluster/key", "--drain-timeout", "30", "--head-timeout=30",
         "--body-timeout=60", "--max-connections=4096"]
    )  # fmt: skip
    assert (args.host, args.port, args.kube, args.namespace, args.cluster) == (
        "0.0.0.0",
        8000,
        True,
        "ns",
        "c1",
    )
    assert (args.model, args.policy, args.no_admission) == ("llama", "prefix-aware", True)
    assert (args.admission_ttft_ms, args.admission_reject_factor) == (500.0, 2.0)
    assert (args.request_timeout, args.drain_timeout, args.discovery) == (600.0, 30.0, "endpointslices")
    assert str(args.api_key_file) == "/etc/pdcluster/key"
    assert (args.head_timeout, args.body_timeout, args.max_connections) == (30.0, 60.0, 4096)


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no backends at all
        ["--kube"],  # which cluster?
        ["--prefill", "http://127.0.0.1:1"],  # no decode
        ["--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2"],  # not a URL
        ["--policy", "random", "--kube", "--cluster", "c"],
        ["--kube", "--cluster", "c", "--head-timeout", "0"],
        ["--kube", "--cluster", "c", "--max-connections", "0"],
    ],
)
def test_bad_command_lines_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
