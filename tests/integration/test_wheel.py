"""The installed wheel needs nothing outside itself: its latency profiles ship inside it,
so the operator's autoscaler and the engine simulator work in an image that carries no
traces folder, and from a checkout whose ../shared is not there."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import json
from datetime import UTC, datetime, timedelta
import pdcluster
from pdcluster import perf
from pdcluster.api.v1alpha1 import PDClusterSpec
from pdcluster.control import Observed, RoleObserved, decide
from pdcluster.control.types import assemble

profiles = {name: perf.load(name).max_kv_tokens for name in perf.profile_names()}
spec = PDClusterSpec.model_validate({"model": {"name": "m"}, "autoscaling": {"enabled": True, "gpuBudget": 8}})
roles = {r: RoleObserved(desired=1, replicas=1, ready=1, unschedulable=0) for r in ("prefill", "decode")}
state, reasons = None, []
for run in range(4):  # the spec names no profile: feedback alone, then the learned model
    snapshot = assemble(window_s=30, prompt_tokens_rate=40000.0, prefilled_tokens_rate=40000.0, prefilled_rate=10.0,
                        finished_rate=10.0, generated_tokens_rate=2000.0, ttft_ms=900.0, itl_ms=20.0,
                        prefill_time_ms=60.0, prefill_steps_rate=10.0, prefill_ready=1.0,
                        decode_running=20.0 + 10 * run, decode_tokens_rate=1000.0, decode_kv_usage=0.3, decode_ready=1.0)
    state, decision = decide(spec, snapshot, state, Observed(**roles), datetime(2026, 12, 1, tzinfo=UTC) + timedelta(seconds=30 * run))
    reasons.append(decision.reason)
try:
    perf.traces_dir()
    traces = "found"
except FileNotFoundError:
    traces = "absent"
print(json.dumps({"file": pdcluster.__file__, "profiles": profiles, "action": decision.action,
                  "reasons": reasons, "capacity": state.capacity.model_dump(), "traces": traces}))
"""


def test_the_wheel_autoscales_with_nothing_outside_it(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(REPO)],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("pdcluster_operator-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    # The unpacked wheel first on the path, run from a folder with no traces near it.
    out = subprocess.run(
        [sys.executable, "-c", CHECK],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    got = json.loads(out.stdout)
    assert Path(got["file"]).is_relative_to(site), got["file"]
    assert got["traces"] == "absent"
    assert len(got["profiles"]) == 21 and all(v > 0 for v in got["profiles"].values())
    assert got["action"] in ("scale", "hold"), got
    assert "feedback only" in got["reasons"][0] and "feedback only" not in got["reasons"][-1], got["reasons"]
    # 60 ms of prefill for 4000 tokens, one request per step; 20+ sequences per 1000 tokens/s.
    assert got["capacity"]["prefill_ns_per_token"] == 15000, got["capacity"]
    # Decode learns from whole windows only: the first run's series may be younger than its
    # window, so three of the four count.
    assert got["capacity"]["decode_windows"] == 3 and got["capacity"]["kv_capacity_tokens"] > 0
