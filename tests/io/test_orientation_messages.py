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
