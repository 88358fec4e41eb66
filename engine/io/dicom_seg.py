"""DICOM Segmentation objects (SEG): write a mask that references its source series, read one back.

Both directions place every frame by geometry, never by file or frame order: a frame's pixel
``(row, column)`` sits at ``ImagePositionPatient + column * PixelSpacing[1] * row_direction +
row * PixelSpacing[0] * column_direction`` (DICOM LPS millimetres), which the study's affine
(voxel -> RAS+) turns into canonical voxel indices. A frame must land on the study's voxel grid:
axis-aligned with it, same pixel size, on whole voxels (within :data:`GRID_TOLERANCE` voxel),
inside the volume. So a SEG written from a canonical array reads back to the same array, and a
SEG made on another series, at another resolution or of another patient is refused with both
geometries in the message.

Frames whose SEG has no plane positions are placed through the source image they reference
(``DerivationImageSequence``), whose own position comes from the study's ``dicom_files``.

pydicom and highdicom are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import engine
from engine.errors import DataError
from engine.io.atomic import atomic_path
from engine.io.codestream import FrameHeader, check_compressed_frames
from engine.io.dicom_series import SEG_SOP_CLASS, read_header
from engine.io.guard import check_dicom_inflate, check_pixel_budget, dicom_damage
from engine.io.provenance import Provenance
from engine.io.seg_privacy import minimal_source, strip_identifiers
from engine.io.study import LabelMap, Study

if TYPE_CHECKING:
    import highdicom as hd
    import pydicom

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

#: Largest distance, in voxels, between a frame's pixel centres and the study's voxel centres.
GRID_TOLERANCE = 0.1
#: DICOM LPS <-> RAS+: flip x and y.
_LPS_TO_RAS = np.array([-1.0, -1.0, 1.0])
#: DICOM LO (ContentDescription) holds at most 64 characters.
_LO_MAX = 64


@dataclass(frozen=True)
class PlaneGeometry:
    """Where a 2D frame lies in patient space (DICOM conventions, LPS millimetres).

    Attributes
    ----------
    position
        ``ImagePositionPatient``: centre of the first (top-left) pixel.
    orientation
        ``ImageOrientationPatient``: direction of increasing column index (first three values),
        then of increasing row index.
    spacing
        ``PixelSpacing``: (distance between rows, distance between columns).
    rows, columns
        Frame size in pixels.
    """

    position: tuple[float, float, float]
    orientation: tuple[float, ...]
    spacing: tuple[float, float]
    rows: int
    columns: int

    def describe(self) -> str:
        return (
            f"{self.rows}x{self.columns} pixels of {self.spacing[0]:.4g}x{self.spacing[1]:.4g} mm, "
            f"orientation {_vector(self.orientation)}, first pixel at {_vector(self.position, 2)} mm LPS"
        )


def describe_study_geometry(study: Study) -> str:
    """The study's voxel grid in words, for error messages."""
    affine = np.asarray(study.affine, dtype=float)
    spacing = "x".join(f"{s:.4g}" for s in study.spacing)
    axes = "; ".join(_vector(affine[:3, a]) for a in range(3))
    return (
        f"shape {tuple(study.shape)}, spacing {spacing} mm, voxel (0, 0, 0) at {_vector(affine[:3, 3], 2)} mm RAS, "
        f"voxel axes {axes}"
    )


def _vector(values: Any, digits: int = 3) -> str:
    # + 0.0 turns -0.0 into 0.0 so messages do not show "-0.000".
    return "[" + ", ".join(f"{round(float(v), digits) + 0.0:.{digits}f}" for v in values) + "]"


class _OffGrid(Exception):
    """A frame does not fall on the study's voxel grid (reason in the message)."""


