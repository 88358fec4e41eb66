"""The whole benchmark machinery on the ``tiny`` preset: jobs, cache, resume, tables, plots, markdown."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest

from engine.bench.plan import lam_label, plan_jobs
from engine.bench.presets import get_preset
from engine.bench.tables import METHOD_TITLES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DICE = r"\d\.\d{4}"


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def table_rows(md: str, heading: str) -> list[list[str]]:
    """Body rows (cells) of the first markdown table after the line starting with ``heading``."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    first = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("|"))
    rows = []
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.mark.slow
def test_tiny_preset_end_to_end_and_resume(tmp_path, monkeypatch, capsys):
    import matplotlib.image

    from engine.cli import bench_command
    from engine.cli.main import main

    # Prepare: docs go to a temporary folder, never into the repository
    docs = tmp_path / "docs"
    monkeypatch.setattr(bench_command, "DOCS_DIR", docs)
    out = tmp_path / "bench"
    preset = get_preset("tiny")
    planned = plan_jobs(preset)

    # Execute
    assert main(["bench", "--preset", "tiny", "--out", str(out), "--device", "cpu"]) == 0

    # Assert: every job cached, with the machine and finish time it ran with
    cached = {p.relative_to(out / "results").as_posix(): json.loads(p.read_text())
              for p in (out / "results").rglob("*.json")}
    assert len(cached) == len(planned)
    for doc in cached.values():
        assert doc["settings"]["code"]["fingerprint"] and doc["settings"]["code"]["torch"]
        assert doc["provenance"]["machine"]["device"] == "cpu"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", doc["provenance"]["finished"])
    perf = cached["all/perf/perf-seed0.json"]
    assert perf["settings"]["device"] == "cpu"
    assert perf["result"]["routed_inference_cpu"]["device"] == "cpu"

    # routing frequencies are distributions: per site over the K+1 models, for FedSM's own routing
    # and for every gamma of the sweeps; the selector's argmax shares on the unseen site too
    for task in ("fundus", "prostate"):
        fedsm = cached[f"{task}/main/fedsm-seed0.json"]["result"]
        assert set(fedsm["extra"]["routing"]) == {f"site{k + 1}" for k in range(3)}
        for freq in fedsm["extra"]["routing"].values():
            assert set(freq) == {"global", "site1", "site2", "site3"} and sum(freq.values()) == pytest.approx(1)
        assert [g["gamma"] for g in fedsm["gamma_sweep"]["gammas"]] == list(preset.gammas)
        for g in fedsm["gamma_sweep"]["gammas"]:
            for freq in g["routing"].values():
                assert sum(freq.values()) == pytest.approx(1)
        unseen = cached[f"{task}/unseen/fedsm-seed0.json"]["result"]
        for g in unseen["unseen"]["gammas"]:
            assert sum(g["routing"]["site3"].values()) == pytest.approx(1)
        assert sum(unseen["unseen"]["argmax"]["site3"].values()) == pytest.approx(1)
        # the lam sweep trains 0.2 < 1/K = 1/3 as requested (the paper sweeps below 1/K too)
        lam = cached[f"{task}/lam/{lam_label(0.2)}-seed0.json"]["result"]
        assert lam["lam"] == lam["lam_used"] == lam["extra"]["lam"] == pytest.approx(0.2)

    md = (out / "report" / "results.md").read_text(encoding="utf-8")
    # main tables: one row per method in preset order, client-average mean of the preset's one seed (the
    # "mean ± std" over several: test_bench_units.py)
    for task in ("fundus", "prostate"):
        rows = table_rows(md, f"### {task}: client-average test Dice")
        assert [r[0] for r in rows] == [METHOD_TITLES[m] for m in preset.methods]
        mean_col = -5  # ... | mean/Dice | pooled | paper | seeds | wall s
        for r in rows:
            assert re.fullmatch(DICE, r[mean_col]), r
            assert r[-2] == "0"
        assert all(0.0 <= float(r[mean_col].split(" ± ")[0]) <= 1.0 for r in rows)
        lam_rows = table_rows(md, f"### {task}: SoftPull lam sweep")
        assert [r[:2] for r in lam_rows] == [["0.20", "0.200 (< 1/K)"]]
        pers_rows = table_rows(md, f"### {task}: personalization inside FedSM")
        assert [r[0] for r in pers_rows] == ["FedSM + SoftPull (FedSM)", "FedSM + APFL"]
        assert all(r[-1] == "0" for r in pers_rows)
    # every table says which machine made its jobs and when
    jobs_lines = re.findall(r"_Jobs behind [^:]+: (\d+), run on ([^;]+); finished ([^._]+)", md)
    assert len(jobs_lines) == 4 * len(preset.tasks) + 1  # main, lam, gamma/unseen, personalization; perf
    assert {machine for _, machine, _ in jobs_lines} == {jobs_lines[0][1]} and "device cpu" in jobs_lines[0][1]
    assert jobs_lines[0][0] == str(len(preset.methods) * len(preset.seeds))  # fundus main: every method and seed
    assert f"- Jobs behind the tables: {len(planned)}, finished" in md
    for section in ("lam sweep", "unseen site", "personalization inside FedSM", "Speed, traffic and memory",
                    "CUDA with mixed precision: not measured", "FedSM + APFL",
                    "U-Nets (32 px, cpu)"):
        assert section in md, section
    assert f"Jobs completed: {len(planned)} of {len(planned)}." in md

    # plots: PNG files of a plausible size, not blank, and linked from the markdown
    images = sorted((out / "report" / "img").glob("*.png"))
    assert {p.name for p in images} >= {"main-fundus.png", "main-prostate.png", "curves-fundus.png",
                                        "curves-prostate.png", "gamma-fundus.png", "lam-prostate.png"}
    for p in images:
        width, height = png_size(p.read_bytes())
        assert 300 <= width <= 2000 and 200 <= height <= 1000, (p.name, width, height)
        pixels = matplotlib.image.imread(p)
        assert pixels.shape[:2] == (height, width) and float(np.std(pixels[..., :3])) > 0.01, p.name
        assert f"(img/{p.name})" in md
    assert not docs.exists()

    # Execute again with --docs: the tiny preset may not replace the published results ...
    capsys.readouterr()
    docs.mkdir()
    (docs / "results.md").write_text("# Benchmark results: preset `tiny`\n\n"
                                     "<!-- reading:start -->\nFedSM reads well.\n<!-- reading:end -->\n")
    assert main(["bench", "--preset", "tiny", "--out", str(out), "--device", "cpu", "--docs"]) == 2
    assert "--force-docs" in capsys.readouterr().err
    # ... unless forced; everything comes from the cache, a reading written for this preset survives
    assert main(["bench", "--preset", "tiny", "--out", str(out), "--device", "cpu", "--docs", "--force-docs",
                 "--threads", "1"]) == 0
    assert "0 job(s) run" in capsys.readouterr().out
    doc_md = (docs / "results.md").read_text(encoding="utf-8")
    assert "FedSM reads well." in doc_md
    assert "(img/results/main-fundus.png)" in doc_md and (docs / "img" / "results" / "main-fundus.png").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["ran"] == [] and summary["machine"]["torch_threads"] == 1
    # the cached jobs keep their own finish times; the regenerated file still reports them
    assert f"- Jobs behind the tables: {len(planned)}, finished" in doc_md
