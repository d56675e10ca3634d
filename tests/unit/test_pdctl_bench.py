"""`pdctl bench`: the AIPerf Job it renders for a PDCluster (the apiserver's verdict on it
is tests/e2e/test_bench_job.py), and the clear errors of bad options and bad traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdcluster import bench
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.cli import main
from pdcluster.render import Owner

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "examples" / "pdcluster-sim.yaml"
OWNER = Owner("demo", "serving", "")
TRACE = "\n".join(
    json.dumps({"timestamp": 100 * k, "input_length": 600, "output_length": 20, "hash_ids": [k]})
    for k in range(3)
)


def spec(**changes) -> PDClusterSpec:
    raw = yaml.safe_load(SIM.read_text())["spec"]
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return PDClusterSpec.model_validate(raw)


def flags(args: list[str]) -> dict[str, str | None]:
    """--flag value pairs (a flag without a value maps to None)."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            following = args[i + 1] if i + 1 < len(args) else "--"
            out[arg] = None if following.startswith("--") else following
    return out


def container(objs: list[dict]) -> dict:
    job = next(o for o in objs if o["kind"] == "Job")
    return job["spec"]["template"]["spec"]["containers"][0]


def test_a_synthetic_mix_against_the_routers_service_with_the_slos_goodput() -> None:
    objs = bench.render(spec(), OWNER, bench.BenchOptions(requests=50, rate=2.5, tokenizer="builtin"))
    c = container(objs)
    got = flags(c["args"])
    assert c["args"][0] == "profile" and [o["kind"] for o in objs] == ["Job"]
    assert got["--url"] == "http://demo-router.serving.svc:8000" and got["--model"] == "llama-3.1-8b"
    assert (got["--endpoint-type"], got["--tokenizer"], got["--request-count"]) == (
        "completions",
        "builtin",
        "50",
    )
    assert got["--request-rate"] == "2.5" and "--concurrency" not in got and "--streaming" in got
    # ttftIncludesPrefill is false in this example: a client sees only the whole TTFT.
    assert got["--goodput"] == "inter_token_latency:25"
    assert got["--artifact-dir"] == bench.RESULTS_DIR and got["--extra-inputs"] == "ignore_eos:true"
    assert f"aiperf=={bench.AIPERF_VERSION}" in c["command"][2] and "sleep 600" in c["command"][2]


def test_the_ttft_target_counts_in_goodput_when_it_bounds_the_whole_ttft() -> None:
    objs = bench.render(spec(**{"autoscaling.ttftIncludesPrefill": True}), OWNER, bench.BenchOptions())
    got = flags(container(objs)["args"])
    assert got["--goodput"] == "time_to_first_token:1000 inter_token_latency:25"
    assert got["--concurrency"] == "4" and got["--tokenizer"] == spec().model.name


def test_secrets_reach_the_client_by_reference() -> None:
    keyed = spec(
        **{
            "router.apiKeySecret": {"name": "router-key", "key": "token"},
            "engine.hfTokenSecret": {"name": "hf", "key": "t"},
        }
    )
    c = container(bench.render(keyed, OWNER, bench.BenchOptions()))
    env = {e["name"]: e for e in c["env"]}
    assert env["ROUTER_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "router-key", "key": "token"}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "t"}
    assert flags(c["args"])["--api-key"] == "$(ROUTER_API_KEY)"


def test_a_trace_goes_in_a_configmap_and_replaces_the_synthetic_mix() -> None:
    objs = bench.render(spec(), OWNER, bench.BenchOptions(name="replay"), TRACE)
    cm, c = objs[0], container(objs)
    assert (cm["kind"], cm["metadata"]["name"], cm["data"][bench.TRACE_KEY]) == (
        "ConfigMap",
        "replay-trace",
        TRACE,
    )
    got = flags(c["args"])
    assert got["--custom-dataset-type"] == "mooncake_trace" and got["--input-file"] == "/trace/trace.jsonl"
    assert "--request-count" not in got and "--synthetic-input-tokens-mean" not in got
    assert {"name": "trace", "mountPath": "/trace", "readOnly": True} in c["volumeMounts"]


def test_a_tokenizer_is_read_offline_from_a_cache_on_its_claim() -> None:
    opts = bench.BenchOptions(tokenizer="meta-llama/Llama-3.1-8B-Instruct", tokenizer_claim="model-cache")
    objs = bench.render(spec(), OWNER, opts, TRACE)
    pod = objs[-1]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert {
        "name": "tokenizer",
        "persistentVolumeClaim": {"claimName": "model-cache", "readOnly": True},
    } in pod["volumes"]
    assert {"name": "tokenizer", "mountPath": "/hf-cache", "readOnly": True} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert (env["HF_HOME"], env["HF_HUB_OFFLINE"]) == ("/hf-cache", "1")
    assert flags(c["args"])["--tokenizer"] == "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize(
    ("opts", "trace", "message"),
    [
        (bench.BenchOptions(rate=1.0, concurrency=2), None, "not both"),
        (bench.BenchOptions(requests=0), None, "--requests must be at least 1"),
        (bench.BenchOptions(rate=-1.0), None, "must be positive"),
        (
            bench.BenchOptions(tokenizer="/models/x", tokenizer_claim="cache"),
            None,
            "the hub id in that cache",
        ),
        (bench.BenchOptions(tokenizer="/models/x"), '{"input_length": 5, "output_length": 2}', "as a hub id"),
        (bench.BenchOptions(), '{"timestamp": 0, "input_length": 5}', "trace line 1: no output_length"),
        (bench.BenchOptions(), '{"input_length": 5, "output_length": 2}\nnot json', "trace line 2: not JSON"),
        (bench.BenchOptions(), "\n\n", "no requests"),
        (bench.BenchOptions(), "x" * (bench.TRACE_LIMIT_BYTES + 1), "too large for a ConfigMap"),
    ],
)
def test_bad_options_and_traces_say_what_to_fix(opts, trace, message) -> None:
    with pytest.raises(bench.BenchError, match=message):
        bench.render(spec(), OWNER, opts, trace)


def test_pdctl_bench_prints_the_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(TRACE)
    assert (
        main(["bench", "-f", str(SIM), "-n", "serving", "--trace", str(trace), "--tokenizer", "builtin"]) == 0
    )
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Job"]
    assert docs[1]["metadata"] == {
        "name": "demo-bench",
        "namespace": "serving",
        "labels": docs[1]["metadata"]["labels"],
    }
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 1}')
    with pytest.raises(SystemExit, match="pdctl bench: trace line 1: no output_length"):
        main(["bench", "-f", str(SIM), "--trace", str(bad)])
    with pytest.raises(SystemExit, match=r"(?i)no such file"):
        main(["bench", "-f", str(SIM), "--trace", str(tmp_path / "missing.jsonl")])


def test_the_shipped_example_is_what_pdctl_bench_renders(capsys: pytest.CaptureFixture[str]) -> None:
    example = ROOT / "examples" / "bench" / "aiperf-job.yaml"
    command = next(
        line for line in example.read_text().splitlines() if line.startswith("# Rendered by: pdctl ")
    )
    args = command.removeprefix("# Rendered by: pdctl ").split()
    assert main([a if not a.startswith("examples/") else str(ROOT / a) for a in args]) == 0
    assert list(yaml.safe_load_all(capsys.readouterr().out)) == list(yaml.safe_load_all(example.read_text()))