def frame_voxel_index(plane: PlaneGeometry, affine: np.ndarray, shape: Sequence[int]) -> tuple[Any, Any, Any]:
    """Canonical voxel indices of every pixel of a frame.

    Returns
    -------
    (i, j, k)
        Integer index arrays broadcasting to ``(rows, columns)``, so ``volume[i, j, k]`` is the
        frame and ``volume[i, j, k] = frame`` places it.

    Raises
    ------
    _OffGrid
        When the frame is oblique to the grid, has another pixel size, lies between voxels,
        or reaches outside the volume.
    """
    inverse = np.linalg.inv(np.asarray(affine, dtype=float))
    linear = inverse[:3, :3]
    origin = inverse[:3, :3] @ (np.asarray(plane.position, dtype=float) * _LPS_TO_RAS) + inverse[:3, 3]
    orientation = np.asarray(plane.orientation, dtype=float)
    # One step down a column (next row) and one step along a row (next column), in voxels.
    row_step = linear @ (orientation[3:] * plane.spacing[0] * _LPS_TO_RAS)
    col_step = linear @ (orientation[:3] * plane.spacing[1] * _LPS_TO_RAS)

    row_axis = int(np.argmax(np.abs(row_step)))
    col_axis = int(np.argmax(np.abs(col_step)))
    if row_axis == col_axis:
        raise _OffGrid("its rows and columns run along the same voxel axis")
    row_unit = np.round(row_step)
    col_unit = np.round(col_step)
    start = np.round(origin)
    # Worst distance from a voxel centre anywhere in the frame: drift accumulates along the frame.
    drift = (
        np.abs(row_step - row_unit).max() * (plane.rows - 1)
        + np.abs(col_step - col_unit).max() * (plane.columns - 1)
        + np.abs(origin - start).max()
    )
    steps = f"one row down is {_vector(row_step)} voxels, one column right {_vector(col_step)}"
    if abs(row_unit[row_axis]) != 1 or abs(col_unit[col_axis]) != 1:
        raise _OffGrid(f"its pixel size differs from the study's voxel size ({steps})")
    if drift > GRID_TOLERANCE:
        # Angles in millimetres (world space): voxel space distorts them when spacing is anisotropic.
        axes = np.asarray(affine, dtype=float)[:3, :3]
        turned = [float(np.degrees(np.arccos(min(1.0, abs(float(direction @ axes[:, axis]))
                                                  / float(np.linalg.norm(axes[:, axis]))))))
                  for direction, axis in ((orientation[3:] * _LPS_TO_RAS, row_axis),
                                          (orientation[:3] * _LPS_TO_RAS, col_axis))]
        angle = (f"; its orientation differs from the study's by {max(turned):.2f} degrees (column direction "
                 f"{turned[0]:.2f}, row direction {turned[1]:.2f})" if max(turned) >= 0.01 else "")
        raise _OffGrid(f"its pixels fall up to {drift:.2f} voxel from the study's voxel centres ({steps}{angle})")
    start_index = start.astype(np.int64)
    rows = np.arange(plane.rows, dtype=np.int64)[:, None]
    cols = np.arange(plane.columns, dtype=np.int64)[None, :]
    index: list[Any] = []
    for axis in range(3):
        if axis == row_axis:
            values = start_index[axis] + int(row_unit[axis]) * rows
        elif axis == col_axis:
            values = start_index[axis] + int(col_unit[axis]) * cols
        else:
            values = np.int64(start_index[axis])
        if int(np.min(values)) < 0 or int(np.max(values)) >= shape[axis]:
            raise _OffGrid(
                f"it reaches voxel {int(np.min(values))}..{int(np.max(values))} along axis {axis}, "
                f"outside 0..{shape[axis] - 1}"
            )
        index.append(values)
    return index[0], index[1], index[2]


def _item(sequence: Any) -> Any:
    return sequence[0] if sequence else None


def _frame_attribute(seg: Any, frame: int, group: str, attribute: str) -> Any:
    """An attribute of a per-frame functional group, falling back to the shared groups."""
    candidates = []
    per_frame = seg.get("PerFrameFunctionalGroupsSequence")
    if per_frame:
        candidates.append(per_frame[frame])
    shared = seg.get("SharedFunctionalGroupsSequence")
    if shared:
        candidates.append(shared[0])
    for groups in candidates:
        item = _item(groups.get(group))
        if item is not None and attribute in item:
            return item.get(attribute)
    return None


