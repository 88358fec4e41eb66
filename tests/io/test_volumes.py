"""NIfTI, MHA and NRRD volumes in RAS+ canonical order, and their failure modes."""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk

from engine.errors import DataError
from engine.io import volumes
from engine.io.files import read_nifti
from engine.io.readers import list_series, open_study


def _lps_oblique_affine() -> np.ndarray:
    """Voxel axes: i -> posterior-ish (tilted), j -> left, k -> inferior; spacing 0.7, 0.5, 3 mm."""
    a = np.deg2rad(12.0)
    axes = np.array([[0.0, -1.0, 0.0], [np.sin(a), 0.0, np.cos(a)], [-np.cos(a), 0.0, np.sin(a)]]).T
    affine = np.eye(4)
    affine[:3, :3] = axes @ np.diag([0.7, 0.5, 3.0])
    affine[:3, 3] = [40.0, -12.5, 80.0]
    return affine


def test_nifti_is_put_in_closest_canonical_order(tmp_path: Path) -> None:
    data = np.random.default_rng(0).normal(100, 20, (6, 7, 5)).astype(np.float32)
    affine = _lps_oblique_affine()
    nib.save(nib.Nifti1Image(data, affine), tmp_path / "v.nii.gz")
    study = open_study(tmp_path / "v.nii.gz")
    expected = nib.as_closest_canonical(nib.Nifti1Image(data, affine))
    assert study.kind == "volume" and study.source_format == "nifti" and study.array.dtype == np.float32
    assert study.array.flags.c_contiguous
    np.testing.assert_array_equal(study.array, np.asarray(expected.dataobj))
    np.testing.assert_allclose(study.affine, expected.affine, atol=1e-5)
    np.testing.assert_allclose(sorted(study.spacing), [0.5, 0.7, 3.0], atol=1e-5)
    assert nib.aff2axcodes(study.affine) == ("R", "A", "S")
    assert study.description["file_orientation"] == "".join(nib.aff2axcodes(affine))


def test_nifti_scaling_is_applied_and_window_ignores_hot_voxels(tmp_path: Path) -> None:
    data = np.tile(np.arange(100, dtype=np.int16), (10, 10, 1))
    data[0, 0, 0] = 30000  # one hot voxel
    img = nib.Nifti1Image(data, np.eye(4))
    img.header.set_slope_inter(2.0, -5.0)
    nib.save(img, tmp_path / "s.nii")
    study = open_study(tmp_path / "s.nii")
    assert study.array[0, 0, 1] == pytest.approx(2.0 * 1 - 5.0)
    center, width = study.window
    assert -5 <= center - width / 2 < 10 and 180 < center + width / 2 < 200  # the 0.5..99.5 percentiles


def test_2d_and_single_volume_4d_nifti_are_3d(tmp_path: Path) -> None:
    nib.save(nib.Nifti1Image(np.ones((5, 4), np.float32), np.eye(4)), tmp_path / "flat.nii")
    assert open_study(tmp_path / "flat.nii").shape == (5, 4, 1)
    nib.save(nib.Nifti1Image(np.ones((5, 4, 3, 1), np.float32), np.eye(4)), tmp_path / "one.nii")
    assert open_study(tmp_path / "one.nii").shape == (5, 4, 3)
    nib.save(nib.Nifti1Image(np.ones((5, 4, 3, 2), np.float32), np.eye(4)), tmp_path / "two.nii")
    with pytest.raises(DataError, match="not one 3D volume"):
        open_study(tmp_path / "two.nii")


def test_rgb_nifti_is_refused(tmp_path: Path) -> None:
    rgb = np.zeros((4, 4, 2), dtype=[("R", "u1"), ("G", "u1"), ("B", "u1")])
    nib.save(nib.Nifti1Image(rgb, np.eye(4)), tmp_path / "rgb.nii")
    with pytest.raises(DataError, match="scalar"):
        open_study(tmp_path / "rgb.nii")


@pytest.mark.parametrize("suffix", [".mha", ".nrrd"])
def test_itk_volumes_use_their_lps_geometry(tmp_path: Path, suffix: str) -> None:
    # Prepare: an oblique ITK image; its RAS+ affine is diag(-1, -1, 1) @ (direction * spacing, origin)
    array_zyx = np.random.default_rng(1).random((5, 6, 7)).astype(np.float32)
    image = sitk.GetImageFromArray(array_zyx)
    image.SetSpacing((0.5, 0.7, 2.0))
    image.SetOrigin((10.0, -20.0, 30.0))
    a = np.deg2rad(25.0)
    direction = np.array([[np.cos(a), -np.sin(a), 0.0], [np.sin(a), np.cos(a), 0.0], [0.0, 0.0, -1.0]])
    image.SetDirection(direction.ravel().tolist())
    sitk.WriteImage(image, str(tmp_path / f"v{suffix}"))
    lps = np.eye(4)
    lps[:3, :3] = direction * np.array([0.5, 0.7, 2.0])
    lps[:3, 3] = [10.0, -20.0, 30.0]
    expected = nib.as_closest_canonical(nib.Nifti1Image(array_zyx.transpose(2, 1, 0), np.diag([-1, -1, 1, 1]) @ lps))
    # Execute
    study = open_study(tmp_path / f"v{suffix}")
    # Assert
    assert study.source_format == suffix[1:]
    np.testing.assert_array_equal(study.array, np.asarray(expected.dataobj, dtype=np.float32))
    np.testing.assert_allclose(study.affine, expected.affine, atol=1e-5)
    np.testing.assert_allclose(sorted(study.spacing), [0.5, 0.7, 2.0], atol=1e-6)
    [info] = list_series(tmp_path / f"v{suffix}")
    assert info.count == study.shape[2] and info.size == (study.shape[1], study.shape[0])


