"""Datalists: relative paths on disk, absolute paths in memory, clear errors for broken files."""

import json
from pathlib import Path

import pytest

from engine.data.datalist import (
    load_datalist,
    load_datalist_with_info,
    outside_paths_allowed,
    read_datalist_info,
    write_datalist,
)
from engine.data.datalist_schema import DATALIST_SCHEMA
from engine.errors import DataError


def test_round_trip_stores_relative_posix_paths_and_resolves_them(tmp_path):
    # Prepare: absolute paths inside the site folder and one beside it
    site = tmp_path / "site"
    shared = tmp_path / "shared" / "extra.png"
    sections = {
        "training": [{"image": site / "images" / "a.png", "label": str(site / "labels" / "a.png")}],
        "validation": [{"image": shared, "label": site / "labels" / "b.png"}],
        "testing": [{"image": "images/c.png", "label": "labels/c.png"}],
    }
    path = site / "datalist.json"
    # Execute
    write_datalist(path, sections, info={"name": "site1", "task": "fundus"})
    raw = json.loads(path.read_text())
    with outside_paths_allowed():  # "../shared" lies outside the site folder
        loaded = load_datalist(path)
    # Assert: on disk relative with "/", in memory absolute and equal to what was given
    assert raw["training"][0] == {"image": "images/a.png", "label": "labels/a.png"}
    assert raw["validation"][0]["image"] == "../shared/extra.png"
    assert raw["name"] == "site1" and raw["task"] == "fundus"
    assert list(raw) == ["name", "task", "training", "validation", "testing"]
    assert loaded["training"][0] == {"image": site / "images" / "a.png", "label": site / "labels" / "a.png"}
    assert loaded["validation"][0]["image"] == shared
    assert loaded["testing"][0]["label"] == site / "labels" / "c.png"
    assert all(p.is_absolute() for sec in loaded.values() for e in sec for p in e.values())


def test_moved_folder_still_resolves(tmp_path):
    # Prepare: a datalist written in one place, then the whole folder moved
    old = tmp_path / "old"
    write_datalist(old / "dl.json", {"training": [{"image": old / "i.png", "label": old / "l.png"}]})
    new = tmp_path / "new"
    old.rename(new)
    # Execute
    loaded = load_datalist(new / "dl.json")
    # Assert
    assert loaded["training"][0]["image"] == new / "i.png"


def test_write_is_atomic_and_byte_stable(tmp_path):
    # Prepare
    sections = {"training": [{"image": tmp_path / "i.png", "label": tmp_path / "l.png"}]}
    # Execute: write twice
    write_datalist(tmp_path / "dl.json", sections)
    first = (tmp_path / "dl.json").read_bytes()
    write_datalist(tmp_path / "dl.json", sections)
    # Assert: same bytes, no temporary files left behind
    assert (tmp_path / "dl.json").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dl.json"]


def test_missing_sections_are_absent_and_extra_keys_kept_as_strings(tmp_path):
    # Prepare: hand-written file with extra keys, a Decathlon-like labels table, Windows separators
    path = tmp_path / "dl.json"
    path.write_text(json.dumps({
        "name": "siteX", "numTraining": 1, "labels": {"0": "background"},
        "training": [{"image": "imgs\\a.nii.gz", "label": "lbl/a.nii.gz", "case": "a", "age": 61}],
    }))
    # Execute
    sections, info = load_datalist_with_info(path)
    # Assert
    assert set(sections) == {"training"}
    entry = sections["training"][0]
    assert entry["image"] == tmp_path / "imgs" / "a.nii.gz"
    assert entry["case"] == "a" and entry["age"] == "61"
    assert info == {"name": "siteX", "numTraining": 1}
    assert read_datalist_info(path) == info


def test_absolute_paths_in_file_are_kept(tmp_path):
    # Prepare
    target = tmp_path / "elsewhere" / "a.png"
    path = tmp_path / "dl.json"
    path.write_text(json.dumps({"training": [{"image": str(target), "label": str(target)}]}))
    # Execute / Assert
    with outside_paths_allowed():
        assert load_datalist(path)["training"][0]["image"] == target


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"validation": []}), "no 'training' section"),
        (json.dumps({"training": {"image": "a"}}), "must be a list"),
        (json.dumps({"training": ["a.png"]}), "training[0] must be an object"),
        (json.dumps({"training": [{"image": "a.png"}]}), "training[0] has no 'label'"),
        (json.dumps({"training": [{"label": "a.png"}]}), "has no 'image'"),
        (json.dumps({"training": [], "testing": [{"image": "", "label": "b"}]}), "testing[0].image"),
        (json.dumps({"training": [{"image": 3, "label": "b"}]}), "non-empty path string"),
    ],
)
def test_broken_datalists_raise_data_error_naming_the_file(tmp_path, content, message):
    # Prepare
    path = tmp_path / "broken.json"
    path.write_text(content)
    # Execute / Assert
    with pytest.raises(DataError, match=r"broken\.json") as info:
        load_datalist(path)
    assert message in str(info.value)