def _plane_of_image(ds: pydicom.Dataset, where: str) -> PlaneGeometry:
    """Geometry of a single-frame DICOM image from its header."""
    try:
        return PlaneGeometry(
            position=tuple(float(v) for v in ds.ImagePositionPatient),  # type: ignore[arg-type]
            orientation=tuple(float(v) for v in ds.ImageOrientationPatient),
            spacing=tuple(float(v) for v in ds.PixelSpacing),  # type: ignore[arg-type]
            rows=int(ds.Rows),
            columns=int(ds.Columns),
        )
    except (AttributeError, TypeError, ValueError) as exc:
        raise DataError(
            f"{where}: lacks the position, orientation, pixel spacing or size a segmentation needs ({exc})"
        ) from None


def _planes_of_source(ds: pydicom.Dataset, where: str) -> list[PlaneGeometry]:
    """One plane per frame of a source image: a classic single-frame file, or an enhanced multi-frame one."""
    if int(ds.get("NumberOfFrames") or 1) == 1 and "PerFrameFunctionalGroupsSequence" not in ds:
        return [_plane_of_image(ds, where)]
    planes = []
    for frame in range(int(ds.get("NumberOfFrames") or 1)):
        position = _frame_attribute(ds, frame, "PlanePositionSequence", "ImagePositionPatient")
        orientation = _frame_attribute(ds, frame, "PlaneOrientationSequence", "ImageOrientationPatient")
        spacing = _frame_attribute(ds, frame, "PixelMeasuresSequence", "PixelSpacing")
        if position is None or orientation is None or spacing is None:
            raise DataError(f"{where}: frame {frame + 1} lacks the position, orientation or pixel spacing a "
                            "segmentation needs")
        planes.append(PlaneGeometry(
            position=tuple(float(v) for v in position),  # type: ignore[arg-type]
            orientation=tuple(float(v) for v in orientation),
            spacing=tuple(float(v) for v in spacing),  # type: ignore[arg-type]
            rows=int(ds.Rows),
            columns=int(ds.Columns),
        ))
    return planes


def _read_header(path: Path) -> pydicom.Dataset:
    import pydicom

    check_dicom_inflate(path)
    try:
        return pydicom.dcmread(path, stop_before_pixels=True)
    except Exception as exc:  # pydicom raises struct.error, EOFError, ValueError, ... on damaged files
        raise DataError(f"{path}: cannot read the DICOM header ({type(exc).__name__}: {exc}); the file is missing, "
                        "damaged or truncated — copy it again") from None


def _check_study(study: Study, labels: LabelMap | None = None) -> None:
    if study.kind != "volume" or not study.dicom_files:
        raise DataError(
            f"{study.source or 'this study'}: a DICOM SEG must reference a DICOM image series, and this "
            f"study was read from {study.source_format or 'memory'}; export the mask as NIfTI (.nii.gz) instead"
        )
    if labels is not None and tuple(labels.array.shape) != tuple(study.shape):
        raise DataError(
            f"the mask's shape {tuple(labels.array.shape)} differs from the study's {tuple(study.shape)}; "
            "a mask must be aligned voxel for voxel with its study"
        )


# --- writing -------------------------------------------------------------------------------------


def _segment_codes(name: str) -> tuple[Any, Any]:
    """(category, type) codes for a structure name: SNOMED CT's anatomy code when one matches."""
    from pydicom.sr.codedict import codes

    category = codes.cid7150.AnatomicalStructure
    key = "".join(part.capitalize() for part in name.replace("-", " ").replace("_", " ").split())
    try:
        return category, getattr(codes.SCT, key)
    except AttributeError:
        return category, codes.cid7150.AnatomicalStructure


def _algorithm(provenance: Provenance) -> hd.AlgorithmIdentificationSequence:
    import highdicom as hd
    from pydicom.sr.codedict import codes

    parameters = {
        "bundle": provenance.bundle_name,
        "bundle_sha256": provenance.bundle_sha256,
        "task": provenance.task,
        "method": provenance.method,
        "routing": provenance.routing,
        "gamma": "none" if provenance.gamma is None else f"{provenance.gamma:g}",
        "forced_model": provenance.forced_model or "none",
        "models_used": "+".join(f"{k}:{v}" for k, v in provenance.models_used.items()),
    }
    return hd.AlgorithmIdentificationSequence(
        name="FedSM super model",
        family=codes.cid7162.ArtificialIntelligence,
        version=provenance.engine_version,
        source="FedSM",
        parameters=parameters,
    )


