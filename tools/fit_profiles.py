#!/usr/bin/env python3
"""Fits the latency profiles the package ships (operator/pdcluster/data/profiles.json)
from the public measurements in ../shared/traces (or $PDCLUSTER_TRACES), described in
that folder's README:

- h200-llama3.1-8b: NVIDIA Dynamo's pre-deployment profiler output, H200 SXM,
  Llama-3.1-8B-Instruct-FP8, vLLM 0.10.1.1, TP1 (ai-dynamo/dynamo, Apache-2.0):
  latency_dynamo_h200_llama31_8b_fp8_{prefill,decode}.csv;
- splitwise-*: Splitwise's measured performance model (Mutinifni/splitwise-sim @ 8f99e7dc,
  data/perf_model.csv; ISCA'24; MIT): latency_splitwise_perf_model.csv;
- distserve-*: DistServe's fitted coefficients (LLMServe/DistServe @ 82831f16,
  simdistserve/estimators/profile_data; OSDI'24; Apache-2.0):
  latency_distserve_a100_{distserve,vllm}.json.

Each profile is a prefill fit a + b*L + c*L^2 per sequence, a decode-step fit
d0 + d1*batch + d2*kv_tokens, the KV capacity in tokens and bytes per token.

    .venv/bin/python tools/fit_profiles.py > operator/pdcluster/data/profiles.json
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pdcluster import perf

SOURCES = {
    "h200-llama3.1-8b": "NVIDIA Dynamo profiler output, H200, Llama-3.1-8B-Instruct-FP8, vLLM 0.10.1.1, TP1 "
    "(ai-dynamo/dynamo, Apache-2.0)",
    "splitwise": "Splitwise perf model (Mutinifni/splitwise-sim @ 8f99e7dc, data/perf_model.csv; MIT)",
    "distserve": "DistServe profile data (LLMServe/DistServe @ 82831f16, simdistserve/estimators/profile_data; "
    "Apache-2.0)",
}


def _lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(y, dtype=float), rcond=None)
    return [float(c) for c in coef]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def dynamo_h200(folder: Path) -> dict[str, Any]:
    prefill = _rows(folder / "latency_dynamo_h200_llama31_8b_fp8_prefill.csv")
    decode = _rows(folder / "latency_dynamo_h200_llama31_8b_fp8_decode.csv")
    p = _lstsq([[1.0, float(r["isl_tokens"]), float(r["isl_tokens"]) ** 2] for r in prefill],
               [float(r["ttft_ms"]) for r in prefill])
    d = _lstsq([[1.0, float(r["implied_concurrency"]), float(r["active_kv_tokens"])] for r in decode],
               [float(r["itl_ms"]) for r in decode])
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 128 KiB/token.
    return entry(perf.DEFAULT_PROFILE, p, d, int(decode[0]["max_kv_tokens"]), 131072, 1, SOURCES["h200-llama3.1-8b"])


def splitwise(folder: Path, model: str, hardware: str, tp: int) -> dict[str, Any]:
    rows = [r for r in _rows(folder / "latency_splitwise_perf_model.csv")
            if r["model"] == model and r["hardware"] == hardware and int(r["tensor_parallel"]) == tp]
    single = [r for r in rows if int(r["batch_size"]) == 1]
    p = _lstsq([[1.0, float(r["prompt_size"]), float(r["prompt_size"]) ** 2] for r in single],
               [float(r["prompt_time"]) for r in single])
    # Splitwise measured token time against batch size only; context enters through the
    # HBM roofline of the KV read (small next to the weight read for these models).
    d0, d1, _ = _lstsq([[1.0, float(r["batch_size"]), 0.0] for r in rows] + [[0.0, 0.0, 1.0]],
                       [float(r["token_time"]) for r in rows] + [0.0])
    kv_bytes = {"llama2-70b": 327680, "bloom-176b": 4194304}[model]
    hbm = {"a100-80gb": 2.0e12, "h100-80gb": 3.35e12}[hardware] * tp
    capacity = int((80e9 * tp * 0.9 - {"llama2-70b": 140e9, "bloom-176b": 352e9}[model]) / kv_bytes)
    name = f"splitwise-{model}-{hardware}-tp{tp}"
    return entry(name, p, [d0, d1, kv_bytes / hbm * 1000.0], max(capacity, 1), kv_bytes, tp, SOURCES["splitwise"])


def distserve(folder: Path, engine: str, model: str, tp: int) -> dict[str, Any]:
    coef = json.loads((folder / f"latency_distserve_a100_{engine}.json").read_text())[model][str(tp)]
    d0, d2, d1 = coef["decoding_smallbs"]  # DistServe: a + b * sum(context) + c * batch
    kv_bytes = {"facebook/opt-13b": 819200, "facebook/opt-66b": 2359296}[model]
    weights = {"facebook/opt-13b": 26e9, "facebook/opt-66b": 132e9}[model]
    capacity = int((80e9 * tp * 0.9 - weights) / kv_bytes)
    name = f"distserve-{engine}-{model.split('/')[-1]}-tp{tp}"
    return entry(name, list(coef["prefill"]), [d0, d1, d2], max(capacity, 1), kv_bytes, tp, SOURCES["distserve"])


def entry(name: str, prefill, decode, max_kv: int, kv_bytes: int, gpus: int, source: str) -> dict[str, Any]:
    return {"name": name, "prefillCoefficientsMs": prefill, "decodeCoefficientsMs": decode, "maxKvTokens": max_kv,
            "kvBytesPerToken": kv_bytes, "gpus": gpus, "source": source}


def fit_all(folder: Path) -> list[dict[str, Any]]:
    out = [dynamo_h200(folder)]
    for model, tps in (("llama2-70b", (2, 4, 8)), ("bloom-176b", (8,))):
        for hardware in ("a100-80gb", "h100-80gb"):
            out += [splitwise(folder, model, hardware, tp) for tp in tps]
    for engine in ("distserve", "vllm"):
        out += [distserve(folder, engine, "facebook/opt-13b", tp) for tp in (1, 2, 4)]
        out += [distserve(folder, engine, "facebook/opt-66b", tp) for tp in (2, 4, 8)]
    return out


def main() -> None:
    json.dump(fit_all(perf.traces_dir()), sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
