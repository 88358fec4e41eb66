"""Benchmark cache, job plan, presets and the simulation's round hook."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.bench.bench_simulation import effective_lam, sweep_lam
from engine.bench.cache import ENGINE_DIR, RESULT_SOURCES, JobKey, ResultCache, code_version, source_fingerprint
from engine.bench.jobs import job_settings
from engine.bench.plan import lam_label, plan_jobs
from engine.bench.presets import MAIN_METHODS, get_preset
from engine.bench.tables import fmt, lam_rows, mean_std
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


def test_main_runs_raise_lam_to_one_over_k_but_the_sweep_trains_it_as_requested():
    assert effective_lam(0.1, 6) == pytest.approx(1 / 6)  # main runs: what `fedsm simulate` accepts
    assert effective_lam(0.5, 6) == 0.5
    assert sweep_lam(0.1) == 0.1  # sweep: the paper's Table 7 value, below 1/K = 0.167
    with pytest.raises(ConfigError):
        sweep_lam(1.2)
    jobs = plan_jobs(get_preset("cpu-small"))
    # 0.1 is its own job for both tasks (it is no longer silently the same as 1/K)
    assert {(j.task, j.method) for j in jobs if j.analysis == "lam" and j.method == lam_label(0.1)} == {
        ("fundus", "lam0.10"), ("prostate", "lam0.10")}


def test_bench_simulation_trains_softpull_with_lam_below_one_over_k(tmp_path):
    from engine.bench.bench_simulation import BenchSimulation
    from engine.data.site_data import SiteData
    from engine.simulate import SimulationConfig

    sites = [SiteData(f"s{k}", random_split(2, seed=k), random_split(1, seed=10 + k), random_split(1, seed=20 + k))
             for k in range(3)]
    cfg = SimulationConfig(task="fundus", sites=3, rounds=1, methods=("fedsm",), image_size=32, lam=1 / 3,
                           device="cpu")
    sim = BenchSimulation(cfg, tmp_path, sites, softpull_lam=0.1)
    method = sim._build_method("fedsm")
    assert method.lam == 0.1 and sim.lam_used == 0.1  # used by SoftPull and recorded as used
    # SoftPull with lam 0.1 < 1/3: s0 <- 0.1 * s0 + 0.45 * (s1 + s2)
    from engine.fl.methods import SiteUpdate

    state = method.initial_state()
    ones = {k: torch.ones_like(v) if v.dtype.is_floating_point else v for k, v in state["global"].items()}
    updates = {f"s{k}": SiteUpdate({"global": state["global"], "selector": state["selector"],
                                    "selector_optim": state["selector_optim"],
                                    "personal": {n: v * k if v.dtype.is_floating_point else v
                                                 for n, v in ones.items()}}, 2) for k in range(3)}
    new = method.aggregate(state, 1, updates)
    key = next(k for k, v in ones.items() if v.dtype.is_floating_point)
    assert float(new["personal/s0"][key].flatten()[0]) == pytest.approx(0.45 * (1 + 2))
    assert float(new["personal/s2"][key].flatten()[0]) == pytest.approx(0.1 * 2 + 0.45 * 1)
    # without softpull_lam the engine's own check still applies
    with pytest.raises(ConfigError):
        BenchSimulation(cfg, tmp_path, sites, softpull_lam=1.5)


def _fedsm_result(mean: float, lam: float | None = None) -> dict:
    comp = {"client_average": {"mean": mean}}
    out = {"client_average": {"mean": mean}, "extra": {"lam": lam, "components": {"global_only": comp,
                                                                                  "personal_oracle": comp}}}
    if lam is not None:
        out |= {"lam": lam, "lam_used": lam}
    return out


def test_lam_rows_report_requested_and_used_lam_and_their_jobs():
    results = {JobKey("fundus", "lam", "lam0.10", 0): _fedsm_result(0.3, 0.1),
               JobKey("fundus", "main", "fedsm", 0): _fedsm_result(0.4, 0.7) | {"extra": {
                   "lam": 0.7, "components": {"global_only": {"client_average": {"mean": 0.5}},
                                              "personal_oracle": {"client_average": {"mean": 0.4}}}}}}
    rows = lam_rows(results, "fundus", 0.7, 6, (0.1, 0.3, 0.7), (0,))
    assert [(r["lam"], r["lam_used"], r["seeds"]) for r in rows] == [(0.1, [0.1], [0]), (0.3, [0.3], []),
                                                                    (0.7, [0.7], [0])]
    assert rows[0]["keys"] == [JobKey("fundus", "lam", "lam0.10", 0)]
    assert rows[2]["keys"] == [JobKey("fundus", "main", "fedsm", 0)]  # read from the main run
    assert rows[0]["routed"] == (0.3, 0.0, 1) and rows[2]["global_only"] == (0.5, 0.0, 1)

    from engine.bench.report import _lam_used

    assert _lam_used(rows[0]) == "0.100 (< 1/K)"
    assert _lam_used(rows[1]) == "0.300 (planned)"
    assert _lam_used(rows[2]) == "0.700"


def test_code_fingerprint_ignores_docstrings_and_comments_but_not_code(tmp_path):
    pkg = tmp_path / "fl"
    pkg.mkdir()
    (pkg / "a.py").write_text('"""Doc."""\n\ndef f(x):\n    """Twice."""\n    return 2 * x  # comment\n')
    base = source_fingerprint(tmp_path, ("fl", "tasks.py"))
    (pkg / "a.py").write_text('"""Other doc."""\n\n\ndef f(x):\n    return 2 * x\n')
    assert source_fingerprint(tmp_path, ("fl", "tasks.py")) == base
    (pkg / "a.py").write_text('def f(x):\n    return 3 * x\n')
    changed = source_fingerprint(tmp_path, ("fl", "tasks.py"))
    assert changed != base
    (tmp_path / "tasks.py").write_text("X = 1\n")  # a listed file that appears
    assert source_fingerprint(tmp_path, ("fl", "tasks.py")) != changed


def test_code_version_covers_the_result_modules_and_packages():
    for entry in RESULT_SOURCES:
        assert (ENGINE_DIR / entry).exists(), entry  # a renamed module must not drop out silently
    assert "fl" in RESULT_SOURCES and "bench/jobs.py" in RESULT_SOURCES and "bench/report.py" not in RESULT_SOURCES
    version = code_version()
    assert len(version["fingerprint"]) == 16 and version["torch"] and version["monai"]
    import torch as _torch

    assert version["torch"].split("+")[0] == _torch.__version__.split("+")[0]


def test_changing_the_code_fingerprint_invalidates_the_cache_entry(tmp_path, monkeypatch):
    from engine.bench import jobs

    preset = get_preset("tiny")
    tp = preset.task("fundus")
    key = JobKey("fundus", "main", "fedavg", 0)
    cache = ResultCache(tmp_path)
    settings = job_settings(preset, tp, key, "cpu")
    assert settings["code"] == code_version()
    cache.save(key, settings, {"x": 1})
    assert cache.load(key, job_settings(preset, tp, key, "cpu")) is not None
    monkeypatch.setattr(jobs, "code_version", lambda: {**code_version(), "fingerprint": "0" * 16})
    assert cache.load(key, job_settings(preset, tp, key, "cpu")) is None  # other code: the job runs again
    monkeypatch.setattr(jobs, "code_version", lambda: {**code_version(), "torch": "0.0.1"})
    assert cache.load(key, job_settings(preset, tp, key, "cpu")) is None  # other torch: the job runs again


def test_settings_record_the_resolved_device():
    import torch as _torch

    from engine.bench.perf import perf_settings

    preset = get_preset("tiny")
    expected = "cuda" if _torch.cuda.is_available() else "cpu"
    assert job_settings(preset, preset.task("fundus"), JobKey("fundus", "main", "fedsm", 0), "auto")["device"] \
        == expected
    assert perf_settings(preset, "auto")["device"] == expected


def test_cache_stores_provenance_and_report_summarises_it(tmp_path):
    from engine.bench.plan import machine_label
    from engine.bench.report import provenance_line, provenance_summary
    from engine.bench.runner import machine_info

    cache = ResultCache(tmp_path)
    a, b, c = (JobKey("fundus", "main", m, 0) for m in ("fedavg", "fedsm", "local"))
    m1 = machine_info("cpu", 1)
    m2 = {**m1, "device": "cuda", "gpu": "Some GPU"}
    cache.save(a, {}, {"x": 1}, provenance={"machine": m1, "finished": "2026-01-01T10:00:00+00:00"})
    cache.save(b, {}, {"x": 2}, provenance={"machine": m2, "finished": "2026-01-03T10:00:00+00:00"})
    cache.save(c, {}, {"x": 3})  # an old entry without provenance
    docs = {k: cache.load(k, {}) for k in (a, b, c)}
    assert docs[a]["provenance"]["machine"]["device"] == "cpu"
    assert docs[a]["result"] == {"x": 1}
    p = provenance_summary([a, b], docs)
    assert p == {"jobs": 2, "machines": {machine_label(m1): 1, machine_label(m2): 1},
                 "unrecorded": 0, "first": "2026-01-01T10:00:00+00:00", "last": "2026-01-03T10:00:00+00:00",
                 "untimed": 0}
    line = provenance_line([a, b, c], docs)[1]
    assert line.startswith("_Jobs behind this table: 3, run on 2 different machines:")
    assert "device cuda (Some GPU) (1 job(s))" in line and "machine not recorded (1 job(s))" in line
    assert "finished between 2026-01-01T10:00:00+00:00 and 2026-01-03T10:00:00+00:00 (1 without" in line
    assert provenance_line([a], docs)[1] == (f"_Jobs behind this table: 1, run on {machine_label(m1)}; "
                                             "finished 2026-01-01T10:00:00+00:00._")
    assert provenance_line([JobKey("x", "main", "y", 0)], docs) == []


def test_docs_refused_for_a_preset_other_than_cpu_small_or_paper(tmp_path, monkeypatch, capsys):
    from engine.cli import bench_command
    from engine.cli.main import main

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("published\n")
    monkeypatch.setattr(bench_command, "DOCS_DIR", docs)
    out = tmp_path / "out"
    # Execute
    rc = main(["bench", "--preset", "tiny", "--out", str(out), "--docs"])
    # Assert: a clear error before anything runs or is written
    err = capsys.readouterr().err
    assert rc == 2
    assert "--force-docs" in err and "--out" in err and "tiny" in err
    assert (docs / "results.md").read_text() == "published\n" and not out.exists()
    assert set(bench_command.DOCS_PRESETS) == {"cpu-small", "cpu-converged", "paper"}


def test_reading_of_another_preset_is_not_kept(tmp_path):
    from engine.bench.report import DEFAULT_READING, _read_reading

    target = tmp_path / "results.md"
    target.write_text("# Benchmark results: preset `cpu-small`\n\n<!-- reading:start -->\nCPU reading.\n"
                      "<!-- reading:end -->\n")
    assert _read_reading(target, "cpu-small") == "CPU reading."
    dropped = _read_reading(target, "tiny")
    assert "CPU reading." not in dropped and "cpu-small" in dropped
    assert _read_reading(tmp_path / "missing.md", "tiny") == DEFAULT_READING


def test_unknown_preset():
    with pytest.raises(ConfigError, match="cpu-small"):
        get_preset("huge")


def test_mean_std_and_format():
    assert mean_std([1.0, 3.0, None, float("nan")]) == (2.0, pytest.approx(np.sqrt(2)), 2)
    assert fmt(*mean_std([0.5])) == "0.5000"
    assert fmt(*mean_std([])) == "—"


def test_main_rows_reduce_each_method_over_its_seeds():
    # the tiny preset (the end-to-end smoke test) runs one seed: the reduction over several is checked here
    from engine.bench.cache import JobKey
    from engine.bench.tables import main_rows

    def result(dice: float, wall: float) -> dict:
        return {"client_average": {"disc": dice + 0.1, "cup": dice - 0.1, "mean": dice}, "pooled": {"mean": dice},
                "wall_s": wall, "bytes_per_round": {"site1": {"received_mean": 100.0, "sent_mean": 50.0}}}

    results = {JobKey("fundus", "main", "fedavg", 0): result(0.70, 10.0),
               JobKey("fundus", "main", "fedavg", 1): result(0.80, 12.0),
               JobKey("fundus", "main", "fedsm", 1): result(0.75, 30.0),
               JobKey("prostate", "main", "fedavg", 0): result(0.10, 1.0)}
    fedavg, fedsm = main_rows(results, "fundus", ["fedavg", "fedsm"], ["disc", "cup"])
    assert fedavg["seeds"] == [0, 1] and fedsm["seeds"] == [1]
    assert fedavg["mean"] == (pytest.approx(0.75), pytest.approx(np.std([0.7, 0.8], ddof=1)), 2)
    assert fmt(*fedavg["mean"]) == "0.7500 ± 0.0707" and fmt(*fedsm["mean"]) == "0.7500"
    assert fedavg["disc"][0] == pytest.approx(0.85) and fedavg["wall_s"][0] == pytest.approx(11.0)
    assert fedavg["received"][:2] == (100.0, 0.0)


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


def test_routing_rules_count_the_rule_each_fedsm_run_kept():
    from engine.bench.tables import routing_rules

    def run(choice):
        return {"extra": {"selector": {"routing_choice": choice} if choice is not None else {}}}

    runs = [run({"style": 1.0}), run({"style": 0.0}), run({"style": 1.0}), run(None)]
    assert routing_rules(runs) == "selector 2, style 2"
    assert routing_rules(runs[:1] + runs[2:3]) == "style 2"
    assert routing_rules([{"extra": {}}]) == "selector 1"  # FedSM-extra and older results: the selector