def build_dicom_seg(study: Study, labels: LabelMap, provenance: Provenance | None = None) -> hd.seg.Segmentation:
    """A BINARY DICOM SEG of ``labels`` referencing every file of ``study``'s DICOM series.

    Label value ``v`` becomes segment number ``v`` labelled ``labels.names[v]``; values between
    1 and the largest name without a name get ``"label <v>"`` (DICOM numbers segments 1..N).
    Empty frames are left out, as the standard allows; a reader fills them with background.

    Raises
    ------
    DataError
        When the study is not from DICOM, the mask does not fit it, a value has no segment, or
        a source file's geometry does not match the study's voxel grid.
    """
    import highdicom as hd

    _check_study(study, labels)
    array = np.asarray(labels.array)
    values = {int(v) for v in np.unique(array)} - {0}
    unnamed = sorted(values - set(labels.names))
    if unnamed:
        raise DataError(
            f"mask values {unnamed} have no structure name (names: {labels.names}); name every label before "
            "exporting a DICOM SEG"
        )
    if not labels.names:
        raise DataError("the mask names no structures; a DICOM SEG needs at least one segment")
    if min(labels.names) < 1 or max(labels.names) > 255:
        raise DataError(f"segment values must be 1..255, got {sorted(labels.names)}")

    headers = [_read_header(Path(p)) for p in study.dicom_files]
    # Frames in highdicom's order: one per single-frame source file, or one per frame of the
    # (single) multi-frame source.
    sources = [(path, plane) for path, ds in zip(study.dicom_files, headers, strict=True)
               for plane in _planes_of_source(ds, str(path))]
    if len(sources) != len(headers) and len(headers) > 1:
        raise DataError(
            f"series {study.series_uid}: is stored as {len(headers)} multi-frame files; a DICOM SEG can reference "
            "single-frame files or one multi-frame file, export the mask as NIfTI (.nii.gz) instead"
        )
    frames = np.zeros((len(sources), int(headers[0].Rows), int(headers[0].Columns)), dtype=np.uint8)
    coverage = np.zeros(study.shape, dtype=np.uint8)
    for n, (path, plane) in enumerate(sources):
        if (plane.rows, plane.columns) != frames.shape[1:]:
            raise DataError(
                f"{path}: is {plane.rows}x{plane.columns} pixels but {study.dicom_files[0]} is "
                f"{frames.shape[1]}x{frames.shape[2]}; the series mixes image sizes, choose one series"
            )
        try:
            index = frame_voxel_index(plane, study.affine, study.shape)
        except _OffGrid as exc:
            raise DataError(
                f"{path} ({plane.describe()}) does not lie on the study's voxel grid "
                f"({describe_study_geometry(study)}): {exc}; the study's dicom_files must be the series it "
                "was read from"
            ) from None
        frames[n] = array[index]
        coverage[index] += 1
    if not np.all(coverage == 1):
        raise DataError(
            f"the {len(sources)} source images cover {int(np.count_nonzero(coverage))} of {coverage.size} voxels "
            f"of the study ({describe_study_geometry(study)}), some of them more than once; the study's "
            "dicom_files must be exactly the series it was read from"
        )

    segment_numbers = range(1, max(labels.names) + 1)
    algorithm = _algorithm(provenance) if provenance is not None else None
    descriptions = []
    for number in segment_numbers:
        name = labels.names.get(number, f"label {number}")
        category, kind = _segment_codes(name)
        descriptions.append(
            hd.seg.SegmentDescription(
                segment_number=number,
                segment_label=name[:_LO_MAX],
                segmented_property_category=category,
                segmented_property_type=kind,
                algorithm_type="AUTOMATIC" if algorithm is not None else "MANUAL",
                algorithm_identification=algorithm,
            )
        )
    first = headers[0]
    description = provenance.summary() if provenance is not None else "Mask exported by FedSM"
    with warnings.catch_warnings():
        # highdicom re-checks the source's PatientName; a one-part name ("ProstateX-0000") is
        # legal DICOM and copied unchanged, so its "unlikely person name" warning is noise.
        warnings.filterwarnings("ignore", message=".*unlikely to represent the intended person name")
        try:
            seg = hd.seg.Segmentation(
                # Reduced copies: highdicom copies patient, study and equipment attributes from its
                # sources, and a mask needs only the required ones (engine.io.seg_privacy).
                source_images=[minimal_source(h) for h in headers],
                pixel_array=frames,
                segmentation_type="BINARY",
                segment_descriptions=descriptions,
                series_instance_uid=hd.UID(),
                series_number=int(first.get("SeriesNumber") or 0) + 1000,
                sop_instance_uid=hd.UID(),
                instance_number=1,
                manufacturer="FedSM",
                manufacturer_model_name="FedSM engine",
                software_versions=engine.__version__,
                device_serial_number="none",
                content_description=description[:_LO_MAX],
                content_label="FEDSM_SEG",
                series_description=f"FedSM {provenance.task if provenance else 'mask'} segmentation"[:_LO_MAX],
                # An all-background mask still needs frames to be a valid, readable SEG.
                omit_empty_frames=bool(values),
            )
        except (ValueError, TypeError, AttributeError) as exc:
            raise DataError(f"cannot build a DICOM SEG on series {study.series_uid or first.get('SeriesInstanceUID')}: "
                            f"{exc}") from None
    # Our own equipment's serial number ("none") is required by the Enhanced General Equipment module.
    strip_identifiers(seg, keep=("DeviceSerialNumber",))
    return seg


