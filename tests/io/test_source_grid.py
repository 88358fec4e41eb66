"""Exported NIfTI masks lie on the source's own voxel grid (issue 19.1), on real volumes from ../shared/data.

For a NIfTI source the mask has the source's affine (sform and qform with their codes), shape and
voxel order, so ``mask[i, j, k]`` labels ``image[i, j, k]``; for a DICOM series the mask is on the
grid SimpleITK's ``ImageSeriesReader`` gives. The viewer keeps its canonical order: the study's
array is not touched, only the writer maps back.
"""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
from nibabel.orientations import axcodes2ornt, io_orientation, ornt_transform
from synthetic_dicom import write_series
from testsupport import SHARED_DATA

from engine.io.export import export_mask
from engine.io.readers import open_study
from engine.io.study import LabelMap

MR = SHARED_DATA / "nifti" / "TotalSegmentator_examples" / "example_mr_sm.nii.gz"
PROSTATEX = SHARED_DATA / "dicom" / "ProstateX-0000_t2_tse_tra"
needs_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared real data not present")


def _rotation(degrees: float, axis: int) -> np.ndarray:
    a = np.deg2rad(degrees)
    c, s = np.cos(a), np.sin(a)
    i, j = [n for n in range(3) if n != axis]
    r = np.eye(4)
    r[i, i], r[i, j], r[j, i], r[j, j] = c, -s, s, c
    return r


def _variant(kind: str, folder: Path) -> Path:
    """The real MR volume (LPS on disk) written as ``kind``: LPS, LAS, PSL (axes permuted), oblique, qform-only."""
    img = nib.load(str(MR))
    data = np.asarray(img.dataobj)
    if kind in ("LAS", "PSL", "RAS"):
        img = img.as_reoriented(ornt_transform(io_orientation(img.affine), axcodes2ornt(tuple(kind))))
        out = nib.Nifti1Image(np.asarray(img.dataobj), img.affine)
    elif kind == "oblique":  # rotated 17 degrees about z and 9 about x: no axis is a world axis
        out = nib.Nifti1Image(data, _rotation(9, 0) @ _rotation(17, 2) @ img.affine)
    elif kind == "qform-only":
        out = nib.Nifti1Image(data, None)
        out.set_qform(img.affine, code=1)
        out.set_sform(None, code=0)
    else:
        out = nib.Nifti1Image(data, img.affine)
        out.set_qform(img.affine, code=1)
    path = folder / f"mr_{kind}.nii.gz"
    nib.save(out, str(path))
    return path


def _labels_from(image: np.ndarray) -> np.ndarray:
    """A label map computed from intensities alone: it must land on the voxels it was computed from."""
    lo, hi = np.percentile(image, [60, 90])
    return ((image > lo).astype(np.uint8) + (image > hi).astype(np.uint8)).astype(np.uint8)


@needs_data
@pytest.mark.parametrize("kind", ["LPS", "LAS", "PSL", "oblique", "qform-only"])
def test_nifti_mask_on_the_source_grid(tmp_path: Path, kind: str) -> None:
    # Prepare: a real volume written in this orientation; a mask made on the canonical study
    source = _variant(kind, tmp_path)
    study = open_study(source)
    canonical_before = study.array.copy()
    labels = _labels_from(study.array)
    # Execute
    out = export_mask(study, LabelMap(labels, {1: "tissue", 2: "bright"}), tmp_path / "mask.nii.gz")
    # Assert: same affine, shape and voxel order as the source file; nothing else changed
    src, mask = nib.load(str(source)), nib.load(str(out))
    np.testing.assert_allclose(mask.affine, src.affine, atol=1e-5)
    assert mask.shape == src.shape
    assert mask.get_data_dtype() == np.uint8 and mask.header.get_intent()[0] == "label"
    assert int(mask.header["sform_code"]) == int(src.header["sform_code"])
    assert int(mask.header["qform_code"]) == int(src.header["qform_code"])
    np.testing.assert_array_equal(np.asarray(mask.dataobj), _labels_from(np.asarray(src.dataobj, np.float32)))
    np.testing.assert_array_equal(study.array, canonical_before)  # the viewer's order is untouched


@needs_data
def test_non_ras_mask_differs_from_the_canonical_array(tmp_path: Path) -> None:
    """The LPS case the issue reported: written in canonical order the voxels would be flipped."""
    source = _variant("LPS", tmp_path)
    study = open_study(source)
    labels = _labels_from(study.array)
    out = export_mask(study, LabelMap(labels, {1: "a", 2: "b"}), tmp_path / "m.nii.gz")
    stored = np.asarray(nib.load(str(out)).dataobj)
    assert not np.array_equal(stored, labels)  # canonical (RAS) order is flipped in x and y
    np.testing.assert_array_equal(stored, labels[::-1, ::-1, :])


def _sitk_grid(image: sitk.Image) -> tuple[np.ndarray, np.ndarray]:
    """SimpleITK's voxels as ``(x, y, z)`` and their voxel -> RAS+ affine."""
    lps = np.eye(4)
    lps[:3, :3] = np.asarray(image.GetDirection()).reshape(3, 3) * np.asarray(image.GetSpacing())
    lps[:3, 3] = image.GetOrigin()
    return sitk.GetArrayFromImage(image).transpose(2, 1, 0), np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps


def _check_dicom_mask(folder: Path, tmp_path: Path, files: list[str] | None = None) -> None:
    study = open_study(folder)
    labels = _labels_from(study.array)
    out = export_mask(study, LabelMap(labels, {1: "a", 2: "b"}), tmp_path / "series_mask.nii.gz")
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(files or reader.GetGDCMSeriesFileNames(str(folder)))
    voxels, affine = _sitk_grid(reader.Execute())
    mask = nib.load(str(out))
    assert mask.shape == voxels.shape
    np.testing.assert_allclose(mask.affine, affine, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(mask.dataobj), _labels_from(voxels.astype(np.float32)))


@needs_data
def test_dicom_mask_on_simpleitks_grid_prostatex(tmp_path: Path) -> None:
    _check_dicom_mask(PROSTATEX, tmp_path)


def test_dicom_mask_on_simpleitks_grid_oblique_series(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "case", rows=20, columns=24, slices=5, angle_deg=25.0)
    _check_dicom_mask(tmp_path / "case", tmp_path, [str(p) for p in paths])


def test_dicom_mask_on_simpleitks_grid_sagittal_series(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "sag", rows=16, columns=18, slices=4, sagittal=True)
    _check_dicom_mask(tmp_path / "sag", tmp_path, [str(p) for p in paths])
