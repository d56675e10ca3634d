"""Command line of the engine simulator: `vllm serve`'s, plus `--sim-*` flags.

The operator renders one command line for real vLLM and for the simulator, so every
flag `vllm serve` 0.33 accepts is accepted here. The few that shape an engine's
behaviour are honoured; the rest are skipped (vllm_flags.VALUELESS says which take no
value; any other flag takes the words after it up to the next flag). Like vLLM's
parser, underscores may stand for dashes and `--kv-transfer-config.key value` sets one
key of the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

from pdcluster.constants import BOOTSTRAP_PORT
from pdcluster.enginesim.vllm_flags import OPTIONAL_VALUE, VALUELESS, human_readable_int
from pdcluster.vllm import defaults
from pdcluster.vllm import kvtransfer as kvt

ROLE_FOR_KV_ROLE = {kvt.KV_PRODUCER: "prefill", kvt.KV_CONSUMER: "decode", kvt.KV_BOTH: "both"}
DEFAULT_MAX_MODEL_LEN = 131072  # Llama 3.1's context; the simulator has no model config
SIM_ABORT_TIMEOUT_S = 30.0  # vLLM's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT default is 480


@dataclass
class SimConfig:
    model: str
    served_model_names: list[str]
    host: str | None
    port: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_transfer_config: dict[str, Any] | None
    api_key: str | None
    force_include_usage: bool
    block_size: int
    # from the environment, as vLLM reads them
    bootstrap_port: int
    host_ip: str
    abort_timeout_s: float
    hash_seed: str | None  # PYTHONHASHSEED: the first block hash's seed
    store_config: dict[str, Any] | None  # MOONCAKE_CONFIG_PATH's JSON, with a store connector
    prefix_caching: bool  # off unless asked (prefix.py)
    prompt_tokens_details: bool  # usage.prompt_tokens_details.cached_tokens, as vLLM's flag
    per_request_metrics: bool  # an answer's `metrics` (its own timing), as vLLM's flag
    num_gpu_blocks: int | None  # --num-gpu-blocks-override: the KV cache's size, else the profile's
    kv_events_config: dict[str, Any] | None  # --kv-events-config, when it enables ZMQ events
    # --sim-*
    profile: str
    time_scale: float
    kv_gbps: float
    seed: int
    mooncake_master: str | None
    output_mean: int
    record: int
    stamp_tokens: bool
    faults: bool = False
    # one engine across nodes (vLLM's multi-node mode; nodes.py)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    headless: bool = False

    @property
    def role(self) -> str:
        kv_role = (self.kv_transfer_config or {}).get(kvt.ROLE_KEY)
        return ROLE_FOR_KV_ROLE.get(kv_role, "both") if kv_role else "both"

    @property
    def store_role(self) -> str | None:
        """kv_role of a MooncakeStoreConnector, alone or in a MultiConnector; None without one."""
        return store_role(self.kv_transfer_config)

    @property
    def has_connector(self) -> bool:
        return bool(self.kv_transfer_config and self.kv_transfer_config.get(kvt.CONNECTOR_KEY))

    @property
    def serves_bootstrap(self) -> bool:
        """Only non-consumer workers start the bootstrap server, and not when an
        external one is configured (mooncake_connector.py should_launch_bootstrap_server)."""
        if not self.has_connector or self.role == "decode":
            return False
        extra = (self.kv_transfer_config or {}).get(kvt.EXTRA_KEY) or {}
        return not extra.get("bootstrap_server_address")

    @property
    def engine_ids(self) -> list[str]:
        """One per DP rank; vLLM suffixes `_dp<rank>` when data_parallel_size > 1
        (v1/engine/core.py) and draws a random uuid unless engine_id is pinned."""
        base = (self.kv_transfer_config or {}).get("engine_id") or str(uuid.uuid4())
        if self.data_parallel_size == 1:
            return [base]
        return [f"{base}_dp{rank}" for rank in range(self.data_parallel_size)]

    @property
    def recompute_on_load_failure(self) -> bool:
        return (self.kv_transfer_config or {}).get("kv_load_failure_policy", "fail") == "recompute"

    @property
    def model_name(self) -> str:
        """The name in metrics: the first served name (vLLM get_served_model_name)."""
        return self.served_model_names[0]


def store_role(kv_config: dict[str, Any] | None) -> str | None:
    config = kv_config or {}
    children = [config]
    if config.get(kvt.CONNECTOR_KEY) == kvt.MULTI_CONNECTOR:
        children = (config.get(kvt.EXTRA_KEY) or {}).get(kvt.CHILDREN_KEY) or []
    for child in children:
        if isinstance(child, dict) and child.get(kvt.CONNECTOR_KEY) == kvt.STORE_CONNECTOR:
            return str(child.get(kvt.ROLE_KEY) or config.get(kvt.ROLE_KEY) or kvt.KV_BOTH)
    return None


def _store_config(kv_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """What vLLM's MooncakeStoreConfig.load_from_config reads, with its errors."""
    if store_role(kv_config) is None:
        return None
    path = os.environ.get("MOONCAKE_CONFIG_PATH")
    if not path:
        raise SystemExit("The environment variable 'MOONCAKE_CONFIG_PATH' is not set.")
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict) or not config.get("master_server_address"):
        raise SystemExit(f"{path}: master_server_address is required")
    return config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdcluster-engine-sim serve",
        description="A vLLM-compatible engine simulator. Accepts every `vllm serve` flag; "
        "the ones below change its behaviour.",
    )
    _add_engine_arguments(parser)
    _add_multi_node_arguments(parser)
    _add_simulator_arguments(parser.add_argument_group("simulator"))
    return parser


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The `vllm serve` flags the simulator honours, with vLLM's defaults."""
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--host")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--max-model-len", default=None)
    p.add_argument("--max-num-seqs", type=int, default=defaults.MAX_NUM_SEQS)
    p.add_argument(
        "--max-num-batched-tokens", type=human_readable_int, default=defaults.MAX_NUM_BATCHED_TOKENS
    )
    p.add_argument("--kv-transfer-config", type=json.loads)
    p.add_argument("--kv-events-config", type=json.loads)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument("--enable-per-request-metrics", action="store_true")
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--api-key")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)  # vLLM's default on CUDA