def save_dicom_seg(seg: hd.seg.Segmentation, path: PathLike) -> None:
    """Write a built SEG to ``path`` (not atomic by itself; callers wrap it in ``atomic_path``)."""
    seg.save_as(str(path), enforce_file_format=True)


def write_dicom_seg(
    study: Study, labels: LabelMap, out_path: PathLike, provenance: Provenance | None = None
) -> Path:
    """Write ``labels`` as a DICOM SEG referencing ``study``'s series, atomically; return the path.

    See :func:`build_dicom_seg` for the encoding and errors.
    """
    seg = build_dicom_seg(study, labels, provenance)
    out = Path(out_path)
    with atomic_path(out) as tmp:
        save_dicom_seg(seg, tmp)
    return out


# --- reading -------------------------------------------------------------------------------------


def _source_uid(seg: Any, frame: int) -> str | None:
    per_frame = seg.get("PerFrameFunctionalGroupsSequence")
    if not per_frame:
        return None
    derivation = _item(per_frame[frame].get("DerivationImageSequence"))
    source = _item(derivation.get("SourceImageSequence")) if derivation is not None else None
    return str(source.ReferencedSOPInstanceUID) if source is not None and "ReferencedSOPInstanceUID" in source else None


def _frame_plane(seg: Any, frame: int, sources: Callable[[], dict[str, PlaneGeometry]], path: Path) -> PlaneGeometry:
    """A SEG frame's plane: its own plane position, else that of the source image it references."""
    position = _frame_attribute(seg, frame, "PlanePositionSequence", "ImagePositionPatient")
    orientation = _frame_attribute(seg, frame, "PlaneOrientationSequence", "ImageOrientationPatient")
    spacing = _frame_attribute(seg, frame, "PixelMeasuresSequence", "PixelSpacing")
    if position is not None and orientation is not None and spacing is not None:
        return PlaneGeometry(
            position=tuple(float(v) for v in position),  # type: ignore[arg-type]
            orientation=tuple(float(v) for v in orientation),
            spacing=tuple(float(v) for v in spacing),  # type: ignore[arg-type]
            rows=int(seg.Rows),
            columns=int(seg.Columns),
        )
    uid = _source_uid(seg, frame)
    if uid is not None and uid in sources():
        return sources()[uid]
    raise DataError(
        f"{path}: frame {frame + 1} has no plane position and references no image of the study "
        f"({'source ' + uid if uid else 'no source reference'}); open the series the SEG was made on"
    )


def _source_planes(study: Study) -> dict[str, PlaneGeometry]:
    """Plane of each single-frame source image by SOP Instance UID (for SEGs without plane positions)."""
    planes = {}
    for path in study.dicom_files:
        ds = _read_header(Path(path))
        if "SOPInstanceUID" in ds and "ImagePositionPatient" in ds:
            planes[str(ds.SOPInstanceUID)] = _plane_of_image(ds, str(path))
    return planes


