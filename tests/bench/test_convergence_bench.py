"""cpu-converged machinery: plateau criterion, per-seed differences at the best round, lr tuning, time split."""

from __future__ import annotations

import math

import pytest

from engine.bench.cache import JobKey
from engine.bench.presets import get_preset, restrict_preset
from engine.bench.tables import paired_per_seed, plateau, plateau_rows, time_rows
from engine.bench.tuning import (
    chosen_lrs,
    parse_tune_label,
    tune_jobs,
    tune_label,
    tuned_method,
    tuned_methods,
    tuning_score,
)
from engine.errors import ConfigError


def _curve(values, key="global"):
    return [{"round": i + 1, key: v} for i, v in enumerate(values)]


def test_plateau_reads_the_last_fifth_of_the_rounds():
    rising = _curve([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.86])
    check = plateau(rising, "global", 10, 0.2, 0.01)  # rounds 9 and 10: 0.85, 0.86
    assert check["points"] == 2 and check["span"] == pytest.approx(0.01) and check["flat"] is True
    falling = _curve([0.5] * 8 + [0.5, 0.45])
    assert plateau(falling, "global", 10, 0.2, 0.01)["flat"] is False
    sparse = [{"round": 5, "global": 0.5}, {"round": 10, "global": 0.5}]
    assert plateau(sparse, "global", 10, 0.2, 0.01)["flat"] is None  # one point in the window: not measured


def test_plateau_rows_and_per_seed_differences_at_the_best_round():
    results = {
        JobKey("fundus", "main", "fedavg", 0): {"client_average": {"mean": 0.60}, "best_round": 7,
                                                "curves": _curve([0.5] * 10)},
        JobKey("fundus", "main", "fedavg", 1): {"client_average": {"mean": 0.50}, "best_round": 9,
                                                "curves": _curve([0.5] * 9 + [0.3])},
        JobKey("fundus", "main", "fedsm", 0): {"client_average": {"mean": 0.65}, "best_round": 10},
        JobKey("fundus", "main", "fedsm", 1): {"client_average": {"mean": 0.45}, "best_round": 4},
        JobKey("fundus", "main", "local", 0): {"client_average": {"mean": 0.3},
                                               "curves": _curve([0.3] * 10, key="personal")},
    }
    pairs = paired_per_seed(results, "fundus", "fedsm", "fedavg")
    assert pairs[0]["diff"] == pytest.approx(0.05) and pairs[0]["rounds"] == (10, 7)
    assert pairs[1]["diff"] == pytest.approx(-0.05) and pairs[1]["rounds"] == (4, 9)
    rows = {r["method"]: r for r in plateau_rows(results, "fundus", ["fedavg", "local"], 10, 0.2, 0.01)}
    assert rows["fedavg"]["flat"] is False  # seed 1 drops in the last rounds
    assert rows["fedavg"]["per_seed"][0]["flat"] is True and rows["fedavg"]["per_seed"][0]["best_round"] == 7
    assert rows["local"]["flat"] is True  # Local's curve is its sites' own models


def test_tuning_labels_and_jobs():
    assert parse_tune_label(tune_label("fedsm-extra", 0.003)) == ("fedsm-extra", 0.003)
    with pytest.raises(ConfigError, match="tuning job"):
        parse_tune_label("fedavg")
    preset = get_preset("cpu-converged")
    jobs = tune_jobs(preset)
    # FedSM's family takes FedAvg's rate (its global model is FedAvg's): FedAvg is tuned, FedSM is not
    assert "fedsm" in preset.methods and "fedavg" in preset.methods
    tuned = {parse_tune_label(j.method)[0] for j in jobs}
    assert "fedavg" in tuned and not tuned & {"fedsm", "fedsm-extra"}
    assert len(jobs) == len(preset.tasks) * len(tuned) * len(preset.lr_grid)
    assert tuned_methods(("fedsm", "centralized", "fedsm-extra")) == ["fedavg", "centralized"]
    assert {j.seed for j in jobs} == {preset.analysis_seeds[0]}
    assert tuned_method(JobKey("fundus", "lam", "lam0.30", 0)) == "fedavg"
    assert tuned_method(JobKey("fundus", "personalization", "fedsm-apfl", 0)) == "fedavg"
    assert tuned_method(JobKey("fundus", "main", "fedsm", 0)) == "fedavg"
    assert tuned_method(JobKey("fundus", "unseen", "fedprox", 0)) == "fedprox"


