"""Benchmark cache, job plan, presets and the simulation's round hook."""

from __future__ import annotations

import numpy as np
import pytest
from testsupport import random_split

from engine.bench.cache import JobKey, ResultCache
from engine.bench.jobs import effective_lam
from engine.bench.presets import MAIN_METHODS, get_preset
from engine.bench.runner import lam_label, plan_jobs
from engine.bench.tables import fmt, mean_std
from engine.errors import ConfigError


def test_cache_round_trip_and_settings_check(tmp_path):
    cache = ResultCache(tmp_path)
    key = JobKey("fundus", "main", "fedsm", 2)
    assert cache.load(key, {"a": 1}) is None
    cache.save(key, {"a": 1, "t": (1, 2)}, {"dice": float("nan"), "x": 0.5})
    doc = cache.load(key, {"a": 1, "t": (1, 2)})
    assert doc is not None and doc["result"] == {"dice": None, "x": 0.5}
    assert cache.path(key) == tmp_path / "fundus" / "main" / "fedsm-seed2.json"
    assert cache.load(key, {"a": 2, "t": (1, 2)}) is None  # other settings: the job runs again


def test_cache_ignores_corrupt_file(tmp_path):
    cache = ResultCache(tmp_path)
    key = JobKey("prostate", "lam", "lam0.30", 0)
    cache.path(key).parent.mkdir(parents=True)
    cache.path(key).write_text("{ truncated")
    assert cache.load(key, {}) is None


def test_plan_order_and_lam_reuse():
    preset = get_preset("cpu-small")
    jobs = plan_jobs(preset)
    assert jobs[0].analysis == "perf"
    main = [j for j in jobs if j.analysis == "main"]
    assert len(main) == len(preset.seeds) * len(preset.tasks) * len(MAIN_METHODS)
    assert [j.seed for j in main] == sorted(j.seed for j in main)  # seed by seed, so partial runs have whole seeds
    assert max(jobs.index(j) for j in main) < min(jobs.index(j) for j in jobs if j.analysis not in ("main", "perf"))
    lam = {(j.task, j.method) for j in jobs if j.analysis == "lam"}
    # the main runs' lam (0.7 fundus, 0.3 prostate) is not trained twice
    assert ("fundus", lam_label(0.7)) not in lam and ("prostate", lam_label(0.3)) not in lam
    assert ("fundus", lam_label(0.3)) in lam and ("prostate", lam_label(0.7)) in lam
    assert len(set(jobs)) == len(jobs)


def test_lam_below_one_over_k_is_raised():
    assert effective_lam(0.1, 6) == pytest.approx(1 / 6)
    assert effective_lam(0.5, 6) == 0.5


def test_unknown_preset():
    with pytest.raises(ConfigError, match="cpu-small"):
        get_preset("huge")


def test_mean_std_and_format():
    assert mean_std([1.0, 3.0, None, float("nan")]) == (2.0, pytest.approx(np.sqrt(2)), 2)
    assert fmt(*mean_std([0.5])) == "0.5000"
    assert fmt(*mean_std([])) == "—"


def test_round_hook_sees_every_round_and_changes_nothing(tmp_path):
    from engine.data.site_data import SiteData
    from engine.simulate import Simulation, SimulationConfig

    sites = [SiteData(f"s{k}", random_split(4, seed=k), random_split(2, seed=10 + k), random_split(2, seed=20 + k))
             for k in range(2)]
    cfg = SimulationConfig(task="fundus", sites=2, rounds=2, methods=("fedavg",), image_size=32, batch_size=4,
                           device="cpu")
    results, seen = [], []
    for hook in (None, lambda method, rnd, state, runtimes: seen.append((method.name, rnd, sorted(state)))):
        sim = Simulation(cfg, tmp_path)
        sim.sites = sites
        sim.round_hook = hook
        results.append(sim.run_method("fedavg"))
    assert results[0].dice == results[1].dice
    assert seen == [("fedavg", 1, ["global"]), ("fedavg", 2, ["global"])]
