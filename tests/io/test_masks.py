"""Masks read onto their study: formats, geometry checks with both geometries, conventions, values."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from PIL import Image
from synthetic_dicom import write_series

from engine.errors import ConfigError, DataError
from engine.io.masks import open_mask, read_mask
from engine.io.readers import open_study


@pytest.fixture
def photo(tmp_path: Path):
    Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(tmp_path / "img.png")
    return open_study(tmp_path / "img.png")


def _oblique_affine() -> np.ndarray:
    a = np.deg2rad(15.0)
    affine = np.eye(4)
    rotation = np.array([[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]])
    affine[:3, :3] = rotation @ np.diag([0.8, 0.6, 2.5])
    affine[:3, 3] = [-50.0, 20.0, 7.0]
    return affine


@pytest.fixture
def volume(tmp_path: Path):
    data = np.random.default_rng(0).normal(size=(8, 9, 6)).astype(np.float32)
    nib.save(nib.Nifti1Image(data, _oblique_affine()), tmp_path / "vol.nii.gz")
    return open_study(tmp_path / "vol.nii.gz")


def _labels(shape: tuple[int, ...], values: int = 2, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, values + 1, shape).astype(np.uint8)


def test_photo_png_mask_is_origa_style_by_default(tmp_path: Path, photo) -> None:
    labels = _labels((30, 40))
    Image.fromarray(labels).save(tmp_path / "m.png")
    mask = open_mask(tmp_path / "m.png", photo)
    np.testing.assert_array_equal(mask.array, labels)
    assert mask.names == {1: "rim", 2: "cup"} and mask.source == tmp_path / "m.png"
    Image.fromarray(labels * 100).save(tmp_path / "other.png")
    assert open_mask(tmp_path / "other.png", photo).names == {100: "label 100", 200: "label 200"}


def test_photo_mask_of_another_size_names_both_sizes(tmp_path: Path, photo) -> None:
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(tmp_path / "m.png")
    with pytest.raises(DataError) as info:
        open_mask(tmp_path / "m.png", photo)
    message = str(info.value)
    assert "m.png" in message and "img.png" in message and "32x32" in message and "40x30" in message


def test_grey_rgb_mask_accepted_colour_and_jpeg_refused(tmp_path: Path, photo) -> None:
    labels = _labels((30, 40))
    Image.fromarray(np.repeat(labels[:, :, None], 3, axis=2)).save(tmp_path / "grey_rgb.png")
    np.testing.assert_array_equal(open_mask(tmp_path / "grey_rgb.png", photo).array, labels)
    colour = np.zeros((30, 40, 3), np.uint8)
    colour[..., 0] = labels
    Image.fromarray(colour).save(tmp_path / "colour.png")
    with pytest.raises(DataError, match="colour"):
        open_mask(tmp_path / "colour.png", photo)
    Image.fromarray(labels).save(tmp_path / "m.jpg")
    with pytest.raises(DataError, match="JPEG"):
        open_mask(tmp_path / "m.jpg", photo)


def test_photo_mask_as_2d_nifti(tmp_path: Path, photo) -> None:
    labels = _labels((30, 40))
    nib.save(nib.Nifti1Image(labels, np.eye(4)), tmp_path / "m.nii.gz")
    np.testing.assert_array_equal(open_mask(tmp_path / "m.nii.gz", photo).array, labels)


def test_volume_mask_in_another_voxel_order_lands_on_the_study(tmp_path: Path, volume) -> None:
    # Prepare: the same grid stored with i and k flipped and axes swapped (another tool's order)
    labels = _labels(volume.shape, values=3)
    flipped = labels[::-1, :, ::-1].transpose(2, 1, 0)
    flip = np.array([[0, 0, -1, volume.shape[0] - 1], [0, 1, 0, 0], [-1, 0, 0, volume.shape[2] - 1], [0, 0, 0, 1.0]])
    # voxel (a, b, c) of the stored array is voxel (S0-1-c, b, S2-1-a) of the study
    nib.save(nib.Nifti1Image(flipped, volume.affine @ flip), tmp_path / "m.nii.gz")
    # Execute
    mask = open_mask(tmp_path / "m.nii.gz", volume)
    # Assert
    np.testing.assert_array_equal(mask.array, labels)
    assert mask.array.dtype == np.uint8 and mask.names == {1: "label 1", 2: "label 2", 3: "label 3"}


@pytest.mark.parametrize("suffix", [".nrrd", ".mha"])
def test_itk_label_volume(tmp_path: Path, volume, suffix: str) -> None:
    labels = _labels(volume.shape)
    image = sitk.GetImageFromArray(labels.transpose(2, 1, 0))
    ras = np.asarray(volume.affine)
    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ ras
    spacing = np.sqrt((lps[:3, :3] ** 2).sum(axis=0))
    image.SetSpacing(spacing.tolist())
    image.SetDirection((lps[:3, :3] / spacing).ravel().tolist())
    image.SetOrigin(lps[:3, 3].tolist())
    sitk.WriteImage(image, str(tmp_path / f"m{suffix}"))
    np.testing.assert_array_equal(open_mask(tmp_path / f"m{suffix}", volume).array, labels)


def test_volume_mask_of_another_geometry_gives_both_geometries(tmp_path: Path, volume) -> None:
    nib.save(nib.Nifti1Image(_labels((8, 9, 5)), np.diag([1.0, 1.0, 1.0, 1.0])), tmp_path / "shape.nii.gz")
    with pytest.raises(DataError) as info:
        open_mask(tmp_path / "shape.nii.gz", volume)
    message = str(info.value)
    assert "(8, 9, 5)" in message and str(volume.shape) in message
    assert "spacing 1 x 1 x 1 mm" in message and "spacing 0.8 x 0.6 x 2.5 mm" in message
    assert "origin" in message and "never resamples" in message
    shifted = volume.affine.copy()
    shifted[:3, 3] += [0.3, 0.0, 0.0]  # half a voxel off: same shape, wrong place
    nib.save(nib.Nifti1Image(_labels(volume.shape), shifted), tmp_path / "shift.nii.gz")
    with pytest.raises(DataError, match="geometry does not match"):
        open_mask(tmp_path / "shift.nii.gz", volume)


def test_dicom_labels_on_some_slices_are_placed_or_refused(tmp_path: Path) -> None:
    # Prepare: a 6-slice series, and labels for slices 2..3 as their own DICOM files
    paths, _ = write_series(tmp_path / "image", slices=6)
    study = open_study(tmp_path / "image")
    (tmp_path / "labels").mkdir()
    by_position = sorted(paths, key=lambda p: float(pydicom.dcmread(p).ImagePositionPatient[2]))
    for path in by_position[2:4]:
        ds = pydicom.dcmread(path)
        ds.PixelData = np.full((12, 10), 255, np.uint16).tobytes()
        ds.save_as(tmp_path / "labels" / path.name)
    # Execute
    reading = read_mask(tmp_path / "labels", study, "binary")
    # Assert: labelled slices in place, the rest 0; validation mode refuses the partial mask
    assert reading.partial is not None and "k 2..3 of 6" in reading.partial
    assert reading.labels.array[:, :, 2:4].all() and not reading.labels.array[:, :, [0, 1, 4, 5]].any()
    assert reading.raw_values == ((0, 255),)
    with pytest.raises(DataError, match="covers only part"):
        read_mask(tmp_path / "labels", study, "binary", allow_partial=False)


def test_conventions_map_values(tmp_path: Path, photo) -> None:
    Image.fromarray(_labels((30, 40), values=1) * 255).save(tmp_path / "b.png")
    binary = open_mask(tmp_path / "b.png", photo, convention="binary")
    assert set(np.unique(binary.array)) == {0, 1} and binary.names == {1: "foreground"}
    disc = np.zeros((30, 40), np.uint8)
    disc[5:25, 5:35] = 191
    cup = np.zeros((30, 40), np.uint8)
    cup[10:20, 10:30] = 128
    cup[12:14, 12:14] = 255
    disc[0, 0], cup[0, 1] = 64, 64  # a minority vote: not marked
    Image.fromarray(disc).save(tmp_path / "case_ODsegSoftmap.png")
    Image.fromarray(cup).save(tmp_path / "case_cupsegSoftmap.png")
    for named in ("case_ODsegSoftmap.png", "case_cupsegSoftmap.png"):  # either file names the pair
        reading = read_mask(tmp_path / named, photo, "drishti")
        label = reading.labels.array
        assert reading.labels.names == {1: "rim", 2: "cup"}
        assert (label == 2).sum() == 200 and (label >= 1).sum() == 600 and label[0, 0] == 0 and label[0, 1] == 0
        assert reading.raw_values == ((0, 64, 191), (0, 64, 128, 255))
    Image.fromarray(_labels((30, 40)) * 3).save(tmp_path / "o.png")
    with pytest.raises(DataError, match=r"values \[3, 6\].*origa"):
        open_mask(tmp_path / "o.png", photo, convention="origa")
    with pytest.raises(ConfigError, match="unknown label convention"):
        open_mask(tmp_path / "o.png", photo, convention="nope")
    with pytest.raises(DataError, match="cupsegSoftmap"):
        open_mask(tmp_path / "o.png", photo, convention="drishti")


def test_label_values_must_be_whole_numbers_0_to_255(tmp_path: Path, volume) -> None:
    soft = np.random.default_rng(2).random(volume.shape).astype(np.float32)
    nib.save(nib.Nifti1Image(soft, volume.affine), tmp_path / "soft.nii.gz")
    with pytest.raises(DataError, match=r"non-integer.*nearest neighbour"):
        open_mask(tmp_path / "soft.nii.gz", volume)
    big = _labels(volume.shape).astype(np.int16) * 300
    nib.save(nib.Nifti1Image(big, volume.affine), tmp_path / "big.nii.gz")
    with pytest.raises(DataError, match=r"0..255"):
        open_mask(tmp_path / "big.nii.gz", volume)
    assert set(np.unique(open_mask(tmp_path / "big.nii.gz", volume, "binary").array)) == {0, 1}


def test_missing_mask_and_wrong_kind(tmp_path: Path, photo, volume) -> None:
    with pytest.raises(DataError, match=r"gone\.png: mask not found"):
        open_mask(tmp_path / "gone.png", photo)
    Image.fromarray(_labels((9, 8))).save(tmp_path / "slice.png")
    with pytest.raises(DataError, match="2D label map for photos"):
        open_mask(tmp_path / "slice.png", volume)
    with pytest.raises(DataError, match="photo"):
        open_mask(tmp_path / "vol.nii.gz", photo)


def test_dicom_seg_is_read_through_the_seg_reader(tmp_path: Path) -> None:
    export = pytest.importorskip("engine.io.export")
    from engine.io.study import LabelMap

    write_series(tmp_path / "image", slices=4)
    study = open_study(tmp_path / "image")
    labels = np.zeros(study.shape, np.uint8)
    labels[2:6, 3:8, 1:3] = 1
    labels[3:5, 4:6, 1] = 2
    out = export.export_mask(study, LabelMap(labels, {1: "prostate", 2: "lesion"}), tmp_path / "seg.dcm")
    mask = open_mask(out, study)
    np.testing.assert_array_equal(mask.array, labels)
    assert mask.names == {1: "prostate", 2: "lesion"}
    assert set(np.unique(open_mask(out, study, "binary").array)) == {0, 1}


def test_damaged_nii_gz_mask_fails_its_gzip_check(tmp_path: Path, volume) -> None:
    # A mask whose gzip trailer is damaged: nibabel alone would return its voxels without complaint
    nib.save(nib.Nifti1Image(_labels(volume.shape), volume.affine), tmp_path / "m.nii.gz")
    data = bytearray((tmp_path / "m.nii.gz").read_bytes())
    data[-6] ^= 0xFF  # the CRC-32
    (tmp_path / "crc.nii.gz").write_bytes(bytes(data))
    (tmp_path / "cut.nii.gz").write_bytes(bytes(data[:-3]))
    for name in ("crc", "cut"):
        with pytest.raises(DataError, match=rf"{name}\.nii\.gz: the compressed \(gzip\) data is damaged"):
            read_mask(tmp_path / f"{name}.nii.gz", volume)
    assert open_mask(tmp_path / "m.nii.gz", volume).array.shape == volume.shape