def _add_multi_node_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's multi-node mode (vllm/config/parallel.py defaults; --headless: workers only)."""
    p.add_argument("--nnodes", "-n", type=int, default=1)
    p.add_argument("--node-rank", "-r", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true")


def _add_simulator_arguments(sim: argparse._ArgumentGroup) -> None:
    sim.add_argument(
        "--sim-profile", default="h200-llama3.1-8b", help="pdcluster.perf profile, or `zero` (no latency)"
    )
    sim.add_argument(
        "--sim-time-scale", type=float, default=1.0, help="run this many times faster than real time"
    )
    sim.add_argument(
        "--sim-kv-gbps", type=float, default=400.0, help="prefill->decode link, Gbit/s, for KV transfer time"
    )
    sim.add_argument("--sim-seed", type=int, help="seed of the generated text and lengths (default: --seed)")
    sim.add_argument("--sim-mooncake-master", help="host:port of a Mooncake master to pass KV bytes through")
    sim.add_argument(
        "--sim-output-mean",
        type=int,
        default=256,
        help="mean length at which a request without ignore_eos ends on EOS (0: never)",
    )
    sim.add_argument(
        "--sim-record",
        type=int,
        default=0,
        help="keep the last N generate requests for GET /sim/requests (tests)",
    )
    sim.add_argument(
        "--sim-stamp-tokens",
        action="store_true",
        help="add sim_sent_at (CLOCK_MONOTONIC seconds) to streamed token chunks, to measure relay latency",
    )
    sim.add_argument(
        "--sim-faults",
        action="store_true",
        help='serve POST /sim/faults {"kv_send": "fail" | "ok"}: a prefill whose KV hand-offs fail (tests)',
    )


_ENABLE_USAGE = {
    "--enable-force-include-usage": True,
    "--disable-force-include-usage": False,
    "--no-enable-force-include-usage": False,
}


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)  # a negative number is a value
    except ValueError:
        return True
    return False


def _normalise(token: str) -> str:
    """Dashes for underscores between `--` and the first `.`, as vLLM's parser does."""
    name, eq, value = token.partition("=")
    if name.startswith("--"):
        flag, dot, key = name[2:].partition(".")
        name = "--" + flag.replace("_", "-") + dot + key
    return name + eq + value


def split_args(argv: list[str], own: set[str]) -> tuple[list[str], dict[str, str], bool | None]:
    """Split `vllm serve` arguments into (ours for argparse, kv-transfer-config dotted
    keys, --enable-force-include-usage setting); drop every other vLLM flag."""
    ours: list[str] = []
    dotted: dict[str, str] = {}
    include_usage: bool | None = None
    i = 0
    while i < len(argv):
        token = _normalise(argv[i]) if argv[i].startswith("--") else argv[i]
        name = token.partition("=")[0]
        i += 1
        if not _is_flag(token) or name in own or name.startswith("--sim-"):
            ours.append(token)
            # argparse consumes our flags' values; copy words up to the next flag
            while name in own or name.startswith("--sim-"):
                if i >= len(argv) or _is_flag(argv[i]) or "=" in token:
                    break
                ours.append(argv[i])
                i += 1
            continue
        if name in _ENABLE_USAGE:
            include_usage = _ENABLE_USAGE[name]
            continue
        if name.startswith("--kv-transfer-config."):
            key = name.removeprefix("--kv-transfer-config.")
            value = token.partition("=")[2] if "=" in token else (argv[i] if i < len(argv) else "")
            i += 0 if "=" in token else 1
            dotted[key] = value
            continue
        if name in VALUELESS or "=" in token or (name.startswith("-O") and len(name) > 2):
            continue
        if name in OPTIONAL_VALUE and (i >= len(argv) or _is_flag(argv[i])):
            continue
        # A flag with a value (or a list of them): skip the words up to the next flag.
        i += 1
        while i < len(argv) and not _is_flag(argv[i]):
            i += 1
    return ours, dotted, include_usage


