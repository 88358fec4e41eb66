"""DICOM RT Structure Sets (RTSTRUCT) as masks: contours rasterised onto the opened study.

An RTSTRUCT holds, per region of interest (ROI), closed polygons in patient coordinates (DICOM
LPS millimetres), one or more per image plane. :func:`read_rtstruct` turns them into a label map
on the study's voxel grid:

- every ROI of ``StructureSetROISequence`` gets the label value of its position (1, 2, ...; at
  most 255) and its ``ROIName``; where ROIs overlap the later one wins;
- each ``CLOSED_PLANAR`` contour is mapped to voxel coordinates through the study's affine and
  must lie in one plane of voxels (its points within :data:`PLANE_TOLERANCE` voxel of one
  slice index along one axis: axial, sagittal or coronal series alike); a contour between
  slices, or outside the image, is a :class:`~engine.errors.DataError` naming the ROI;
- the polygon is filled on that plane with Pillow (voxel centres on and inside the polygon);
  contours of one ROI on the same plane are combined even-odd, so a contour inside another is a
  hole (the common RTSTRUCT convention);
- ``POINT`` and ``OPEN_PLANAR`` contours (markers, lines) have no inside and are skipped (logged).

When the study was read from DICOM, the structure set's referenced frame of reference must be
the series' own: contours from another frame of reference lie in other coordinates.
Nothing is resampled; the study's pixels are not needed, only its geometry.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import DataError
from engine.io.dicom_series import has_dicm_marker
from engine.io.guard import check_dicom_inflate, dicom_damage
from engine.io.study import LabelMap, Study

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

RTSTRUCT_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.481.3"
#: Largest distance, in voxels, of a contour point from the slice plane it is drawn on.
PLANE_TOLERANCE = 0.1
#: Most contour points read from one file (a guard against hostile files; real sets hold < 10^6).
MAX_POINTS = 20_000_000


def is_rtstruct_header(ds: Any) -> bool:
    """Whether a parsed DICOM header is an RT Structure Set."""
    meta = getattr(ds, "file_meta", None)
    sop_classes = {str(ds.get("SOPClassUID", "")),
                   str(meta.get("MediaStorageSOPClassUID", "") if meta is not None else "")}
    return str(ds.get("Modality", "")).upper() == "RTSTRUCT" or RTSTRUCT_SOP_CLASS in sop_classes


def is_rtstruct(path: PathLike) -> bool:
    """Whether ``path`` is a DICOM RT Structure Set file (header only)."""
    import pydicom

    p = Path(path)
    if not p.is_file() or not has_dicm_marker(p):
        return False
    check_dicom_inflate(p)
    try:
        ds = pydicom.dcmread(p, stop_before_pixels=True, specific_tags=["Modality", "SOPClassUID"])
    except Exception as exc:  # a damaged header
        raise DataError(f"{p}: damaged DICOM file ({type(exc).__name__}: {exc}); copy it again") from None
    with dicom_damage(p):
        return is_rtstruct_header(ds)


def read_rtstruct(path: PathLike, study: Study) -> LabelMap:
    """Rasterise an RTSTRUCT's contours onto ``study`` (see the module docstring).

    Returns
    -------
    LabelMap
        ``uint8`` of ``study.shape``; value ``n`` = the ``n``-th ROI, named by its ``ROIName``.

    Raises
    ------
    DataError
        When the file is not a readable RTSTRUCT, the study is a photo, the frame of reference
        differs from the series', or a contour is damaged, between slices or outside the image.
    """
    p = Path(path)
    with dicom_damage(p):
        return _read(p, study)


def _read(p: Path, study: Study) -> LabelMap:
    import pydicom

    if study.kind != "volume":
        raise DataError(f"{p}: an RTSTRUCT outlines structures of a volume, but {study.source or 'the study'} is a "
                        "2D photo; a photo's mask is a PNG label map")
    check_dicom_inflate(p)
    try:
        ds = pydicom.dcmread(p)
    except Exception as exc:  # pydicom raises many types on damaged files
        raise DataError(f"{p}: not a readable DICOM file ({type(exc).__name__}: {exc}); copy it again") from None
    if not is_rtstruct_header(ds):
        raise DataError(f"{p}: is not an RT Structure Set (RTSTRUCT)")
    _check_frame_of_reference(p, ds, study)
    rois = list(ds.get("StructureSetROISequence") or [])
    if not rois:
        raise DataError(f"{p}: the RTSTRUCT defines no regions of interest (empty StructureSetROISequence)")
    if len(rois) > 255:
        raise DataError(f"{p}: has {len(rois)} regions of interest; a FedSM label map holds at most 255")
    value_of = {int(r.ROINumber): n for n, r in enumerate(rois, start=1)}
    names = {n: str(r.get("ROIName") or f"ROI {int(r.ROINumber)}") for n, r in enumerate(rois, start=1)}
    out = np.zeros(study.shape, dtype=np.uint8)
    to_voxel = np.linalg.inv(np.asarray(study.affine, dtype=np.float64))
    total_points = 0
    for roi_contour in ds.get("ROIContourSequence") or []:
        number = int(roi_contour.ReferencedROINumber)
        if number not in value_of:
            raise DataError(f"{p}: contours reference ROI number {number}, which StructureSetROISequence does not "
                            "define; the file is damaged")
        value, name = value_of[number], names[value_of[number]]
        planes: dict[tuple[int, int], np.ndarray] = {}
        skipped = 0
        for contour in roi_contour.get("ContourSequence") or []:
            kind = str(contour.get("ContourGeometricType", "CLOSED_PLANAR")).upper()
            if kind != "CLOSED_PLANAR":
                skipped += 1
                continue
            points = _points(p, name, contour)
            total_points += len(points)
            if total_points > MAX_POINTS:
                raise DataError(f"{p}: holds more than {MAX_POINTS:,} contour points; the file is damaged or hostile")
            axis, index, polygon = _on_plane(p, name, points, to_voxel, study.shape)
            filled = _fill(polygon, [study.shape[a] for a in range(3) if a != axis])
            key = (axis, index)
            planes[key] = planes[key] ^ filled if key in planes else filled
        if skipped:
            log.info("%s: ROI %r: %d POINT/OPEN_PLANAR contour(s) have no inside and were skipped", p, name, skipped)
        for (axis, index), filled in planes.items():
            where: list[Any] = [slice(None)] * 3
            where[axis] = index
            out[tuple(where)][filled] = value
    return LabelMap(out, names, p)


def _check_frame_of_reference(p: Path, ds: Any, study: Study) -> None:
    refs = [str(r.get("FrameOfReferenceUID", "")) for r in ds.get("ReferencedFrameOfReferenceSequence") or []]
    refs = [r for r in refs if r]
    if not refs or not study.dicom_files:
        return
    import pydicom

    own = str(pydicom.dcmread(study.dicom_files[0], stop_before_pixels=True,
                              specific_tags=["FrameOfReferenceUID"]).get("FrameOfReferenceUID", ""))
    if own and own not in refs:
        raise DataError(f"{p}: the RTSTRUCT's contours are in frame of reference {refs[0]}, the series "
                        f"{study.series_uid or study.source} in {own}: they were drawn on another series — open "
                        "the series the structure set references")


def _points(p: Path, name: str, contour: Any) -> np.ndarray:
    raw = contour.get("ContourData")
    try:
        points = np.asarray([float(v) for v in (raw or [])], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{p}: ROI {name!r}: ContourData is not numbers ({exc}); the file is damaged") from None
    if points.size % 3 or points.size < 9 or not np.isfinite(points).all():
        raise DataError(f"{p}: ROI {name!r}: a closed contour needs at least 3 finite (x, y, z) points, ContourData "
                        f"holds {points.size} values; the file is damaged")
    return points.reshape(-1, 3)


def _on_plane(p: Path, name: str, points: np.ndarray, to_voxel: np.ndarray, shape: tuple[int, ...]
              ) -> tuple[int, int, np.ndarray]:
    """The axis and slice index a contour lies on, and its polygon in the two other voxel axes."""
    ras = points * np.array([-1.0, -1.0, 1.0])  # DICOM LPS -> RAS+
    voxels = (to_voxel[:3, :3] @ ras.T + to_voxel[:3, 3:4]).T
    spread = voxels.max(axis=0) - voxels.min(axis=0)
    axis = int(np.argmin(spread))
    level = float(voxels[:, axis].mean())
    index = int(np.rint(level))
    centre = ", ".join(f"{v:.1f}" for v in points.mean(axis=0))
    if spread[axis] > 2 * PLANE_TOLERANCE or abs(level - index) > PLANE_TOLERANCE:
        raise DataError(f"{p}: ROI {name!r}: a contour around ({centre}) mm LPS does not lie on a slice of the image "
                        f"(voxel coordinate {level:.2f} along axis {'ijk'[axis]}, spread {spread[axis]:.2f}); the "
                        "structure set was drawn on another series or grid — open the series it references")
    if not 0 <= index < shape[axis]:
        raise DataError(f"{p}: ROI {name!r}: a contour around ({centre}) mm LPS lies outside the image (slice {index} "
                        f"along axis {'ijk'[axis]}, the image has {shape[axis]}); open the series it references")
    return axis, index, np.delete(voxels, axis, axis=1)


def _fill(polygon: np.ndarray, size: list[int]) -> np.ndarray:
    """Voxels ``(size[0], size[1])`` on or inside ``polygon`` (columns: the two in-plane voxel axes)."""
    from PIL import Image, ImageDraw

    rows, cols = size
    canvas = Image.new("1", (cols, rows), 0)
    # Rounded to 1/1000 voxel: a vertex on a voxel centre computed as 1.9999999 must not fill voxel 1.
    vertices = [(float(c), float(r)) for r, c in np.round(polygon, 3)]  # Pillow takes (x = column, y = row)
    ImageDraw.Draw(canvas).polygon(vertices, fill=1, outline=1)
    return np.asarray(canvas, dtype=bool)
