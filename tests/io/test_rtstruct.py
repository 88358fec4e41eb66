"""RTSTRUCT contours as masks (issue 20.6): rasterised onto the referenced series, voxel exact.

Synthetic structure sets (rectangles, a hole, two ROIs) on axial, oblique and sagittal series are
checked voxel for voxel; a structure set written by rt-utils (a maintained RTSTRUCT library) from
a mask on the real ProstateX series reads back onto that mask.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence
from pydicom.uid import ExplicitVRLittleEndian, generate_uid
from synthetic_dicom import write_series
from testsupport import SHARED_DATA

from engine.errors import DataError
from engine.io.masks import read_mask
from engine.io.readers import open_study
from engine.io.rtstruct import RTSTRUCT_SOP_CLASS, read_rtstruct
from engine.io.study import Study

PROSTATEX = SHARED_DATA / "dicom" / "ProstateX-0000_t2_tse_tra"


def _lps(study: Study, voxels: np.ndarray) -> np.ndarray:
    """Canonical voxel coordinates ``(N, 3)`` -> DICOM LPS millimetres."""
    ras = (study.affine[:3, :3] @ voxels.T + study.affine[:3, 3:4]).T
    return ras * np.array([-1.0, -1.0, 1.0])


def _rectangle(study: Study, k: int, i: tuple[int, int], j: tuple[int, int]) -> list[float]:
    corners = np.array([[i[0], j[0], k], [i[1], j[0], k], [i[1], j[1], k], [i[0], j[1], k]], dtype=float)
    return [round(float(v), 4) for v in _lps(study, corners).ravel()]


def write_rtstruct(path: Path, study: Study, rois: dict[str, list[list[float]]], frame_uid: str | None = None,
                   extra: list[tuple[str, list[float]]] | None = None) -> Path:
    """A minimal RT Structure Set: one ROI per name with its closed planar contours."""
    first = pydicom.dcmread(study.dicom_files[0], stop_before_pixels=True)
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = RTSTRUCT_SOP_CLASS
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.SOPClassUID, ds.SOPInstanceUID = RTSTRUCT_SOP_CLASS, ds.file_meta.MediaStorageSOPInstanceUID
    ds.Modality = "RTSTRUCT"
    ds.StudyInstanceUID, ds.SeriesInstanceUID = first.StudyInstanceUID, generate_uid()
    ref = Dataset()
    ref.FrameOfReferenceUID = frame_uid or first.FrameOfReferenceUID
    ds.ReferencedFrameOfReferenceSequence = Sequence([ref])
    ds.StructureSetROISequence = Sequence()
    ds.ROIContourSequence = Sequence()
    for number, (name, contours) in enumerate(rois.items(), start=7):  # ROI numbers need not start at 1
        roi = Dataset()
        roi.ROINumber, roi.ROIName = number, name
        ds.StructureSetROISequence.append(roi)
        item = Dataset()
        item.ReferencedROINumber = number
        item.ContourSequence = Sequence()
        for data in contours:
            contour = Dataset()
            contour.ContourGeometricType = "CLOSED_PLANAR"
            contour.NumberOfContourPoints = len(data) // 3
            contour.ContourData = data
            item.ContourSequence.append(contour)
        for kind, data in extra or []:
            contour = Dataset()
            contour.ContourGeometricType, contour.ContourData = kind, data
            item.ContourSequence.append(contour)
        ds.ROIContourSequence.append(item)
    ds.save_as(path, enforce_file_format=True)
    return path


@pytest.mark.parametrize("geometry", [{"angle_deg": 0.0}, {"angle_deg": 25.0}, {"sagittal": True}])
def test_contours_fill_exactly_their_voxels(tmp_path: Path, geometry: dict[str, object]) -> None:
    # Prepare: a series and a structure set of two ROIs, one with a hole, one on another slice
    write_series(tmp_path / "s", rows=20, columns=24, slices=4, **geometry)  # type: ignore[arg-type]
    study = open_study(tmp_path / "s")
    gland = [_rectangle(study, 1, (2, 12), (3, 9)), _rectangle(study, 1, (5, 7), (5, 6))]  # outer, then a hole
    lesion = [_rectangle(study, 2, (4, 6), (4, 8))]
    point = ("POINT", [float(v) for v in _lps(study, np.array([[1.0, 1.0, 3.0]]))[0]])
    path = write_rtstruct(tmp_path / "rs.dcm", study, {"prostate": gland, "lesion": lesion}, extra=[point])
    # Execute
    labels = read_rtstruct(path, study)
    reading = read_mask(path, study)
    # Assert
    expected = np.zeros(study.shape, np.uint8)
    expected[2:13, 3:10, 1] = 1
    expected[5:8, 5:7, 1] = 0
    expected[4:7, 4:9, 2] = 2
    np.testing.assert_array_equal(labels.array, expected)
    assert labels.names == {1: "prostate", 2: "lesion"}
    np.testing.assert_array_equal(reading.labels.array, expected)
    assert reading.labels.names == {1: "prostate", 2: "lesion"}


def test_contour_between_slices_or_other_frame_of_reference(tmp_path: Path) -> None:
    write_series(tmp_path / "s", rows=20, columns=24, slices=4)
    study = open_study(tmp_path / "s")
    between = [c + (1.25 if n % 3 == 2 else 0.0) for n, c in enumerate(_rectangle(study, 1, (2, 5), (2, 5)))]
    path = write_rtstruct(tmp_path / "a.dcm", study, {"gland": [between]})
    with pytest.raises(DataError, match=r"a\.dcm: ROI 'gland': a contour around .* does not lie on a slice"):
        read_rtstruct(path, study)
    other = write_rtstruct(tmp_path / "b.dcm", study, {"gland": [_rectangle(study, 1, (2, 5), (2, 5))]},
                           frame_uid=generate_uid())
    with pytest.raises(DataError, match=r"b\.dcm: the RTSTRUCT's contours are in frame of reference .* drawn on "
                                        "another series"):
        read_mask(other, study)


def test_rtstruct_opened_as_an_image_says_it_is_a_mask(tmp_path: Path) -> None:
    write_series(tmp_path / "s", slices=2)
    study = open_study(tmp_path / "s")
    path = write_rtstruct(tmp_path / "rs.dcm", study, {"gland": [_rectangle(study, 0, (1, 3), (1, 3))]})
    with pytest.raises(DataError, match=r"rs\.dcm: is an RT Structure Set \(contours: a mask, not an image\)"):
        open_study(path)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared real data not present")
def test_rt_utils_structure_set_on_prostatex(tmp_path: Path) -> None:
    """rt-utils writes contours of a mask on the real series; FedSM rasterises them back onto it."""
    # an independent RTSTRUCT writer; optional (it pulls in OpenCV), so the check runs where it is installed
    RTStructBuilder = pytest.importorskip("rt_utils").RTStructBuilder

    study = open_study(PROSTATEX)
    canonical = np.zeros(study.shape, bool)
    ii, jj = np.meshgrid(np.arange(study.shape[0]), np.arange(study.shape[1]), indexing="ij")
    disc = (ii - 190) ** 2 + (jj - 170) ** 2 < 40**2
    canonical[:, :, 8:11] = disc[:, :, None]
    canonical[170:200, 150:190, 12] = True
    # rt-utils wants (rows, columns, slices) with slices in its own order (by SOP instance)
    builder = RTStructBuilder.create_new(dicom_series_path=str(PROSTATEX))
    source = study.source_grid
    assert source is not None
    on_source = source.to_source(canonical)  # (column, row, slice ascending along the normal)
    files_ascending = sorted(study.dicom_files, key=lambda p: _normal_position(p))
    uid_to_k = {pydicom.dcmread(p, stop_before_pixels=True).SOPInstanceUID: k for k, p in enumerate(files_ascending)}
    mask = np.stack([on_source[:, :, uid_to_k[ds.SOPInstanceUID]].T for ds in builder.series_data], axis=2)
    builder.add_roi(mask=mask, name="gland")
    builder.save(str(tmp_path / "rs.dcm"))
    # Execute
    labels = read_mask(tmp_path / "rs.dcm", study).labels
    # Assert: the same voxels, up to the boundary pixels a traced contour may shift
    ours = labels.array == 1
    dice = 2 * np.logical_and(ours, canonical).sum() / (ours.sum() + canonical.sum())
    assert labels.names == {1: "gland"}
    assert dice > 0.97, dice
    assert set(np.flatnonzero(ours.any(axis=(0, 1)))) == {8, 9, 10, 12}


def _normal_position(path: Path) -> float:
    ds = pydicom.dcmread(path, stop_before_pixels=True)
    o = np.array(ds.ImageOrientationPatient, dtype=float)
    return float(np.dot(np.cross(o[:3], o[3:]), np.array(ds.ImagePositionPatient, dtype=float)))
