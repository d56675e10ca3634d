"""Latency profiles of a prefill and a decode engine, from measured data.

One `Profile` answers the two questions the engine simulator, the fleet simulator and
the control law all ask:

- how long a prefill batch takes:  a + b * sum(L) + c * sum(L^2)   (L = new tokens per
  request; the quadratic term is attention, which is per sequence);
- how long one decode step takes:  d0 + d1 * batch + d2 * kv_tokens  (weights and KV
  read from HBM once per step).

Coefficients are least-squares fits to measured points, which ship in the package
(pdcluster/data/, with their sources). The default profile is NVIDIA Dynamo's
pre-deployment profile of Llama-3.1-8B-Instruct-FP8 on one H200 (vLLM 0.10.1.1, TP1), as
published in the Dynamo repository (tests/planner/profiling_results/H200_TP1P_TP1D).
"""

from __future__ import annotations

import csv
import functools
import importlib.resources
import json
import math
import os
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

import numpy as np

DEFAULT_PROFILE = "h200-llama3.1-8b"

_SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
PROFILE_DATA = importlib.resources.files("pdcluster") / "data"


def traces_dir() -> Path:
    """Where the public request traces (for benchmarks and the demo) live:
    `PDCLUSTER_TRACES`, else the traces folder next to the repository."""
    env = os.environ.get("PDCLUSTER_TRACES")
    for candidate in (Path(env) if env else None, _SHARED_TRACES):
        if candidate is not None and candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        "request traces not found: set PDCLUSTER_TRACES to the folder holding mooncake_conversation_trace.jsonl"
    )


@dataclass(frozen=True)
class Profile:
    name: str
    prefill_coef: tuple[float, float, float]  # ms: a, b per token, c per token^2 (per sequence)
    decode_coef: tuple[float, float, float]  # ms: d0, d1 per sequence, d2 per KV token
    max_kv_tokens: int  # KV capacity of one engine instance
    kv_bytes_per_token: int  # for KV transfer time
    gpus: int = 1  # GPUs of the instance the profile was measured on

    def prefill_ms(self, lengths: list[int] | tuple[int, ...]) -> float:
        a, b, c = self.prefill_coef
        return a + b * sum(lengths) + c * sum(n * n for n in lengths)

    def prefill_one_ms(self, length: int) -> float:
        a, b, c = self.prefill_coef
        return a + b * length + c * length * length

    def decode_step_ms(self, batch: int, kv_tokens: int) -> float:
        d0, d1, d2 = self.decode_coef
        return d0 + d1 * batch + d2 * kv_tokens

    def prefill_tokens_per_s(self, length: int) -> float:
        """Throughput of back-to-back prefills of `length` tokens."""
        return length / self.prefill_one_ms(length) * 1000.0

    def decode_tokens_per_s(self, itl_target_ms: float, context: int) -> float:
        """Best decode throughput of one instance whose step time stays within the target.

        The batch is bounded by the ITL target and by KV capacity (each sequence holds
        about `context` tokens).
        """
        d0, d1, d2 = self.decode_coef
        per_seq = d1 + d2 * context
        batch = (itl_target_ms - d0) / per_seq if per_seq > 0 else 0.0
        batch = min(batch, self.max_kv_tokens / max(context, 1))
        if batch < 1.0:
            return 0.0
        return batch / self.decode_step_ms(int(batch), int(batch * context)) * 1000.0

    def kv_transfer_ms(self, tokens: int, gbit_per_s: float) -> float:
        return tokens * self.kv_bytes_per_token * 8 / (gbit_per_s * 1e9) * 1000.0


PROFILE_KEY = "profile.json"  # the key of a profile ConfigMap's data


def to_json(profile: Profile) -> str:
    return json.dumps(
        {
            "name": profile.name,
            "prefillCoefficientsMs": list(profile.prefill_coef),
            "decodeCoefficientsMs": list(profile.decode_coef),
            "maxKvTokens": profile.max_kv_tokens,
            "kvBytesPerToken": profile.kv_bytes_per_token,
            "gpus": profile.gpus,
        },
        indent=2,
    )


