"""Label conventions: which one applies, how values map, and training through them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.data.datalist import write_datalist
from engine.data.site_data import load_site
from engine.errors import ConfigError, DataError
from engine.io.label_conventions import CONVENTIONS, convention_for, get_convention
from engine.tasks import get_task


def test_which_convention_applies() -> None:
    assert convention_for("fundus").name == "origa"
    assert convention_for("prostate").name == "binary"
    assert convention_for("fundus", stated="drishti").name == "drishti"
    assert convention_for("prostate", stated="binary", override="multilabel").name == "multilabel"
    assert convention_for(None).name == "multilabel"
    with pytest.raises(ConfigError, match=r"does not suit the fundus task.*origa, drishti"):
        convention_for("fundus", override="binary")
    with pytest.raises(ConfigError, match=r"unknown label convention 'voc'.*origa"):
        get_convention("voc")
    assert set(CONVENTIONS) == {"origa", "drishti", "binary", "multilabel"}


def test_values_each_convention_allows() -> None:
    assert get_convention("origa").unexpected_values([0, 1, 2]) == []
    assert get_convention("origa").unexpected_values([0, 1, 255]) == [255]
    assert get_convention("binary").unexpected_values([0, 255]) == []
    assert get_convention("binary").unexpected_values([0, 1, 2]) == [1, 2]  # several structures: not binary
    assert get_convention("multilabel").unexpected_values([0, 7, 300]) == [300]
    assert get_convention("drishti").unexpected_values([0, 64, 128, 191, 255]) == []
    assert get_convention("drishti").unexpected_values([0, 100]) == [100]
    assert not get_convention("drishti").strict and get_convention("origa").strict


def test_mapping_to_engine_label_maps() -> None:
    raw = np.array([[0, 1], [2, 255]], np.uint8)
    np.testing.assert_array_equal(get_convention("binary").to_label_map([raw]), [[0, 1], [1, 1]])
    np.testing.assert_array_equal(get_convention("multilabel").to_label_map([raw]), raw)
    with pytest.raises(DataError, match="ORIGA"):
        get_convention("origa").to_label_map([raw])
    disc = np.array([[0, 64, 128, 255]], np.uint8)
    cup = np.array([[0, 0, 191, 127]], np.uint8)
    np.testing.assert_array_equal(get_convention("drishti").to_label_map([disc, cup]), [[0, 0, 2, 1]])
    assert get_convention("multilabel").names(np.array([0, 3, 5])) == {3: "label 3", 5: "label 5"}


def test_drishti_files_found_from_either_name(tmp_path: Path) -> None:
    drishti = get_convention("drishti")
    disc, cup = tmp_path / "g_ODsegSoftmap.png", tmp_path / "g_cupsegSoftmap.png"
    assert drishti.label_files(disc) == (disc, cup)
    assert drishti.label_files(cup) == (disc, cup)
    assert get_convention("origa").label_files(disc) == (disc,)
    with pytest.raises(DataError, match="ODsegSoftmap"):
        drishti.label_files(tmp_path / "mask.png")


def test_training_on_a_drishti_style_site(tmp_path: Path) -> None:
    # Prepare: two photos whose masks are Drishti soft maps, named by the datalist's convention key
    entries = []
    for i in range(2):
        Image.fromarray(np.full((16, 20, 3), 100 + i, np.uint8)).save(tmp_path / f"c{i}.png")
        disc = np.zeros((16, 20), np.uint8)
        disc[2:14, 3:17] = 191
        cup = np.zeros((16, 20), np.uint8)
        cup[5:11, 6:14] = 128
        cup[0, 0] = 64  # minority: ignored
        Image.fromarray(disc).save(tmp_path / f"c{i}_ODsegSoftmap.png")
        Image.fromarray(cup).save(tmp_path / f"c{i}_cupsegSoftmap.png")
        entries.append({"image": f"c{i}.png", "label": f"c{i}_ODsegSoftmap.png"})
    write_datalist(tmp_path / "dl.json", {"training": entries}, info={"task": "fundus", "label_convention": "drishti"})
    # Execute
    site = load_site(tmp_path / "dl.json", get_task("fundus"), 16)
    # Assert: disc and cup channels from majority votes (nearest resize keeps them binary)
    disc_ch, cup_ch = site.train.masks[0]
    assert disc_ch.sum() > cup_ch.sum() > 0 and np.all(cup_ch <= disc_ch) and cup_ch[0, 0] == 0


def test_a_datalist_naming_an_unsuitable_convention_is_refused(tmp_path: Path) -> None:
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "i.png")
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "m.png")
    write_datalist(tmp_path / "dl.json", {"training": [{"image": "i.png", "label": "m.png"}]},
                   info={"label_convention": "binary"})
    with pytest.raises(DataError, match=r"dl\.json.*binary.*does not suit the fundus task"):
        load_site(tmp_path / "dl.json", get_task("fundus"), 8)