def test_tuning_picks_the_best_validation_score_per_method():
    preset = get_preset("cpu-converged")
    lo, mid, hi = preset.lr_grid

    def run(val, personal=None, global_sites=None):
        sel = {"best_val_dice": val}
        if personal:
            sel["best_val_dice_personal"] = personal
        return {"model_selection": sel, "curves": [{"round": 1, "global_sites": global_sites or {}}]}

    results = {
        JobKey("fundus", "tune", tune_label("fedavg", lo), 0): run(0.5),
        JobKey("fundus", "tune", tune_label("fedavg", mid), 0): run(0.7),
        JobKey("fundus", "tune", tune_label("fedavg", hi), 0): run(0.7),  # tie: the earlier candidate wins
        JobKey("fundus", "tune", tune_label("local", lo), 0): run(None, {"a": 0.2, "b": 0.4}),
        JobKey("fundus", "tune", tune_label("local", mid), 0): run(None, {"a": 0.1, "b": 0.1}),
        JobKey("fundus", "tune", tune_label("local", hi), 0): run(None, {"a": 0.6, "b": 0.6}),
        JobKey("fundus", "tune", tune_label("scaffold", lo), 0): run(0.9),  # incomplete: not chosen
    }
    chosen = chosen_lrs(results, "fundus", preset)
    assert chosen == {"fedavg": mid, "local": hi}
    # FedSM: per site the better of global and personalized validation Dice
    score = tuning_score("fedsm", run(0.5, {"a": 0.6, "b": 0.2}, {"a": 0.3, "b": 0.5}))
    assert score == pytest.approx((0.6 + 0.5) / 2)
    assert math.isnan(tuning_score("fedavg", {"model_selection": {}}))


def test_restricted_preset_and_time_rows():
    preset = restrict_preset(get_preset("cpu-converged"), tasks=("fundus",), seeds=(0,), main_only=True)
    assert [t.task for t in preset.tasks] == ["fundus"] and preset.seeds == (0,)
    assert not preset.perf and not preset.lr_grid and not preset.analysis_seeds
    with pytest.raises(ConfigError, match="no task"):
        restrict_preset(preset, tasks=("brain",))
    lean = restrict_preset(get_preset("cpu-converged"), no_analyses=True)
    assert lean.perf and lean.lr_grid and lean.seeds == (0, 1, 2) and len(lean.methods) == 7
    assert not (lean.unseen_analysis or lean.lam_values or lean.personalizations or lean.split_seeds)
    from engine.bench.plan import plan_jobs

    assert {j.analysis for j in plan_jobs(lean)} == {"perf", "tune", "main"}
    results = {JobKey("fundus", "main", "fedsm", 0): {"job_wall_s": 300.0, "validation_s": 30.0},
               JobKey("fundus", "main", "fedavg", 0): {"job_wall_s": 100.0, "validation_s": 5.0}}
    rows = time_rows(results, "fundus")
    assert [r["method"] for r in rows] == ["fedsm", "fedavg"]
    assert rows[0]["share"] == pytest.approx(0.75) and rows[0]["validation_s"] == pytest.approx(30.0)


def test_cpu_converged_plan_tunes_first():
    from engine.bench.plan import plan_jobs

    jobs = plan_jobs(get_preset("cpu-converged"))
    first_main = next(i for i, j in enumerate(jobs) if j.analysis == "main")
    assert all(j.analysis in ("perf", "tune") for j in jobs[:first_main])
    assert sum(j.analysis == "main" for j in jobs) == 7 * 2 * 3


def test_recipe_section_survives_a_regeneration_for_another_preset(tmp_path):
    from engine.bench.report import RECIPE_END, RECIPE_START, _read_reading, _read_recipe

    target = tmp_path / "results.md"
    target.write_text("# Benchmark results: preset `cpu-small`\n\n<!-- reading:start -->\nCPU reading.\n"
                      f"<!-- reading:end -->\n\n## Convergence recipe\n\n{RECIPE_START}\nMeasured recipe.\n"
                      f"{RECIPE_END}\n")
    assert "CPU reading." not in _read_reading(target, "cpu-converged")  # the reading belongs to its preset
    assert _read_recipe(target) == "Measured recipe."  # the recipe study is kept for every preset
    assert _read_recipe(tmp_path / "missing.md") is None