def _check_pixel_data(seg: Any, frames: int, path: Path) -> None:
    """Refuse a SEG without pixel data, whose uncompressed pixel data is shorter than its frames need, or
    whose compressed frames disagree with its header (:func:`engine.io.codestream.check_compressed_frames`).

    pydicom reads a value cut short by the end of the file without complaint, so a truncated SEG
    would otherwise fail deep in highdicom's frame decoding, or only for its last frames.
    """
    try:
        data = seg.get("PixelData")
        compressed = bool(seg.file_meta.TransferSyntaxUID.is_compressed)
        bits = int(seg.BitsAllocated) * int(seg.get("SamplesPerPixel", 1) or 1)
        needed = (frames * int(seg.Rows) * int(seg.Columns) * bits + 7) // 8
    except Exception as exc:  # any attribute of a damaged header can fail to parse
        raise DataError(f"{path}: the SEG header is damaged ({type(exc).__name__}: {exc}); export or copy the SEG "
                        "again") from None
    if not data:
        raise DataError(f"{path}: the SEG has no pixel data; the file is truncated or damaged — export or copy it "
                        "again")
    if not compressed and len(data) < needed:
        raise DataError(f"{path}: the SEG's pixel data is truncated ({len(data)} of the {needed} bytes its {frames} "
                        "frames need); export or copy the SEG again")
    if compressed:
        # A decoder allocates what each frame's codestream declares: check it against the header first.
        with dicom_damage(path):
            header = FrameHeader(int(seg.Rows), int(seg.Columns), int(seg.get("SamplesPerPixel", 1) or 1),
                                 int(seg.BitsAllocated))
            check_compressed_frames(path, data, header, frames, str(seg.file_meta.TransferSyntaxUID))


def _read_frame(seg: Any, frame: int, frames: int, seg_type: str, sources: Callable[[], dict[str, PlaneGeometry]],
                study: Study, path: Path) -> tuple[tuple[Any, Any, Any], np.ndarray, int]:
    """Where a SEG frame lies in the study, its stored values and (not LABELMAP) its segment number.

    Raises
    ------
    DataError
        Naming the file and the frame, when the frame lies off the study's grid or any part of it
        cannot be decoded (a damaged or truncated SEG).
    """
    try:
        plane = _frame_plane(seg, frame, sources, path)
        try:
            index = frame_voxel_index(plane, study.affine, study.shape)
        except _OffGrid as exc:
            raise DataError(
                f"{path}: frame {frame + 1} ({plane.describe()}) does not match the study's geometry "
                f"({describe_study_geometry(study)}): {exc}; open the image series the SEG was made on"
            ) from None
        stored = np.asarray(seg.get_stored_frame(frame, as_index=True))
        if seg_type == "LABELMAP":
            return index, stored, 0
        number = _frame_attribute(seg, frame, "SegmentIdentificationSequence", "ReferencedSegmentNumber")
        if number is None:
            raise DataError(f"{path}: frame {frame + 1} does not say which segment it belongs to")
        return index, stored, int(number)
    except DataError:
        raise
    except Exception as exc:  # highdicom and pydicom raise many types on damaged frames and functional groups
        raise DataError(f"{path}: frame {frame + 1} of {frames} cannot be read ({type(exc).__name__}: {exc}); the "
                        "SEG is damaged or truncated — export or copy it again") from None


def read_dicom_seg(path: PathLike, study: Study) -> LabelMap:
    """Read a DICOM SEG into a label map aligned voxel for voxel with ``study``.

    Parameters
    ----------
    path
        A DICOM SEG file (Modality ``SEG``; BINARY, FRACTIONAL or LABELMAP).
    study
        The image it segments (a volume; any source format whose geometry matches).

    Returns
    -------
    LabelMap
        ``uint8`` of ``study.shape``; voxel value = segment number (FRACTIONAL frames count as
        inside above half their maximum value; where segments overlap the higher number wins);
        ``names`` = segment number -> SegmentLabel.

    Raises
    ------
    DataError
        When the file is not a readable SEG (damaged or truncated: the message names the file and,
        when one frame is the trouble, the frame), has segment numbers above 255, or a frame does
        not lie on the study's voxel grid (both geometries in the message).
    """
    with dicom_damage(path):
        return _read_dicom_seg(Path(path), study)