def test_missing_file_raises_data_error(tmp_path):
    with pytest.raises(DataError, match="datalist not found"):
        load_datalist(tmp_path / "nope.json")
    with pytest.raises(DataError, match="datalist not found"):
        read_datalist_info(tmp_path / "nope.json")


def test_write_refuses_entries_without_image_or_label(tmp_path):
    with pytest.raises(DataError, match="has no 'label'"):
        write_datalist(tmp_path / "dl.json", {"training": [{"image": "a.png"}]})
    with pytest.raises(DataError, match="must be a list"):
        write_datalist(tmp_path / "dl.json", {"training": {"image": "a.png", "label": "b.png"}})
    assert not (tmp_path / "dl.json").exists()


def test_scalar_section_values_become_info(tmp_path):
    # Prepare / Execute: "name" passed among the sections
    path = tmp_path / "dl.json"
    write_datalist(path, {"name": "s", "training": [{"image": Path("a.png"), "label": "b.png"}]})
    # Assert
    assert read_datalist_info(path) == {"name": "s"}
    assert load_datalist(path)["training"][0]["image"] == tmp_path / "a.png"


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ("../elsewhere/a.png", "leaves the datalist's folder with '..'"),
        ("images/../../elsewhere/a.png", "leaves the datalist's folder with '..'"),
        ("/tmp/elsewhere/a.png", "is an absolute path"),
        ("link/a.png", "through a symbolic link"),
    ],
)
def test_paths_outside_the_datalist_folder_are_refused_unless_allowed(tmp_path, image, message):
    # Prepare: a site folder whose "link" points at a folder beside it
    site = tmp_path / "site"
    (tmp_path / "elsewhere").mkdir()
    site.mkdir()
    (site / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    path = site / "dl.json"
    path.write_text(json.dumps({"training": [{"image": "images/ok.png", "label": "masks/ok.png"},
                                             {"image": image, "label": "masks/a.png"}]}))
    # Execute / Assert: refused with the entry, the reason and the way out
    with pytest.raises(DataError, match=r"dl\.json: training\[1\]\.image") as info:
        load_datalist(path)
    assert message in str(info.value) and "--allow-outside" in str(info.value)
    with outside_paths_allowed():
        assert load_datalist(path)["training"][1]["image"].name == "a.png"
    with pytest.raises(DataError):  # the permission ends with the block
        load_datalist(path)


def test_inner_dotdot_and_symlinks_inside_the_folder_are_fine(tmp_path):
    # Prepare: "a/../b" stays inside; a link inside the folder pointing inside it too
    (tmp_path / "b").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "b", target_is_directory=True)
    path = tmp_path / "dl.json"
    path.write_text(json.dumps({"training": [{"image": "a/../b/i.png", "label": "alias/l.png"}]}))
    # Execute
    entry = load_datalist(path)["training"][0]
    # Assert
    assert entry["image"] == tmp_path / "b" / "i.png" and entry["label"] == tmp_path / "alias" / "l.png"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"task": "brain", "training": []}, "task is \"brain\"; allowed: \"fundus\", \"prostate\""),
        ({"label_convention": "voc", "training": []}, "label_convention is \"voc\""),
        ({"name": "site 1", "training": []}, "name is 'site 1'; a site name uses only letters"),
        ({"training": [], "validation": [{"image": "a", "label": None}]}, "validation[0].label must be a non-empty"),
    ],
)
def test_schema_violations_name_the_key_and_the_allowed_values(tmp_path, doc, message):
    # Prepare
    path = tmp_path / "dl.json"
    path.write_text(json.dumps(doc))
    # Execute / Assert
    with pytest.raises(DataError) as info:
        load_datalist(path)
    assert message in str(info.value) and "dl.json" in str(info.value)


def test_schema_is_valid_draft_2020_12_and_accepts_what_write_datalist_writes(tmp_path):
    from jsonschema import Draft202012Validator

    # Prepare
    Draft202012Validator.check_schema(DATALIST_SCHEMA)
    path = tmp_path / "dl.json"
    write_datalist(path, {"training": [{"image": tmp_path / "i.png", "label": tmp_path / "l.png", "case": "7"}]},
                   info={"name": "site-1", "task": "fundus", "label_convention": "origa", "description": "x"})
    # Execute / Assert
    assert not list(Draft202012Validator(DATALIST_SCHEMA).iter_errors(json.loads(path.read_text())))
    assert load_datalist(path)["training"][0]["case"] == "7"
