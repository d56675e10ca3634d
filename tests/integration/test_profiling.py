"""`pdctl profile` against an engine simulator, and the ConfigMap it writes read back as
the control law's prior by the operator (a missing or bad one holds, saying why).

Measured latencies are not asserted (this machine's load would make them flake);
docs/benchmarks.md has the measured profile beside the simulator's own."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from loopback import engine_url, free_port, simulator

from pdcluster import perf, profiling
from pdcluster.cli import main as pdctl
from pdcluster.io.kube import Kube

SIM_PROFILE = perf.load("splitwise-llama2-70b-h100-80gb-tp4")


async def test_a_profile_is_measured_from_an_engine_and_reads_back() -> None:
    async with simulator("--sim-profile", SIM_PROFILE.name, "--max-model-len", "4096") as sim:
        measured = await profiling.measure(engine_url(sim), repeats=1, max_concurrency=4, max_prompt=1024)
    assert measured.name == "measured-sim-model"
    # The KV capacity is the engine's own report (vllm:cache_config_info), to the block.
    assert measured.max_kv_tokens == SIM_PROFILE.max_kv_tokens // 16 * 16
    assert all(x >= 0 for x in (*measured.prefill_coef, *measured.decode_coef))
    cm = profiling.config_map(measured, "llama-70b", "team-a")
    assert (cm["kind"], cm["metadata"]["name"], cm["metadata"]["namespace"]) == (
        "ConfigMap",
        "llama-70b",
        "team-a",
    )
    assert perf.from_json(cm["data"][perf.PROFILE_KEY]) == measured


def test_pdctl_profile_prints_a_configmap(capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    async def run() -> int:
        async with simulator("--max-model-len", "2048") as sim:
            url = engine_url(sim)
            return await asyncio.to_thread(
                pdctl, ["profile", "--url", url, "--name", "sim", "--repeats", "1", "--max-concurrency", "2"]
            )

    assert asyncio.run(run()) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert perf.from_json(doc["data"][perf.PROFILE_KEY]).max_kv_tokens > 0


def test_pdctl_profile_says_why_it_cannot_measure(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert pdctl(["profile", "--url", url, "--name", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdctl profile: {url}: ClientConnectorError") and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[]", "a JSON object is expected"),
        (
            '{"prefillCoefficientsMs": [1, 2], "decodeCoefficientsMs": [1, 1, 1], "maxKvTokens": 5}',
            "prefillCoefficientsMs must be three numbers",
        ),
        (
            '{"prefillCoefficientsMs": [1, -2, 0], "decodeCoefficientsMs": [1, 1, 1], "maxKvTokens": 5}',
            "prefillCoefficientsMs must be three numbers >= 0",
        ),
        (
            '{"prefillCoefficientsMs": [1, 0, 0], "decodeCoefficientsMs": [1, 1, 1], "maxKvTokens": 5}',
            "a prefill must take time per token",
        ),
        (
            '{"prefillCoefficientsMs": [1, 1, 0], "decodeCoefficientsMs": [1, 1, 1], "maxKvTokens": 0}',
            "maxKvTokens must be a whole number >= 1",
        ),
    ],
)
def test_a_bad_profile_is_rejected_saying_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        perf.from_json(text)


@pytest.mark.cluster
async def test_the_operator_reads_its_prior_from_the_configmap_the_spec_names(
    kube: Kube, namespace: str, operator: Any, pdc: Any, wait_until: Any, sim_cluster: Any
) -> None:
    autoscaling = {"enabled": True, "mode": "recommend", "intervalSeconds": 5, "windowSeconds": 15}
    await pdc.apply(sim_cluster("prior", autoscaling={**autoscaling, "profileConfigMap": "llama-profile"}))

    async def autoscaling_condition(reason: str, says: str = "") -> dict:
        async def seen() -> dict | None:
            cond = await pdc.condition("prior", "Autoscaling")
            return cond if cond and cond["reason"] == reason and says in cond["message"] else None

        return await wait_until(seen, timeout=60, interval=0.5, message=f"Autoscaling {reason} {says}")

    where = f"autoscaling.profileConfigMap {namespace}/llama-profile"
    cond = await autoscaling_condition("UnknownProfile", f"{where} not found; holding replicas")
    assert cond["status"] == "False"
    bad = profiling.config_map(SIM_PROFILE, "llama-profile", namespace)
    bad["data"][perf.PROFILE_KEY] = '{"prefillCoefficientsMs": [1, 2]}'
    await kube.apply(bad, field_manager="kubectl-test")
    await autoscaling_condition("UnknownProfile", f"{where}: prefillCoefficientsMs must be three numbers")
    good = profiling.config_map(SIM_PROFILE, "llama-profile", namespace)
    await kube.apply(good, field_manager="kubectl-test")
    cond = await autoscaling_condition("NoTraffic", "recommend: hold 1:1: no traffic")  # the law runs
    assert cond["status"] == "True", cond
