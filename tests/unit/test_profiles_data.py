"""The shipped latency profiles (pdcluster/data/profiles.json) are what tools/fit_profiles.py
fits from the public measurements, and every one of them loads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pdcluster import perf

TOOL = Path(__file__).resolve().parents[2] / "tools" / "fit_profiles.py"


def test_every_shipped_profile_loads_and_names_its_source():
    entries = json.loads((perf.PROFILE_DATA / "profiles.json").read_text())
    assert entries[0]["name"] == perf.DEFAULT_PROFILE
    for e in entries:
        profile = perf.load(e["name"])
        assert profile.prefill_one_ms(4096) > profile.prefill_one_ms(128) > 0
        assert profile.decode_step_ms(8, 100_000) > 0 and profile.max_kv_tokens > 0
        assert e["source"]
    with pytest.raises(KeyError, match="unknown profile"):
        perf.load("no-such-profile")


def test_the_shipped_file_is_what_the_script_fits():
    try:
        folder = perf.traces_dir()
    except FileNotFoundError:
        pytest.skip("the public measurements (../shared/traces) are not here")
    spec = importlib.util.spec_from_file_location("fit_profiles", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    fitted = tool.fit_all(folder)
    shipped = json.loads((perf.PROFILE_DATA / "profiles.json").read_text())
    assert [e["name"] for e in fitted] == [e["name"] for e in shipped]
    for f, s in zip(fitted, shipped, strict=True):
        for key in ("prefillCoefficientsMs", "decodeCoefficientsMs"):
            assert f[key] == pytest.approx(s[key], rel=1e-9, abs=1e-15), (f["name"], key)
        assert {k: v for k, v in f.items() if "Coefficients" not in k} == {
            k: v for k, v in s.items() if "Coefficients" not in k
        }
