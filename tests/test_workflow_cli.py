"""A site's own data end to end through the CLI: datalists -> simulate -> evaluate / infer."""

from __future__ import annotations

import json
from pathlib import Path

from testsupport import write_photo_site

from engine.cli.main import main


def make_sites(root: Path) -> list[Path]:
    """Two real-format photo sites (PNG photos + ORIGA masks) with their datalists built by the CLI."""
    out = []
    for k, name in enumerate(("east", "west")):
        site = write_photo_site(root / name, [f"{name}{i}" for i in range(5)], size=32 + 8 * k)
        assert main(["datalist", "--images", str(site / "images"), "--masks", str(site / "masks"),
                     "--out", str(site / "datalist.json"), "--split", "0.6,0.2,0.2", "--seed", "1"]) == 0
        out.append(site / "datalist.json")
    return out


def test_simulate_trains_on_real_datalists_and_never_writes_into_the_data(tmp_path, capsys):
    # Prepare
    make_sites(tmp_path / "data")
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*"))
    # Execute
    code = main(["simulate", "--task", "fundus", "--data", str(tmp_path / "data"), "--rounds", "1",
                 "--image-size", "32", "--methods", "fedavg", "--batch-size", "4", "--device", "cpu",
                 "--out", str(tmp_path / "run")])
    # Assert: the two real sites, by their datalist names, with their own split sizes; data folder untouched
    assert code == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [s["name"] for s in report["sites"]] == ["east", "west"]
    assert [s["train"]["cases"] for s in report["sites"]] == [3, 3]
    assert report["config"]["sites"] == 2 and len(report["config"]["datalists"]) == 2
    assert set(report["methods"]["fedavg"]["dice"]) == {"east", "west"}
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*")) == before
    assert not (tmp_path / "run" / "data").exists()


def test_simulate_refuses_a_folder_without_datalists(tmp_path, capsys):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.png").write_bytes(b"")
    assert main(["simulate", "--task", "fundus", "--data", str(tmp_path / "photos"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no datalist" in err and "fedsm datalist" in err
    assert sorted(p.name for p in (tmp_path / "photos").iterdir()) == ["a.png"]
    assert main(["simulate", "--task", "fundus", "--data", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]) == 2
    assert "absent: not found" in capsys.readouterr().err


def test_simulate_refuses_datalists_naming_files_outside_without_allow_outside(tmp_path, capsys):
    site = write_photo_site(tmp_path / "photos", ["a", "b", "c"])
    assert main(["datalist", "--images", str(site / "images"), "--masks", str(site / "masks"), "--allow-outside",
                 "--out", str(tmp_path / "lists" / "s1" / "datalist.json")]) == 0
    code = main(["simulate", "--task", "fundus", "--data", str(tmp_path / "lists"), "--out", str(tmp_path / "o"),
                 "--rounds", "1", "--methods", "local", "--image-size", "32"])
    assert code == 2 and "--allow-outside" in capsys.readouterr().err
