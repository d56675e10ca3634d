"""The simulator takes `vllm serve`'s command line."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from pdcluster.enginesim.cli import parse
from pdcluster.enginesim.vllm_flags import VALUELESS, human_readable_int

FLAGS = Path(__file__).parents[1] / "fixtures" / "vllm-serve-flags.txt"


def vllm_flags() -> list[str]:
    lines = (line.strip() for line in FLAGS.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#") and line != "model_tag"]


def test_the_fixture_is_the_full_list() -> None:
    assert len(vllm_flags()) == 483


@pytest.mark.parametrize("flag", vllm_flags())
def test_every_vllm_flag_is_accepted_without_eating_the_next_one(flag: str) -> None:
    json_flags = ("--kv-transfer-config", "--kv-events-config")
    args = [flag] if flag in VALUELESS else [flag, "{}" if flag in json_flags else "1"]
    config = parse(["org/model", *args, "--port", "8123", "--served-model-name", "served"])
    assert config.model == "org/model"
    assert config.port == 8123
    assert config.served_model_names == ["served"]


def test_the_flags_the_operator_renders() -> None:
    kv = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "engine_id": "pinned"}
    config = parse(
        [
            "meta-llama/Llama-3.1-8B-Instruct",
            "--host", "0.0.0.0", "--port", "8000",
            "--served-model-name", "llama", "llama-alias",
            "-tp", "2", "--pipeline-parallel-size", "1", "--data-parallel-size", "2",
            "--max-model-len", "32k",
            "--kv-transfer-config", json.dumps(kv),
            "--gpu-memory-utilization", "0.9", "--enable-prefix-caching", "--no-enable-log-requests",
            "--max-num-batched-tokens", "16K",
            "--sim-profile", "zero", "--sim-time-scale", "10", "--sim-kv-gbps", "100",
        ]
    )  # fmt: skip
    assert config.host == "0.0.0.0" and config.port == 8000
    assert config.served_model_names == ["llama", "llama-alias"] and config.model_name == "llama"
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.data_parallel_size) == (
        2,
        1,
        2,
    )
    assert config.max_model_len == 32000
    assert config.max_num_batched_tokens == 16384
    assert config.role == "prefill" and config.serves_bootstrap
    assert config.engine_ids == ["pinned_dp0", "pinned_dp1"]
    assert (config.profile, config.time_scale, config.kv_gbps) == ("zero", 10.0, 100.0)


@pytest.mark.parametrize(
    ("kv_config", "role", "bootstrap"),
    [
        (None, "both", False),
        ({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}, "decode", False),
        ({"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}, "both", True),
        (
            {
                "kv_connector": "MooncakeConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"bootstrap_server_address": "h:1"},
            },
            "prefill",
            False,
        ),
    ],
)
def test_role_from_kv_role(kv_config: dict | None, role: str, bootstrap: bool) -> None:
    argv = ["m"] + (["--kv-transfer-config", json.dumps(kv_config)] if kv_config else [])
    config = parse(argv)
    assert config.role == role
    assert config.serves_bootstrap is bootstrap


def test_dotted_kv_transfer_config_and_underscores() -> None:
    config = parse(
        ["m", "--kv-transfer-config.kv_connector", "MooncakeConnector", "--kv_transfer_config.kv_role=kv_consumer",
         "--max_model_len", "auto", "--kv-transfer-config.kv_load_failure_policy", "recompute"]
    )  # fmt: skip
    assert config.role == "decode"
    assert config.recompute_on_load_failure
    assert config.max_model_len == 131072


def test_random_engine_id_per_start() -> None:
    config = parse(
        ["m", "--kv-transfer-config", '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}']
    )
    assert config.engine_ids != config.engine_ids  # a fresh uuid on every call, like vLLM's default


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "9100")
    monkeypatch.setenv("VLLM_HOST_IP", "127.1.0.9")
    monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "12")
    config = parse(["m"])
    assert (config.bootstrap_port, config.host_ip, config.abort_timeout_s) == (9100, "127.1.0.9", 12.0)


def test_force_include_usage_and_negative_values() -> None:
    assert parse(["m", "--enable-force-include-usage"]).force_include_usage
    assert not parse(
        ["m", "--enable-force-include-usage", "--disable-force-include-usage"]
    ).force_include_usage
    assert parse(["m", "--seed", "-1"]).seed == -1


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no model
        ["m", "--sim-profiel", "zero"],  # a typo in our own flags is an error
        ["m", "--kv-transfer-config", '{"kv_connector":"MooncakeConnector"}'],  # kv_role is required
        ["m", "--sim-time-scale", "0"],
    ],
)
def test_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(argv)


@pytest.mark.parametrize(
    ("text", "value"), [("8192", 8192), ("8k", 8000), ("8K", 8192), ("1.5m", 1500000), ("2M", 2097152)]
)
def test_human_readable_int(text: str, value: int) -> None:
    assert human_readable_int(text) == value


@pytest.mark.parametrize(
    "script", ["pdcluster.main", "pdcluster.router.main", "pdcluster.enginesim.main", "pdcluster.cli"]
)
def test_every_console_script_answers_help(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(script).main(["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_multi_node_flags_as_the_operator_renders_them_for_a_group() -> None:
    group = ["m", "-tp", "16", "--distributed-executor-backend", "mp", "--nnodes", "2"]
    worker = parse([*group, "--node-rank", "1", "--master-addr", "g-0.g.ns", "--headless"])
    assert (worker.nnodes, worker.node_rank, worker.master_addr, worker.master_port) == (
        2,
        1,
        "g-0.g.ns",
        29501,
    )
    assert worker.headless
    leader = parse(["m", "-tp", "16", "-n", "2", "-r", "0", "--master-port", "30000"])
    assert (leader.nnodes, leader.node_rank, leader.master_port, leader.headless) == (2, 0, 30000, False)
