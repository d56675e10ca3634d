"""ModeFit: the shipped crossover sweep read at the observed prompt and the ITL target."""

from __future__ import annotations

import math

import pytest

from pdcluster.api.v1alpha1 import ServingMode
from pdcluster.control.modefit import mode_fit, ratio, table

PROFILE = "h200-llama3.1-8b"


def test_the_table_is_the_sweep_and_reads_exactly_at_its_points() -> None:
    t = table(PROFILE)
    assert t is not None and sorted(t) == [15.0, 25.0, 50.0, 100.0]
    assert sorted(t[25.0]) == [1024 * 2**i for i in range(8)]
    assert ratio(t, 65536, 100.0) == pytest.approx(0.1626 / 0.2401)
    assert ratio(t, 16384, 15.0) == pytest.approx(t[15.0][16384])


def test_between_points_it_interpolates_on_log_scales_and_clamps_outside() -> None:
    t = table(PROFILE)
    assert t is not None
    mid = ratio(t, math.sqrt(8192 * 16384), 25.0)
    assert mid == pytest.approx(math.sqrt(t[25.0][8192] * t[25.0][16384]))
    assert ratio(t, 37.5, 25.0) == pytest.approx(t[25.0][1024])  # shorter than the sweep
    assert ratio(t, 10**6, 200.0) == pytest.approx(t[100.0][131072])
    between = ratio(t, 4096, 20.0)
    assert min(t[15.0][4096], t[25.0][4096]) <= between <= max(t[15.0][4096], t[25.0][4096])


def test_advice_names_the_better_mode_only_outside_the_tie_band() -> None:
    # 64k prompts at a loose ITL target: colocated serves 1.48x per GPU (docs/crossover.md).
    fits, reason, message = mode_fit(ServingMode.disaggregated, PROFILE, 65536, 100) or (None, "", "")
    assert (fits, reason) == (False, "OtherModeBetter")
    assert (
        message.startswith("colocated would serve this traffic at 1.48x") and "spec.mode colocated" in message
    )
    fit = mode_fit(ServingMode.colocated, PROFILE, 65536, 100)
    assert fit is not None and fit[:2] == (True, "ModeFits") and "colocated serves" in fit[2]
    # 16k prompts at a tight target: disaggregated, 1.54x.
    fit = mode_fit(ServingMode.colocated, PROFILE, 16384, 15)
    assert fit is not None and fit[1] == "OtherModeBetter" and fit[2].startswith("disaggregated would")
    # Within 10%: either fits.
    fit = mode_fit(ServingMode.disaggregated, PROFILE, 1024, 50)
    assert fit is not None and fit[0] and "within 10%" in fit[2]


def test_no_advice_without_a_sweep_for_the_profile_or_without_traffic() -> None:
    assert table("a100-opt-13b-distserve") is None
    assert mode_fit(ServingMode.disaggregated, "a100-opt-13b-distserve", 4096, 25) is None
    assert mode_fit(ServingMode.disaggregated, None, 4096, 25) is None
    assert mode_fit(ServingMode.disaggregated, PROFILE, None, 25) is None