def from_json(text: str) -> Profile:
    """A profile as to_json wrote it; ValueError saying what is wrong otherwise."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(doc, dict):
        raise ValueError("a JSON object is expected")

    def coefficients(key: str) -> tuple[float, float, float]:
        value = doc.get(key)
        if (
            not isinstance(value, list)
            or len(value) != 3
            or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                for x in value
            )
        ):
            raise ValueError(
                f"{key} must be three numbers >= 0 (ms: fixed, per token or sequence, quadratic or per KV token)"
            )
        return (float(value[0]), float(value[1]), float(value[2]))

    def count(key: str, default: int | None = None, low: int = 1) -> int:
        value = doc.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{key} must be a whole number >= {low}")
        return value

    prefill, decode = coefficients("prefillCoefficientsMs"), coefficients("decodeCoefficientsMs")
    if prefill[1] <= 0 and prefill[2] <= 0:
        raise ValueError("prefillCoefficientsMs: a prefill must take time per token")
    if decode[0] <= 0 and decode[1] <= 0:
        raise ValueError("decodeCoefficientsMs: a decode step must take time")
    name = doc.get("name", "configmap")
    return Profile(
        str(name), prefill, decode, count("maxKvTokens"), count("kvBytesPerToken", 0, 0), count("gpus", 1)
    )


def _lstsq(rows: list[list[float]], y: list[float]) -> tuple[float, float, float]:
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(y, dtype=float), rcond=None)
    return (float(coef[0]), float(coef[1]), float(coef[2]))


def _read_csv(path: Traversable) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _dynamo_h200(root: Traversable) -> Profile:
    prefill = _read_csv(root / "latency_dynamo_h200_llama31_8b_fp8_prefill.csv")
    decode = _read_csv(root / "latency_dynamo_h200_llama31_8b_fp8_decode.csv")
    p = _lstsq(
        [[1.0, float(r["isl_tokens"]), float(r["isl_tokens"]) ** 2] for r in prefill],
        [float(r["ttft_ms"]) for r in prefill],
    )
    d = _lstsq(
        [[1.0, float(r["implied_concurrency"]), float(r["active_kv_tokens"])] for r in decode],
        [float(r["itl_ms"]) for r in decode],
    )
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 128 KiB/token.
    return Profile(DEFAULT_PROFILE, p, d, int(decode[0]["max_kv_tokens"]), 131072)


def _splitwise(root: Traversable, model: str, hardware: str, tp: int) -> Profile:
    rows = [
        r
        for r in _read_csv(root / "latency_splitwise_perf_model.csv")
        if r["model"] == model and r["hardware"] == hardware and int(r["tensor_parallel"]) == tp
    ]
    if not rows:
        raise KeyError(f"no Splitwise rows for {model} {hardware} TP{tp}")
    single = [r for r in rows if int(r["batch_size"]) == 1]
    p = _lstsq(
        [[1.0, float(r["prompt_size"]), float(r["prompt_size"]) ** 2] for r in single],
        [float(r["prompt_time"]) for r in single],
    )
    # Splitwise measured token time against batch size only; put context in via the
    # HBM roofline of the KV read (small next to the weight read for these models).
    d0, d1, _ = _lstsq(
        [[1.0, float(r["batch_size"]), 0.0] for r in rows] + [[0.0, 0.0, 1.0]],
        [float(r["token_time"]) for r in rows] + [0.0],
    )
    kv_bytes = {"llama2-70b": 327680, "bloom-176b": 4194304}[model]
    hbm = {"a100-80gb": 2.0e12, "h100-80gb": 3.35e12, "h100-80gb-pcap": 3.35e12}[hardware] * tp
    d2 = kv_bytes / hbm * 1000.0
    capacity = int((80e9 * tp * 0.9 - {"llama2-70b": 140e9, "bloom-176b": 352e9}[model]) / kv_bytes)
    return Profile(f"splitwise-{model}-{hardware}-tp{tp}", p, (d0, d1, d2), max(capacity, 1), kv_bytes, tp)


def _distserve(root: Traversable, engine: str, model: str, tp: int) -> Profile:
    data = json.loads((root / f"latency_distserve_a100_{engine}.json").read_text())
    coef = data[model][str(tp)]
    a, b, c = coef["prefill"]
    d0, d2, d1 = coef["decoding_smallbs"]  # DistServe: a + b * sum(context) + c * batch
    kv_bytes = {"facebook/opt-13b": 819200, "facebook/opt-66b": 2359296}[model]
    weights = {"facebook/opt-13b": 26e9, "facebook/opt-66b": 132e9}[model]
    capacity = int((80e9 * tp * 0.9 - weights) / kv_bytes)
    short = model.split("/")[-1]
    return Profile(
        f"distserve-{engine}-{short}-tp{tp}", (a, b, c), (d0, d1, d2), max(capacity, 1), kv_bytes, tp
    )


def profile_names() -> list[str]:
    names = [DEFAULT_PROFILE]
    for model, tps in (("llama2-70b", (2, 4, 8)), ("bloom-176b", (8,))):
        for hw in ("a100-80gb", "h100-80gb"):
            names += [f"splitwise-{model}-{hw}-tp{tp}" for tp in tps]
    for engine in ("distserve", "vllm"):
        names += [f"distserve-{engine}-opt-13b-tp{tp}" for tp in (1, 2, 4)]
        names += [f"distserve-{engine}-opt-66b-tp{tp}" for tp in (2, 4, 8)]
    return names


@functools.cache
def load(name: str = DEFAULT_PROFILE) -> Profile:
    root = PROFILE_DATA
    if name == DEFAULT_PROFILE:
        return _dynamo_h200(root)
    parts = name.split("-")
    if parts[0] == "splitwise":
        hardware = "-".join(parts[3:-1])
        return _splitwise(root, "-".join(parts[1:3]), hardware, int(parts[-1][2:]))
    if parts[0] == "distserve":
        return _distserve(root, parts[1], f"facebook/{parts[2]}-{parts[3]}", int(parts[4][2:]))
    raise KeyError(f"unknown profile {name!r}; known: {', '.join(profile_names())}")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]
