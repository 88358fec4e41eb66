"""The whole benchmark machinery on the ``tiny`` preset: jobs, cache, resume, tables, plots, markdown."""

from __future__ import annotations

import json

import pytest

from engine.bench.presets import get_preset
from engine.bench.runner import plan_jobs
from engine.bench.tables import METHOD_TITLES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_tiny_preset_end_to_end_and_resume(tmp_path, monkeypatch, capsys):
    from engine.cli import bench_command
    from engine.cli.main import main

    # Prepare: docs go to a temporary folder, never into the repository
    docs = tmp_path / "docs"
    monkeypatch.setattr(bench_command, "DOCS_DIR", docs)
    out = tmp_path / "bench"
    preset = get_preset("tiny")

    # Execute
    assert main(["bench", "--preset", "tiny", "--out", str(out), "--device", "cpu"]) == 0

    # Assert: every job cached, report with every method and seed, plots are PNG files
    assert len(list((out / "results").rglob("*.json"))) == len(plan_jobs(preset))
    md = (out / "report" / "results.md").read_text(encoding="utf-8")
    for method in preset.methods:
        assert f"| {METHOD_TITLES[method]} |" in md
    assert md.count("| 0, 1 |") >= 2 * len(preset.methods)  # seeds column, both tasks
    for section in ("lam sweep", "unseen site", "personalization inside FedSM", "Speed, traffic and memory",
                    "CUDA with mixed precision: not measured", "FedSM + APFL", "FedSM + pFedMe"):
        assert section in md, section
    assert f"Jobs completed: {len(plan_jobs(preset))} of {len(plan_jobs(preset))}." in md
    images = sorted((out / "report" / "img").glob("*.png"))
    assert {p.name for p in images} >= {"main-fundus.png", "main-prostate.png", "curves-fundus.png",
                                        "curves-prostate.png", "gamma-fundus.png", "lam-prostate.png"}
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in images)
    for p in images:
        assert f"(img/{p.name})" in md
    assert not docs.exists()

    # Execute again with --docs: everything comes from the cache, a hand-written reading survives
    capsys.readouterr()
    docs.mkdir()
    (docs / "results.md").write_text("<!-- reading:start -->\nFedSM reads well.\n<!-- reading:end -->\n")
    assert main(["bench", "--preset", "tiny", "--out", str(out), "--device", "cpu", "--docs"]) == 0
    assert "0 job(s) run" in capsys.readouterr().out
    doc_md = (docs / "results.md").read_text(encoding="utf-8")
    assert "FedSM reads well." in doc_md
    assert "(img/results/main-fundus.png)" in doc_md and (docs / "img" / "results" / "main-fundus.png").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["ran"] == [] and summary["machine"]["torch_threads"] == 1