def _dotted_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def parse(argv: list[str]) -> SimConfig:
    """Parse the arguments after `serve`."""
    parser = _parser()
    own = {s for action in parser._actions for s in action.option_strings}
    ours, dotted, include_usage = split_args(argv, own)
    args = parser.parse_args(ours)
    model = args.model_tag or args.model
    if not model:
        parser.error("a model is required: pdcluster-engine-sim serve MODEL")
    kv_config = _kv_transfer_config(parser, args.kv_transfer_config, dotted)
    max_model_len = DEFAULT_MAX_MODEL_LEN
    if args.max_model_len not in (None, "auto", "-1"):
        max_model_len = human_readable_int(args.max_model_len)
    _check_sizes(parser, args)
    kv_events_config = _zmq_kv_events_config(parser, args.kv_events_config)
    return _sim_config(args, model, kv_config, max_model_len, kv_events_config, bool(include_usage))


def _kv_transfer_config(
    parser: argparse.ArgumentParser, kv_config: Any, dotted: dict[str, str]
) -> dict[str, Any] | None:
    """--kv-transfer-config with its `--kv-transfer-config.key value` overrides applied."""
    if dotted:
        kv_config = dict(kv_config or {})
        for key, raw in dotted.items():
            kv_config[key] = _dotted_value(raw)
    if kv_config is not None and not isinstance(kv_config, dict):
        parser.error("--kv-transfer-config must be a JSON object")
    if kv_config and kv_config.get(kvt.CONNECTOR_KEY) and kv_config.get(kvt.ROLE_KEY) not in ROLE_FOR_KV_ROLE:
        parser.error("--kv-transfer-config: kv_role must be kv_producer, kv_consumer or kv_both")
    return kv_config


def _check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.sim_time_scale <= 0:
        parser.error("--sim-time-scale must be positive")
    if args.block_size <= 0:
        parser.error("--block-size must be positive")
    if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override <= 0:
        parser.error("--num-gpu-blocks-override must be positive")


def _zmq_kv_events_config(parser: argparse.ArgumentParser, events: Any) -> dict[str, Any] | None:
    """--kv-events-config when it enables ZMQ events; None when events are off or go nowhere."""
    if events is not None and not isinstance(events, dict):
        parser.error("--kv-events-config must be a JSON object")
    if (
        events
        and events.get("enable_kv_cache_events")
        and events.get("publisher", "zmq") not in ("zmq", "null")
    ):
        parser.error("--kv-events-config: publisher must be zmq or null")
    if events and events.get("enable_kv_cache_events") and events.get("publisher", "zmq") == "zmq":
        return events
    return None


def _sim_config(
    args: argparse.Namespace,
    model: str,
    kv_config: dict[str, Any] | None,
    max_model_len: int,
    kv_events_config: dict[str, Any] | None,
    force_include_usage: bool,
) -> SimConfig:
    """The parsed flags, with what vLLM reads from the environment."""
    return SimConfig(
        model=model,
        served_model_names=args.served_model_name or [model],
        host=args.host,
        port=args.port,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_transfer_config=kv_config,
        api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
        force_include_usage=force_include_usage,
        block_size=args.block_size,
        bootstrap_port=int(os.environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT") or BOOTSTRAP_PORT),
        host_ip=os.environ.get("VLLM_HOST_IP", ""),
        abort_timeout_s=_env_float("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", SIM_ABORT_TIMEOUT_S),
        hash_seed=os.environ.get("PYTHONHASHSEED"),
        store_config=_store_config(kv_config),
        prefix_caching=args.enable_prefix_caching,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        per_request_metrics=args.enable_per_request_metrics,
        num_gpu_blocks=args.num_gpu_blocks_override,
        kv_events_config=kv_events_config,
        profile=args.sim_profile,
        time_scale=args.sim_time_scale,
        kv_gbps=args.sim_kv_gbps,
        seed=args.seed if args.sim_seed is None else args.sim_seed,
        mooncake_master=args.sim_mooncake_master,
        output_mean=args.sim_output_mean,
        record=args.sim_record,
        stamp_tokens=args.sim_stamp_tokens,
        faults=args.sim_faults,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        headless=args.headless,
    )
