"""``fedsm validate-data`` and ``engine.api.validate_data`` on synthetic sites and broken copies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from PIL import Image

from engine import api
from engine.cli.main import main
from engine.data.datalist import load_datalist, outside_paths_allowed, write_datalist
from engine.errors import ConfigError


@pytest.fixture(scope="module")
def fundus_sites(tmp_path_factory) -> list[Path]:
    return api.synthesize("fundus", 2, tmp_path_factory.mktemp("fundus"), image_size=32, seed=0)


@pytest.fixture(scope="module")
def prostate_site(tmp_path_factory) -> Path:
    return api.synthesize("prostate", 2, tmp_path_factory.mktemp("prostate"), image_size=32, seed=0)[0]


def _broken_copy(site: Path, target: Path) -> Path:
    """site1 with a missing mask, a mask of the wrong size, foreign label values and a truncated image."""
    shutil.copytree(site.parent, target)
    datalist = target / site.name
    training = load_datalist(datalist)["training"]
    training[0]["label"].unlink()
    Image.fromarray(np.zeros((20, 24), np.uint8)).save(training[1]["label"])
    Image.fromarray(np.full((32, 32), 7, np.uint8)).save(training[2]["label"])
    data = training[3]["image"].read_bytes()
    training[3]["image"].write_bytes(data[: len(data) // 3])
    return datalist


def test_synthetic_sites_are_valid(fundus_sites: list[Path]) -> None:
    report = api.validate_data(fundus_sites)
    json.dumps(report)  # plain data
    assert report["ok"] is True and report["problems"] == 0
    assert [s["name"] for s in report["sites"]] == ["site1", "site2"]
    site1 = report["sites"][0]
    assert site1["task"] == "fundus" and site1["convention"] == "origa"
    assert site1["counts"] == {"training": {"cases": 4, "ok": 4}, "validation": {"cases": 2, "ok": 2},
                               "testing": {"cases": 2, "ok": 2}}
    assert len(report["files"]) == 8 + 12
    row = report["files"][0]
    assert row["ok"] and row["split"] == "training" and row["values"] == [0, 1, 2] and row["shape"] == [32, 32]
    assert row["file"] == row["image"] and row["label"].endswith(".png")


def test_prostate_counts_slices(prostate_site: Path) -> None:
    report = api.validate_data([prostate_site], task="prostate")
    assert report["ok"]
    counts = report["sites"][0]["counts"]["training"]
    assert counts["slices"] == counts["cases"] * 12 and report["sites"][0]["convention"] == "binary"


def test_broken_copy_lists_every_problem_per_file(fundus_sites: list[Path], tmp_path: Path) -> None:
    datalist = _broken_copy(fundus_sites[0], tmp_path / "broken")
    report = api.validate_data([datalist])
    assert report["ok"] is False
    rows = {row["index"]: row for row in report["files"] if row["split"] == "training"}
    assert "mask not found" in rows[0]["problems"][0]
    assert "24x20" in rows[1]["problems"][0] and "32x32" in rows[1]["problems"][0]
    assert "values [7]" in rows[2]["problems"][0]
    assert rows[3]["problems"][0].startswith("image:") and "case" in rows[3]["problems"][0]
    assert report["sites"][0]["counts"]["training"] == {"cases": 4, "ok": 0}
    assert all(r["ok"] for r in report["files"] if r["split"] != "training")
    assert "4 with problems" in report["summary"] and "fix the files marked" in report["summary"]


def test_cli_exit_status_and_output(fundus_sites: list[Path], tmp_path: Path, capsys) -> None:
    # Good sites: exit 0, per-site counts
    assert main(["validate-data", *map(str, fundus_sites)]) == 0
    out = capsys.readouterr().out
    assert "site1 (fundus, labels origa)" in out and "training 4 case(s); validation 2 case(s)" in out
    assert out.strip().endswith("ready to train")
    # Broken copy: exit 1 and one PROBLEM line per bad entry, with paths relative to the datalist
    datalist = _broken_copy(fundus_sites[0], tmp_path / "broken")
    assert main(["validate-data", str(datalist)]) == 1
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if "PROBLEM" in line]
    assert len(problems) == 4
    assert problems[0].startswith("  PROBLEM training[0] images/") and "mask not found" in problems[0]
    # JSON: the same report
    assert main(["validate-data", "--json", str(datalist)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["problems"] == 4


def test_task_and_convention_options(fundus_sites: list[Path], capsys) -> None:
    assert main(["validate-data", "--task", "prostate", str(fundus_sites[0])]) == 1
    out = capsys.readouterr().out
    assert "is for task 'fundus', not 'prostate'" in out
    assert main(["validate-data", "--convention", "binary", str(fundus_sites[0])]) == 1
    assert "does not suit the fundus task" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["validate-data", "--convention", "voc", str(fundus_sites[0])])
    assert info.value.code == 2
    with pytest.raises(ConfigError):
        api.validate_data(fundus_sites, convention="voc")


def test_duplicates_empty_masks_and_missing_datalist(fundus_sites: list[Path], tmp_path: Path) -> None:
    sections = load_datalist(fundus_sites[0])
    first = sections["training"][0]
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(tmp_path / "empty.png")
    again = {"image": first["image"], "label": tmp_path / "empty.png"}
    write_datalist(tmp_path / "dl.json", {"training": [first, again], "testing": [first]}, info={"task": "fundus"})
    with outside_paths_allowed():  # the entries name the fixture's files beside tmp_path
        report = api.validate_data([tmp_path / "dl.json", tmp_path / "absent.json"])
    rows = report["files"]
    assert rows[0]["ok"] and not rows[0]["warnings"]
    assert any("listed twice" in p for p in rows[1]["problems"]) and any("empty" in w for w in rows[1]["warnings"])
    assert any("listed twice (training[0] and testing[0])" in p for p in rows[2]["problems"])
    assert "datalist not found" in report["sites"][1]["problems"][0]
    assert "1 datalist(s) with problems" in report["summary"]


def test_volume_problems_partial_and_multilabel_masks(prostate_site: Path, tmp_path: Path) -> None:
    entry = load_datalist(prostate_site)["training"][0]
    image = nib.load(entry["image"])
    label = np.asarray(nib.load(entry["label"]).dataobj)
    nib.save(nib.Nifti1Image(label[:, :, :6], image.affine), tmp_path / "part.nii.gz")  # first 6 of 12 slices
    zones = label.astype(np.uint8)
    zones[: label.shape[0] // 2][zones[: label.shape[0] // 2] > 0] = 2  # two structures: 1 and 2
    nib.save(nib.Nifti1Image(zones, image.affine), tmp_path / "multi.nii.gz")
    shutil.copy(entry["image"], tmp_path / "image2.nii.gz")  # one image per entry: no duplicate
    write_datalist(tmp_path / "dl.json", {"training": [{"image": entry["image"], "label": tmp_path / "part.nii.gz"},
                                                       {"image": tmp_path / "image2.nii.gz",
                                                        "label": tmp_path / "multi.nii.gz"}]})
    with outside_paths_allowed():
        report = api.validate_data([tmp_path / "dl.json"], task="prostate")
        multilabel = api.validate_data([tmp_path / "dl.json"], task="prostate", convention="multilabel")
    part, multi = report["files"]
    assert "covers only part" in part["problems"][0] and "k 0..5 of 12" in part["problems"][0]
    assert multi["values"] == [0, 1, 2] and "several non-zero values [1, 2]" in multi["problems"][0]
    assert multilabel["files"][1]["ok"] and multilabel["sites"][0]["convention"] == "multilabel"


def test_a_truncated_dicom_seg_is_a_problem_line_not_a_crash(tmp_path: Path, capsys) -> None:
    # Prepare: two synthetic DICOM series with a SEG each; the second SEG cut in its pixel data
    from synthetic_dicom import write_series

    from engine.io.dicom_seg import write_dicom_seg
    from engine.io.readers import open_study
    from engine.io.study import LabelMap

    entries = []
    for case in (1, 2):
        write_series(tmp_path / f"case{case}", seed=case)
        study = open_study(tmp_path / f"case{case}")
        mask = np.zeros(study.shape, np.uint8)
        mask[3:8, 2:7, 1:3] = 1
        seg = write_dicom_seg(study, LabelMap(mask, {1: "prostate"}), tmp_path / f"seg{case}.dcm")
        entries.append({"image": tmp_path / f"case{case}", "label": seg})
    data = (tmp_path / "seg2.dcm").read_bytes()
    (tmp_path / "seg2.dcm").write_bytes(data[:-10])
    write_datalist(tmp_path / "dl.json", {"training": entries}, info={"task": "prostate"})
    # Execute
    status = main(["validate-data", str(tmp_path / "dl.json")])
    # Assert: exit 1, one PROBLEM line naming the SEG and saying it is truncated
    out = capsys.readouterr().out
    problems = [line for line in out.splitlines() if "PROBLEM" in line]
    assert status == 1 and len(problems) == 1
    assert problems[0].startswith("  PROBLEM training[1]") and "seg2.dcm" in problems[0]
    assert "truncated" in problems[0] and "copy" in problems[0]


def test_an_unexpected_reader_error_is_a_problem_of_its_entry(fundus_sites: list[Path], monkeypatch,
                                                              caplog) -> None:
    # A reader bug (not a DataError) on one mask: reported on the entries, the check goes on
    import engine.io.masks

    def buggy(path, study, convention=None, allow_partial=True):
        raise RuntimeError(f"boom in {Path(path).name}")

    monkeypatch.setattr(engine.io.masks, "read_mask", buggy)
    report = api.validate_data([fundus_sites[0]])
    assert report["ok"] is False and len(report["files"]) == 8
    row = report["files"][0]
    assert row["problems"][0].startswith(f"mask: {row['label']}: cannot be read (RuntimeError: boom in ")
    assert "report this message to the FedSM developers" in row["problems"][0]
    assert any(r.exc_info and r.exc_info[0] is RuntimeError for r in caplog.records)  # traceback kept in the log