def test_mha_modality_tag_is_kept(tmp_path: Path) -> None:
    image = sitk.GetImageFromArray(np.zeros((2, 3, 4), np.int16))
    path = tmp_path / "ct.mha"
    sitk.WriteImage(image, str(path))
    text = path.read_bytes()
    path.write_bytes(text.replace(b"ElementType", b"Modality = MET_MOD_CT\nElementType", 1))
    assert open_study(path).modality == "CT"


def test_colour_itk_image_is_refused(tmp_path: Path) -> None:
    image = sitk.GetImageFromArray(np.zeros((4, 5, 3), np.uint8), isVector=True)
    sitk.WriteImage(image, str(tmp_path / "rgb.mha"))
    with pytest.raises(DataError, match="colour or vector"):
        open_study(tmp_path / "rgb.mha")


def test_broken_volume_files(tmp_path: Path) -> None:
    nib.save(nib.Nifti1Image(np.ones((20, 20, 20), np.float32), np.eye(4)), tmp_path / "ok.nii.gz")
    data = (tmp_path / "ok.nii.gz").read_bytes()
    (tmp_path / "cut.nii.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"cut\.nii\.gz"):
        open_study(tmp_path / "cut.nii.gz")
    (tmp_path / "text.nii").write_text("hello")
    with pytest.raises(DataError, match=r"text\.nii: not a readable NIfTI"):
        open_study(tmp_path / "text.nii")
    (tmp_path / "gz.nii.gz").write_bytes(gzip.compress(b"\0" * 400))
    with pytest.raises(DataError, match=r"gz\.nii\.gz"):
        open_study(tmp_path / "gz.nii.gz")
    (tmp_path / "noise.nrrd").write_bytes(bytes(range(256)))
    with pytest.raises(DataError, match=r"noise\.nrrd: not a readable"):
        open_study(tmp_path / "noise.nrrd")
    sitk.WriteImage(sitk.GetImageFromArray(np.zeros((3, 4, 5), np.float32)), str(tmp_path / "split.mhd"))
    (tmp_path / "split.raw").unlink()  # the data file is gone
    with pytest.raises(DataError, match=r"split\.mhd"):
        open_study(tmp_path / "split.mhd")


def test_too_many_voxels_is_refused_from_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nib.save(nib.Nifti1Image(np.zeros((10, 10, 10), np.float32), np.eye(4)), tmp_path / "v.nii")
    monkeypatch.setattr(volumes, "MAX_VOXELS", 999)
    with pytest.raises(DataError, match=r"1,000 voxels.*crop or downsample"):
        open_study(tmp_path / "v.nii")


def test_degenerate_affine_is_a_data_error() -> None:
    with pytest.raises(DataError, match="degenerate"):
        volumes.to_canonical(np.zeros((3, 3, 3), np.float32), np.diag([1.0, 0.0, 1.0, 1.0]))
    with pytest.raises(DataError, match="NaN or Inf"):
        volumes.to_canonical(np.zeros((3, 3, 3), np.float32), np.diag([1.0, np.nan, 1.0, 1.0]))


def _damaged_gzip_copies(path: Path) -> dict[str, bytes]:
    """Copies of a valid .nii.gz that nibabel alone loads without complaint, each damaged in one way."""
    raw = gzip.decompress(path.read_bytes())
    stored = bytearray(gzip.compress(raw, compresslevel=0))  # stored blocks: a flipped byte still inflates
    stored[len(stored) // 2] ^= 0xFF
    compressed = path.read_bytes()
    bad_crc = bytearray(compressed)
    bad_crc[-6] ^= 0xFF  # in the CRC-32 of the trailer
    return {"flipped": bytes(stored), "crc": bytes(bad_crc), "cut": compressed[:-5]}


@pytest.mark.parametrize("damage", ["flipped", "crc", "cut"])
def test_damaged_nii_gz_fails_its_gzip_check(tmp_path: Path, damage: str) -> None:
    # Prepare: voxels in the middle of the file (a flip lands on them), 25 kB of them
    data = np.random.default_rng(2).normal(100, 20, (20, 20, 16)).astype(np.float32)
    nib.save(nib.Nifti1Image(data, np.eye(4)), tmp_path / "ok.nii.gz")
    path = tmp_path / f"{damage}.nii.gz"
    path.write_bytes(_damaged_gzip_copies(tmp_path / "ok.nii.gz")[damage])
    # Execute / Assert: the whole stream is checked, through every NIfTI reader
    with pytest.raises(DataError, match=rf"{damage}\.nii\.gz: the compressed \(gzip\) data is damaged or truncated"):
        open_study(path)
    with pytest.raises(DataError, match=rf"{damage}\.nii\.gz: .*gzip"):
        read_nifti(path)
    np.testing.assert_array_equal(open_study(tmp_path / "ok.nii.gz").array, data)  # the intact file still reads
