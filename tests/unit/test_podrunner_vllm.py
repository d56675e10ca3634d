"""The pod runner's adaptation of vLLM pods to the real-vLLM runtime on CPU
(localcluster/podrunner/vllm.py): what changes in the command and the environment, and
what the pod keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from localcluster.podrunner import vllm

RUNTIME = Path("/cache/vllm/runtime-x")


@pytest.fixture(autouse=True)
def runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "runtime", lambda: RUNTIME)


def test_vllm_serve_becomes_the_api_server_on_the_tiny_model() -> None:
    rendered = [
        "vllm",
        "serve",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--port",
        "8000",
        "--served-model-name",
        "llama",
        "--kv-transfer-config",
        '{"kv_role":"kv_producer"}',
    ]
    assert vllm.command(rendered) == [
        str(RUNTIME / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(RUNTIME / "model"),
        "--port",
        "8000",
        "--served-model-name",
        "llama",
        "--kv-transfer-config",
        '{"kv_role":"kv_producer"}',
        "--enforce-eager",
    ]


@pytest.mark.parametrize("model_args", [["--model", "org/m"], ["--model=org/m"]])
def test_a_model_flag_is_replaced_too(model_args: list[str]) -> None:
    argv = vllm.command(["vllm", "serve", *model_args, "--port", "8000"])
    assert argv.count("--model") == 1 and argv[argv.index("--model") + 1] == str(RUNTIME / "model")
    assert "org/m" not in " ".join(argv)


def test_other_commands_of_the_image_run_as_rendered() -> None:
    master = ["mooncake_master", "--rpc_port=50051"]
    assert vllm.command(master) == master


def test_environment_pod_values_win_but_nothing_goes_online() -> None:
    env = vllm.environment(
        {"PATH": "/venv/bin:/usr/bin", "VLLM_HOST_IP": "127.1.0.9", "HF_HUB_OFFLINE": "0"},
        pod_ip="127.1.0.5",
        cache_dir=Path("/pods/p/vllm-cache"),
    )
    assert env["VLLM_HOST_IP"] == "127.1.0.9"  # the manifest's $(POD_IP), kept
    assert env["VLLM_DP_MASTER_IP"] == "127.1.0.5"  # where the bootstrap server listens here
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["PATH"].split(":")[:2] == [str(RUNTIME / "bin"), "/venv/bin"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == vllm.KV_CACHE_GIB
    assert env["VLLM_CACHE_ROOT"] == "/pods/p/vllm-cache"


def test_engines_are_not_bound_to_cores_unless_the_pod_says_so() -> None:
    env = vllm.environment({}, pod_ip="p", cache_dir=Path("c"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "1"
    pinned = vllm.environment({"VLLM_CPU_OMP_THREADS_BIND": "0"}, pod_ip="p", cache_dir=Path("c"))
    assert pinned["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_a_mounted_model_directory_is_served_as_rendered() -> None:
    argv = vllm.command(["vllm", "serve", "/models/org/m/main", "--port", "8000"])
    assert argv[argv.index("--model") + 1] == "/models/org/m/main"


def test_only_the_engine_is_kept_offline() -> None:
    download = vllm.environment({"HF_ENDPOINT": "http://127.0.0.1:1"}, pod_ip="p", cache_dir=Path("c"), serves=False)
    assert "HF_HUB_OFFLINE" not in download and download["HF_ENDPOINT"] == "http://127.0.0.1:1"
    assert download["PATH"].startswith(str(RUNTIME / "bin"))
