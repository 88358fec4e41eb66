"""fedsm datalist: images paired with masks by name, split by case with a seed, paths kept inside the folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from testsupport import SHARED_DATA, write_photo_site

from engine.cli.main import main
from engine.data.datalist import load_datalist_with_info
from engine.data.datalist_builder import build_datalist, find_datalists, split_cases
from engine.errors import DataError


def test_pairs_by_name_splits_by_case_and_is_seeded(tmp_path):
    # Prepare: 10 images of 5 patients ("p1_a", "p1_b", ...), masks named "<stem>_mask.png", one image unlabelled
    stems = [f"p{p}_{v}" for p in range(5) for v in "ab"]
    site = write_photo_site(tmp_path / "site", stems, mask_name="{stem}_mask.png")
    Image.new("RGB", (24, 24)).save(site / "images" / "lonely.png")
    (site / "masks" / "notes.txt").write_text("not a mask")
    # Execute
    first = build_datalist(site / "images", site / "masks", site / "datalist.json", case_pattern=r"^(p\d+)_",
                           split=(0.6, 0.2, 0.2), seed=3)
    text = (site / "datalist.json").read_bytes()
    build_datalist(site / "images", site / "masks", site / "datalist.json", case_pattern=r"^(p\d+)_",
                   split=(0.6, 0.2, 0.2), seed=3)
    sections, info = load_datalist_with_info(site / "datalist.json")
    # Assert: every labelled image once, both images of a patient in one section, same seed -> same bytes
    assert (site / "datalist.json").read_bytes() == text
    assert first.counts == {"training": 6, "validation": 2, "testing": 2}
    assert first.unmatched == [site / "images" / "lonely.png"]
    assert info == {"name": "site", "task": "fundus", "label_convention": "origa"}
    listed = [e["image"].name for s in sections.values() for e in s]
    assert sorted(listed) == sorted(f"{s}.png" for s in stems)
    for entries in sections.values():
        for e in entries:
            assert e["label"].name == e["image"].name.replace(".png", "_mask.png")
    section_of = {e["case"]: k for k, entries in sections.items() for e in entries}
    assert len(section_of) == 5 and all(
        sum(e["case"] == c for s in sections.values() for e in s) == 2 for c in section_of)
    other = build_datalist(site / "images", site / "masks", tmp_path / "site" / "other.json",
                           case_pattern=r"^(p\d+)_", seed=4)
    assert other.counts == first.counts


def test_split_cases_shares_and_minimums():
    assert [split_cases(list("abcdef"), (0.5, 0.17, 0.33), 0).count(i) for i in range(3)] == [3, 1, 2]
    assert [split_cases(list("ab"), (0.6, 0.2, 0.2), 0).count(i) for i in range(3)] == [1, 1, 0]
    assert split_cases(list("abc"), (1, 0, 0), 0) == [0, 0, 0]
    assert split_cases(list("abcdefgh"), (0.6, 0.2, 0.2), 1) == split_cases(list("abcdefgh"), (0.6, 0.2, 0.2), 1)


def test_ambiguous_missing_and_outside_are_clear_errors(tmp_path):
    site = write_photo_site(tmp_path / "site", ["a", "b"], mask_name="{stem}_seg.png")
    Image.fromarray(np.zeros((24, 24), np.uint8)).save(site / "masks" / "a_old.png")
    with pytest.raises(DataError, match=r"several masks match this image .*--mask-suffix"):
        build_datalist(site / "images", site / "masks", site / "dl.json")
    result = build_datalist(site / "images", site / "masks", site / "dl.json", mask_suffix="_seg")
    assert result.counts["training"] + result.counts["validation"] + result.counts["testing"] == 2
    with pytest.raises(DataError, match=r"lies outside the datalist's folder .*--allow-outside"):
        build_datalist(site / "images", site / "masks", tmp_path / "elsewhere" / "dl.json", mask_suffix="_seg")
    with pytest.raises(DataError, match="image folder not found"):
        build_datalist(site / "nope", site / "masks", site / "dl.json")
    with pytest.raises(DataError, match=r"no image in .* has a mask"):
        build_datalist(site / "images", site / "masks", site / "dl.json", mask_suffix="_x")


def test_find_datalists_skips_other_json_and_refuses_empty_folders(tmp_path):
    for name in ("b", "a"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "datalist.json").write_text(json.dumps({"training": []}))
    (tmp_path / "federation.json").write_text(json.dumps({"task": "fundus"}))
    (tmp_path / "empty").mkdir()
    assert find_datalists([tmp_path]) == [tmp_path / "a" / "datalist.json", tmp_path / "b" / "datalist.json"]
    with pytest.raises(DataError, match=r"holds no datalist .*fedsm datalist"):
        find_datalists([tmp_path / "empty"])


def test_cli_builds_drishti_datalist_from_the_real_files(tmp_path, capsys):
    drishti = SHARED_DATA / "fundus" / "DrishtiGS1"
    if not drishti.is_dir():
        pytest.skip("real Drishti-GS1 files absent (../shared/data)")
    # Execute: the cup maps and the .txt files beside the disc maps must not count as masks
    code = main(["datalist", "--images", str(drishti / "images"), "--masks", str(drishti / "masks"),
                 "--out", str(tmp_path / "drishti" / "datalist.json"), "--split", "0.5,0,0.5", "--allow-outside"])
    # Assert
    assert code == 0
    assert "task fundus, labels drishti; training 1, validation 0, testing 1" in capsys.readouterr().out
    raw = json.loads((tmp_path / "drishti" / "datalist.json").read_text())
    assert all(e["label"].endswith("_ODsegSoftmap.png") for s in ("training", "testing") for e in raw[s])
    assert main(["validate-data", "--allow-outside", str(tmp_path / "drishti" / "datalist.json")]) == 0
