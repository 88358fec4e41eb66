"""Geometry errors name orientation differences with the angle (issue 20.6)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
import pytest
from synthetic_dicom import write_series

from engine.errors import DataError
from engine.io.readers import open_study


def _tilt(path: Path, degrees: float, in_plane: bool = False) -> None:
    ds = pydicom.dcmread(path)
    a = np.deg2rad(degrees)
    if in_plane:  # rotated about the slice normal (z): rows and columns turn, the plane stays
        row, col = [np.cos(a), np.sin(a), 0.0], [-np.sin(a), np.cos(a), 0.0]
    else:  # tilted about x: the plane itself turns
        row, col = [1.0, 0.0, 0.0], [0.0, np.cos(a), np.sin(a)]
    ds.ImageOrientationPatient = [f"{v:.6f}" for v in (*row, *col)]
    ds.save_as(path)


@pytest.mark.parametrize(("in_plane", "expected"), [(False, "planes 3.00 degrees apart"),
                                                     (True, "rotated 2.00 degrees within the plane")])
def test_a_slice_of_another_orientation_names_the_angle(tmp_path: Path, in_plane: bool, expected: str) -> None:
    paths, _ = write_series(tmp_path / "s", slices=3)
    _tilt(paths[1], 2.0 if in_plane else 3.0, in_plane)
    with pytest.raises(DataError, match=rf"two orientations \(.*{expected}\)"):
        open_study(tmp_path / "s")


def test_seg_on_a_turned_series_names_the_angle(tmp_path: Path) -> None:
    from synthetic_dicom import canonical_study

    from engine.io.dicom_seg import read_dicom_seg, write_dicom_seg
    from engine.io.study import LabelMap

    paths, pixels = write_series(tmp_path / "a", rows=30, columns=30, slices=3)
    study = canonical_study(paths, pixels)
    labels = np.zeros(study.shape, np.uint8)
    labels[5:20, 5:20, 1] = 1
    write_dicom_seg(study, LabelMap(labels, {1: "prostate"}), tmp_path / "seg.dcm")
    turned_paths, turned_pixels = write_series(tmp_path / "b", rows=30, columns=30, slices=3, angle_deg=1.5)
    turned = canonical_study(turned_paths, turned_pixels)
    with pytest.raises(DataError, match=r"its orientation differs from the study's by 1\.50 degrees"):
        read_dicom_seg(tmp_path / "seg.dcm", turned)
