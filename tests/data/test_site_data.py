"""Loading a site's datalist into training arrays, for both tasks, and the errors users meet."""

import json

import numpy as np
import pytest

from engine.data.datalist import load_datalist, outside_paths_allowed, write_datalist
from engine.data.site_data import SiteData, SplitArrays, load_site
from engine.data.synth import generate_federation
from engine.errors import ConfigError, DataError
from engine.io.files import write_label_png, write_nifti, write_rgb_png
from engine.tasks import get_task

FUNDUS = get_task("fundus")
PROSTATE = get_task("prostate")


@pytest.fixture(scope="module")
def fundus_sites(tmp_path_factory):
    return generate_federation("fundus", 2, tmp_path_factory.mktemp("fundus"), image_size=64, seed=0)


@pytest.fixture(scope="module")
def prostate_sites(tmp_path_factory):
    return generate_federation("prostate", 2, tmp_path_factory.mktemp("prostate"), image_size=32, seed=0)


def _check_split(split: SplitArrays, channels: int, labels: int, size: int, cases: int, per_case: int):
    n = cases * per_case
    assert split.images.shape == (n, channels, size, size) and split.images.dtype == np.float32
    assert split.masks.shape == (n, labels, size, size) and split.masks.dtype == np.float32
    assert split.case_ids.dtype == np.int64
    assert np.array_equal(split.case_ids, np.repeat(np.arange(cases), per_case))
    assert split.images.min() >= 0.0 and split.images.max() <= 1.0
    assert set(np.unique(split.masks)) <= {0.0, 1.0}
    assert split.num_cases == cases and len(split) == n


@pytest.mark.parametrize("size", [64, 32])
def test_fundus_site_shapes_dtypes_and_ranges(fundus_sites, size):
    # Execute: same size as the files, and a downscale
    site = load_site(fundus_sites[0], FUNDUS, size)
    # Assert: site1 has 8 cases -> 4/2/2
    assert isinstance(site, SiteData) and site.name == "site1"
    _check_split(site.train, 3, 2, size, 4, 1)
    _check_split(site.validation, 3, 2, size, 2, 1)
    _check_split(site.test, 3, 2, size, 2, 1)
    assert site.num_train == 4
    # Cup inside disc survives the (nearest) resize; both structures present in every image
    disc, cup = site.train.masks[:, 0], site.train.masks[:, 1]
    assert np.all(cup <= disc)
    assert disc.sum(axis=(1, 2)).min() > 0 and cup.sum(axis=(1, 2)).min() > 0
    # Not blank: real photo content with colour (red channel brighter than blue inside the field)
    assert site.train.images[:, 0].mean() > site.train.images[:, 2].mean() + 0.1


def test_fundus_values_match_the_files(fundus_sites):
    # The loader must not reorder or rescale: first training entry == rgb/255 of the PNG
    from engine.io.files import read_label_png, read_rgb_image

    entry = load_datalist(fundus_sites[1])["training"][0]
    site = load_site(fundus_sites[1], FUNDUS, 64)
    assert np.allclose(site.train.images[0], read_rgb_image(entry["image"]).transpose(2, 0, 1) / 255.0)
    label = read_label_png(entry["label"])
    assert np.array_equal(site.train.masks[0, 0], label >= 1)
    assert np.array_equal(site.train.masks[0, 1], label == 2)


def test_prostate_site_slices_every_volume(prostate_sites):
    # Execute
    site = load_site(prostate_sites[1], PROSTATE, 32)
    # Assert: site2 has 6 volumes -> 3/1/2, 12 slices each, empty slices included
    assert site.name == "site2"
    _check_split(site.train, 1, 1, 32, 3, 12)
    _check_split(site.validation, 1, 1, 32, 1, 12)
    _check_split(site.test, 1, 1, 32, 2, 12)
    assert site.num_train == 36
    per_slice = site.train.masks.sum(axis=(1, 2, 3))
    assert (per_slice == 0).any() and (per_slice > 0).any()
    # Percentile normalisation per volume: every volume spans [0, 1]
    for case in range(3):
        vol = site.train.images[site.train.case_ids == case]
        assert vol.min() == 0.0 and vol.max() == 1.0


