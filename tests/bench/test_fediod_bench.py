"""FedIOD in fedsm bench: HD95 against hand values, the job plan and the table's rendering."""

import math

import numpy as np
import pytest

from engine.bench.cache import JobKey
from engine.bench.fediod_bench import eps_label, eps_of, fediod_section, hd95_per_case, plan_fediod_jobs
from engine.bench.presets import get_preset


def square(size, top, left, side):
    m = np.zeros((size, size), bool)
    m[top:top + side, left:left + side] = True
    return m


def test_hd95_of_a_shifted_square_is_the_shift_and_empty_cases_are_handled():
    truth = square(32, 8, 8, 10)
    shifted = square(32, 8, 11, 10)  # moved 3 px to the right: every boundary point is at most 3 px away
    pred = np.stack([shifted, np.zeros((32, 32), bool)])[None]
    gt = np.stack([truth, np.zeros((32, 32), bool)])[None]
    hd = hd95_per_case(pred, gt, np.array([0]))
    assert hd[0, 0] == pytest.approx(3.0)
    assert hd[0, 1] == 0.0  # absent from both: no error
    missing = hd95_per_case(np.zeros_like(pred), gt, np.array([0]))
    assert math.isnan(missing[0, 0])  # absent from the prediction only: undefined


def test_slices_of_one_case_give_one_3d_distance():
    truth = np.stack([square(16, 4, 4, 6)] * 3)[:, None]  # (Z, L, H, W)
    pred = truth.copy()
    pred[2, 0] = square(16, 4, 6, 6)  # last slice shifted 2 px
    hd = hd95_per_case(pred, truth, np.array([7, 7, 7]))
    assert hd.shape == (1, 1) and 0 < hd[0, 0] <= 2.0


def test_plan_and_labels():
    preset = get_preset("fediod-cpu")
    jobs = plan_fediod_jobs(preset)
    methods = [k.method for k in jobs if k.task == "fundus"]
    assert methods == ["fediod", "centralized", "fedavg", "fedsm", "fediod-eps1", "fediod-eps8", "fediod-eps64"]
    assert eps_of(eps_label(8.0)) == 8.0 and eps_of("fediod") is None
    assert plan_fediod_jobs(get_preset("tiny")) == []  # the CI smoke preset leaves FedIOD out


def test_section_shows_standalone_mean_std_and_dice_against_epsilon():
    preset = get_preset("fediod-cpu")

    def table(dice, hd):
        return {"table": {"dice": dice, "hd95": hd}}

    results = {
        JobKey("fundus", "fediod", "fediod", 0): {**table(0.6, 5.0), "standalone": {
            "site1": {"dice": 0.5, "hd95": 4.0}, "site2": {"dice": 0.7, "hd95": 6.0}}},
        JobKey("fundus", "fediod", "fedavg", 0): table(0.65, 3.0),
        JobKey("fundus", "fediod", "fediod-eps8", 0): {**table(0.4, 9.0),
                                                       "extra": {"noise_multiplier": {"site1": 12.5}}},
    }
    text = "\n".join(fediod_section(results, preset, "fundus"))
    assert "| Standalone (teachers) | 0.6000 ± 0.1000 | 5.00 ± 1.00 |" in text
    assert "| FedAvg | 0.6500 | 3.00 |" in text
    assert "| FedSM | – | – |" in text  # not run yet
    assert "| 8 | 12.5 | 0.4000 | 9.00 |" in text
    assert "| no DP (infinite) | 0 | 0.6000 | 5.00 |" in text
    assert fediod_section(results, preset, "prostate") == []