def _read_dicom_seg(p: Path, study: Study) -> LabelMap:
    """:func:`read_dicom_seg`, whose pydicom errors on damaged values the caller turns into DataError."""
    import highdicom as hd

    if not p.is_file():
        raise DataError(f"{p}: file not found")
    if study.kind != "volume":
        raise DataError(f"{p}: a DICOM SEG segments a volume, but {study.source or 'the study'} is a 2D photo")
    # dicom_series' header reader also refuses a file cut short (pydicom reads it without complaint).
    header = read_header(p)
    if header is None:
        raise DataError(f"{p}: not a DICOM file; choose the SEG file")
    try:
        modality = header.get("Modality")
        sop_classes = {str(header.get("SOPClassUID", "")), str(header.file_meta.get("MediaStorageSOPClassUID", ""))}
    except Exception as exc:  # an unparsable value in a damaged header
        raise DataError(f"{p}: the DICOM header is damaged ({type(exc).__name__}: {exc}); copy the SEG again") from None
    if modality is None and SEG_SOP_CLASS in sop_classes:
        raise DataError(f"{p}: is a DICOM SEG whose header stops before its Modality; the file is truncated — export "
                        "or copy it again")
    if modality != "SEG":
        raise DataError(
            f"{p}: is a DICOM {modality or 'file without modality'}, not a segmentation (SEG); choose the SEG file"
        )
    # Decoded frames are allocated from these numbers: check them before highdicom reads anything.
    check_pixel_budget(p, int(header.get("Rows") or 0), int(header.get("Columns") or 0),
                       int(header.get("NumberOfFrames") or 1), int(header.get("BitsAllocated") or 8))
    try:
        seg = hd.seg.segread(p)
    except Exception as exc:  # highdicom raises many types for damaged or unusual objects
        raise DataError(f"{p}: not a readable DICOM SEG ({type(exc).__name__}: {exc}); the file is damaged, "
                        "truncated or not a segmentation — export or copy it again") from None
    try:
        seg_type = str(seg.SegmentationType)
        names = {int(d.SegmentNumber): str(d.get("SegmentLabel", f"segment {int(d.SegmentNumber)}"))
                 for d in seg.SegmentSequence}
        frames = int(seg.get("NumberOfFrames", 1))
        max_fraction = float(seg.get("MaximumFractionalValue", 1) or 1)
    except Exception as exc:  # any attribute of a damaged header can fail to parse
        raise DataError(f"{p}: the SEG header is damaged ({type(exc).__name__}: {exc}); export or copy the SEG "
                        "again") from None
    if names and max(names) > 255:
        raise DataError(f"{p}: has segment numbers up to {max(names)}; FedSM label maps hold values up to 255")
    _check_pixel_data(seg, frames, p)
    if study.dicom_files:
        own = _read_header(Path(study.dicom_files[0])).get("FrameOfReferenceUID")
        if own and seg.get("FrameOfReferenceUID") and own != seg.FrameOfReferenceUID:
            log.warning("%s: frame of reference %s differs from the study's %s; placing frames by position",
                        p, seg.FrameOfReferenceUID, own)
    source_planes: dict[str, PlaneGeometry] = {}

    def sources() -> dict[str, PlaneGeometry]:
        # Read the source headers only for a SEG whose frames lack plane positions.
        if not source_planes and study.dicom_files:
            source_planes.update(_source_planes(study))
        return source_planes

    out = np.zeros(study.shape, dtype=np.uint8)
    overlaps = 0
    for frame in range(frames):
        index, stored, number = _read_frame(seg, frame, frames, seg_type, sources, study, p)
        if seg_type == "LABELMAP":
            values = stored.astype(np.int64)
            if values.max(initial=0) > 255:
                raise DataError(f"{p}: frame {frame + 1} holds label values above 255")
            region = out[index]
            region = np.where(values > 0, values, region).astype(np.uint8)
            out[index] = region
            continue
        inside = stored > max_fraction / 2 if seg_type == "FRACTIONAL" else stored > 0
        region = out[index]
        overlaps += int(np.count_nonzero(inside & (region > 0) & (region != number)))
        # Higher segment numbers win where segments overlap, whatever the frame order.
        out[index] = np.where(inside & (region < number), np.uint8(number), region)
    if overlaps:
        log.warning("%s: segments overlap in %d voxels; the higher segment number was kept", p, overlaps)
    return LabelMap(array=out, names=names, source=p)
