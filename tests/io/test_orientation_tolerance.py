"""A mask whose orientation header differs slightly (issue 20.6): the angle is named; --tolerate-orientation accepts it.

Real MR volume and label map from ../shared/data; the label map's header is turned by 1 degree
about its first voxel (what rounding by another tool does), its voxels untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from testsupport import SHARED_DATA

from engine.errors import ConfigError, DataError
from engine.io import masks
from engine.io.masks import read_mask, set_orientation_tolerance
from engine.io.readers import open_study

NIFTI = SHARED_DATA / "nifti" / "TotalSegmentator_examples"
pytestmark = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared real data not present")


def _turned(degrees: float) -> np.ndarray:
    a = np.deg2rad(degrees)
    r = np.eye(4)
    r[:2, :2] = [[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]]
    return r


def _case(folder: Path, degrees: float) -> tuple[Path, Path]:
    """The real image, and its binary mask with the orientation turned by ``degrees`` about voxel 0."""
    image = nib.load(str(NIFTI / "example_mr_sm.nii.gz"))
    seg = nib.load(str(NIFTI / "example_seg_mr.nii.gz"))
    affine = image.affine.copy()
    affine[:3, :3] = _turned(degrees)[:3, :3] @ affine[:3, :3]  # same first voxel, axes turned
    folder.mkdir(parents=True, exist_ok=True)
    nib.save(image, str(folder / "mr.nii.gz"))
    mask = nib.Nifti1Image((np.asarray(seg.dataobj) > 0).astype(np.uint8), affine)
    nib.save(mask, str(folder / "mr_mask.nii.gz"))
    return folder / "mr.nii.gz", folder / "mr_mask.nii.gz"


@pytest.fixture(autouse=True)
def _reset_tolerance() -> object:
    yield
    set_orientation_tolerance(0.0)


def test_the_angle_is_named_and_the_option_suggested(tmp_path: Path) -> None:
    image, mask = _case(tmp_path, 1.0)
    study = open_study(image)
    with pytest.raises(DataError, match=r"mr_mask\.nii\.gz: the mask's orientation differs from the study's by 1\.00 "
                                        r"degrees \(axes i, j, k: 1\.00, 1\.00, 0\.00\).*accept it with "
                                        r"--tolerate-orientation 1\b"):
        read_mask(mask, study)


def test_tolerance_accepts_the_mask_voxel_for_voxel(tmp_path: Path) -> None:
    image, mask = _case(tmp_path, 1.0)
    study = open_study(image)
    expected = read_mask(_case(tmp_path / "straight", 0.0)[1], study).labels.array
    reading = read_mask(mask, study, tolerate_orientation=1.5)
    np.testing.assert_array_equal(reading.labels.array, expected)
    with pytest.raises(DataError, match=r"differs from the study's by 1\.00 degrees"):
        read_mask(mask, study, tolerate_orientation=0.5)
    set_orientation_tolerance(1.5)  # the process-wide default the CLI sets
    np.testing.assert_array_equal(read_mask(mask, study).labels.array, expected)


def test_a_different_grid_is_not_tolerated(tmp_path: Path) -> None:
    image, mask = _case(tmp_path, 20.0)
    with pytest.raises(DataError, match=r"by 20\.00 degrees.*choose the mask made for this image"):
        read_mask(mask, open_study(image), tolerate_orientation=10.0)
    shifted = nib.load(str(_case(tmp_path / "shift", 1.0)[1]))
    affine = shifted.affine.copy()
    affine[:3, 3] += 5.0  # several voxels away: not the image's grid, whatever the tolerance
    nib.save(nib.Nifti1Image(np.asarray(shifted.dataobj), affine), str(tmp_path / "far.nii.gz"))
    with pytest.raises(DataError, match="choose the mask made for this image"):
        read_mask(tmp_path / "far.nii.gz", open_study(image), tolerate_orientation=5.0)


def test_option_range() -> None:
    with pytest.raises(ConfigError, match=r"--tolerate-orientation must be a number of degrees in \[0, 10\]"):
        set_orientation_tolerance(45.0)
    assert masks.orientation_tolerance() == 0.0


def test_validate_data_cli_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli.main import main

    image, mask = _case(tmp_path, 1.0)
    datalist = tmp_path / "datalist.json"
    datalist.write_text(json.dumps({"task": "prostate", "training": [{"image": image.name, "label": mask.name}]}))
    assert main(["validate-data", str(datalist)]) == 1
    assert "differs from the study's by 1.00 degrees" in capsys.readouterr().out
    assert main(["validate-data", str(datalist), "--tolerate-orientation", "1.5"]) == 0


def test_training_loader_honours_the_tolerance(tmp_path: Path) -> None:
    """Datalist loading for training (read_task_channels) uses the tolerance `fedsm simulate` sets."""
    from engine.data.preprocess import read_task_channels
    from engine.tasks import get_task

    image, mask = _case(tmp_path, 1.0)
    study = open_study(image)
    task = get_task("prostate")
    with pytest.raises(DataError, match=r"by 1\.00 degrees"):
        read_task_channels(task, mask, study)
    set_orientation_tolerance(1.5)
    channels = read_task_channels(task, mask, study)
    assert channels.shape == (1, *study.shape) and channels.sum() > 0


def test_simulate_takes_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli.main import main

    code = main(["simulate", "--task", "prostate", "--out", str(tmp_path / "o"), "--tolerate-orientation", "11"])
    assert code == 2 and "--tolerate-orientation must be a number of degrees in [0, 10], got 11.0" in (
        capsys.readouterr().err)