def test_prostate_upscale_keeps_masks_binary(prostate_sites):
    site = load_site(prostate_sites[0], PROSTATE, 48)
    assert site.train.images.shape[1:] == (1, 48, 48)
    assert set(np.unique(site.train.masks)) == {0.0, 1.0}


def test_missing_splits_give_empty_arrays_and_folder_name(tmp_path, fundus_sites):
    # Prepare: a datalist with only training, no "name" key, in a folder called "hospitalA"
    entry = load_datalist(fundus_sites[0])["training"][0]
    path = tmp_path / "hospitalA" / "datalist.json"
    write_datalist(path, {"training": [entry]})
    # Execute
    with outside_paths_allowed():  # the entry names the fixture's files outside hospitalA/
        site = load_site(path, FUNDUS, 32)
        named = load_site(path, FUNDUS, 32, name="override")
    # Assert
    assert site.name == "hospitalA" and named.name == "override"
    assert site.num_train == 1
    for split in (site.validation, site.test):
        assert split.images.shape == (0, 3, 32, 32) and split.masks.shape == (0, 2, 32, 32)
        assert split.case_ids.shape == (0,) and split.case_ids.dtype == np.int64


def test_fundus_mask_of_another_size_names_both_files(tmp_path):
    # Prepare
    write_rgb_png(tmp_path / "img.png", np.zeros((30, 40, 3), np.uint8))
    write_label_png(tmp_path / "mask.png", np.zeros((32, 32), np.uint8))
    write_datalist(tmp_path / "dl.json", {"training": [{"image": "img.png", "label": "mask.png"}]})
    # Execute / Assert
    with pytest.raises(DataError) as info:
        load_site(tmp_path / "dl.json", FUNDUS, 32)
    message = str(info.value)
    assert "mask.png" in message and "img.png" in message and "32x32" in message and "40x30" in message


def test_prostate_mask_of_another_shape_names_both_files(tmp_path):
    # Prepare
    write_nifti(tmp_path / "vol.nii.gz", np.zeros((16, 16, 6), np.float32), np.eye(4))
    write_nifti(tmp_path / "seg.nii.gz", np.zeros((16, 16, 5), np.uint8), np.eye(4))
    write_datalist(tmp_path / "dl.json", {"training": [{"image": "vol.nii.gz", "label": "seg.nii.gz"}]})
    # Execute / Assert
    with pytest.raises(DataError) as info:
        load_site(tmp_path / "dl.json", PROSTATE, 16)
    message = str(info.value)
    assert "vol.nii.gz" in message and "seg.nii.gz" in message and "(16, 16, 6)" in message
    assert "(16, 16, 5)" in message


def test_fundus_mask_with_foreign_values_is_refused(tmp_path):
    write_rgb_png(tmp_path / "img.png", np.zeros((32, 32, 3), np.uint8))
    write_label_png(tmp_path / "mask.png", np.full((32, 32), 255, np.uint8))
    write_datalist(tmp_path / "dl.json", {"training": [{"image": "img.png", "label": "mask.png"}]})
    with pytest.raises(DataError, match="ORIGA"):
        load_site(tmp_path / "dl.json", FUNDUS, 32)


def test_missing_image_file_is_named(tmp_path):
    write_datalist(tmp_path / "dl.json", {"training": [{"image": "gone.png", "label": "gone_mask.png"}]})
    with pytest.raises(DataError, match=r"gone\.png"):
        load_site(tmp_path / "dl.json", FUNDUS, 32)


def test_datalist_of_another_task_and_empty_training_are_refused(tmp_path, fundus_sites):
    with pytest.raises(DataError, match="for task 'fundus', not 'prostate'"):
        load_site(fundus_sites[0], PROSTATE, 32)
    (tmp_path / "dl.json").write_text(json.dumps({"training": []}))
    with pytest.raises(DataError, match="'training' section is empty"):
        load_site(tmp_path / "dl.json", FUNDUS, 32)


def test_bad_image_size_is_a_config_error(fundus_sites):
    with pytest.raises(ConfigError, match="image_size"):
        load_site(fundus_sites[0], FUNDUS, 0)


def test_split_arrays_refuse_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        SplitArrays(np.zeros((2, 1, 4, 4), np.float32), np.zeros((1, 1, 4, 4), np.float32),
                    np.zeros(2, np.int64))
