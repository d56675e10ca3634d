"""Latency profiles of a prefill and a decode engine, from measured data.

One `Profile` answers the two questions the engine simulator, the fleet simulator and
the control law all ask:

- how long a prefill batch takes:  a + b * sum(L) + c * sum(L^2)   (L = new tokens per
  request; the quadratic term is attention, which is per sequence);
- how long one decode step takes:  d0 + d1 * batch + d2 * kv_tokens  (weights and KV
  read from HBM once per step).

Coefficients are least-squares fits to public measurements, made by
tools/fit_profiles.py and shipped in the package (pdcluster/data/profiles.json, each
with its source). The default profile is NVIDIA Dynamo's
pre-deployment profile of Llama-3.1-8B-Instruct-FP8 on one H200 (vLLM 0.10.1.1, TP1), as
published in the Dynamo repository (tests/planner/profiling_results/H200_TP1P_TP1D).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

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


@functools.cache
def _shipped() -> dict[str, Profile]:
    """The profiles in pdcluster/data/profiles.json (fitted by tools/fit_profiles.py from
    the public measurements it names), by name."""
    entries = json.loads((PROFILE_DATA / "profiles.json").read_text())
    return {
        e["name"]: Profile(
            e["name"],
            tuple(e["prefillCoefficientsMs"]),
            tuple(e["decodeCoefficientsMs"]),
            e["maxKvTokens"],
            e["kvBytesPerToken"],
            e["gpus"],
        )
        for e in entries
    }


def profile_names() -> list[str]:
    return list(_shipped())


def load(name: str = DEFAULT_PROFILE) -> Profile:
    try:
        return _shipped()[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(profile_names())}") from None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]
