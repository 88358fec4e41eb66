"""DICOM folders: find the series in them, read one series as a canonical volume.

Scanning
    A folder is searched recursively (hidden files and folders skipped). A file counts as DICOM
    when it has the ``DICM`` marker after its 128-byte preamble; files without it are tried only
    when named ``*.dcm``/``*.dicom``/``*.ima``, without a suffix or with a UID-like name
    (``CT.1.2.840...``), so the extension-less files many archives write are found, and kept
    only when they parse and hold an image.
    Headers are read once, with the pixel data left on disk (pydicom's ``defer_size``), and grouped
    by ``SeriesInstanceUID``; files whose UID is empty are grouped by folder, modality, series
    number, description and size under a stable key starting ``nouid:``. DICOM SEG objects are
    listed as their own series with modality ``"SEG"`` (they are masks: see
    :mod:`engine.io.dicom_seg`); objects without pixels (structured reports, RT structures, ...)
    are skipped.

Reading a series
    Slices are ordered by ``ImagePositionPatient`` projected on the slice normal (the cross
    product of the two ``ImageOrientationPatient`` directions), never by file name or instance
    number (the latter only when a series has no positions at all, which is logged). Every slice
    must have the same rows and columns, orientation and pixel spacing, distinct positions and an
    even step; anything else is a :class:`~engine.errors.DataError` that names the series and
    what differs. ``RescaleSlope``/``RescaleIntercept`` are applied per slice (Hounsfield units
    for CT). Enhanced (multi-frame) files are read frame by frame through their functional groups.

    The voxel -> patient affine is built in DICOM's LPS from ``ImageOrientationPatient``,
    ``PixelSpacing`` and the position step between slices (so a gantry tilt is kept as a shear),
    then turned into RAS+; the voxels are put in RAS+ closest-canonical order
    (:mod:`engine.io.volumes`) while they are written, without a second copy: the study's array
    is a view of a slice-major buffer, so it has positive strides but is not C-contiguous (for
    axial series it is Fortran-ordered and every axial slice ``array[:, :, k]`` is contiguous).

Speed
    Each file is parsed once: headers while scanning, with the pixel data left on disk (pydicom's
    ``defer_size``) and numbers read straight from the raw element bytes; uncompressed pixel data
    is taken with ``numpy.frombuffer``; a compressed single-frame greyscale file is decoded by
    GDCM (SimpleITK's ``GDCMImageIO``, which applies the rescale itself), several files at once,
    with pydicom's ``pixel_array`` as the fallback; multi-frame and colour compressed files go
    through pydicom, and what pydicom cannot decode through GDCM. Measured against SimpleITK's
    ``ImageSeriesReader`` by ``benchmarks/dicom_load.py``.

Single colour images (``SamplesPerPixel == 3``, e.g. an ophthalmic photograph) are read as a
``"photo"`` study. Only de-identified descriptors are kept (:data:`DESCRIPTOR_KEYWORDS`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import CancelledError, DataError
from engine.io.codestream import FrameHeader, check_compressed_frames, check_native_length
from engine.io.guard import DEFLATED_SYNTAX, check_dicom_inflate, check_pixel_budget, dicom_damage
from engine.io.study import SeriesInfo, SourceGrid, Study
from engine.io.volumes import LPS_TO_RAS, MAX_VOXELS, canonical_layout, robust_window, voxel_spacing

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
ProgressFn = Callable[[dict[str, Any]], None]
CancelFn = Callable[[], bool]

#: Suffixes tried as DICOM even without the ``DICM`` marker (plus files with no suffix at all).
DICOM_SUFFIXES = (".dcm", ".dicom", ".ima")
#: Scanning stops with an error past this many files: the folder is not one study.
MAX_SCAN_FILES = 20_000
#: Threads that decode a compressed series' files at once (decoders run without the GIL).
DECODE_THREADS = min(4, os.cpu_count() or 1)
#: Elements larger than this are left on disk while scanning (pixel data, big private headers).
_DEFER_BYTES = 4096
SEG_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.66.4"
_DICOMDIR_SOP_CLASS = "1.2.840.10008.1.3.10"
_PIXEL_TAGS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")
#: Header keywords copied into ``Study.description``: acquisition facts, never identities or dates.
DESCRIPTOR_KEYWORDS = (
    "Modality", "SeriesDescription", "SeriesNumber", "BodyPartExamined", "Manufacturer",
    "ManufacturerModelName", "MagneticFieldStrength", "SliceThickness", "SpacingBetweenSlices",
    "RepetitionTime", "EchoTime", "FlipAngle", "KVP", "ConvolutionKernel", "PhotometricInterpretation",
    "ImageType", "SOPClassUID",
)
#: Orientation cosines and pixel spacings of one series may differ by this much (rounding in files).
_ORIENTATION_TOLERANCE = 1e-4
_SPACING_TOLERANCE = 1e-3  # relative
#: Slice steps may differ from the median step by this fraction before the series counts as uneven.
_STEP_TOLERANCE = 0.05


@dataclass(frozen=True)
class DicomFile:
    """One DICOM file found by :func:`scan_folder`, its header read, its pixels still on disk."""

    path: Path
    dataset: Any  # pydicom.Dataset; Any keeps pydicom out of the import
    series_key: str
    modality: str
    is_seg: bool

    @property
    def frames(self) -> int:
        return _int(_ascii(self.dataset, "NumberOfFrames"), 1) or 1


@dataclass
class _Plane:
    """One 2D image (a file, or one frame of a multi-frame file) and where it lies."""

    file: DicomFile
    frame: int | None
    rows: int
    columns: int
    position: np.ndarray | None
    orientation: np.ndarray | None
    spacing: tuple[float, float] | None
    slope: float
    intercept: float
    instance: int | None


# --- scanning ----------------------------------------------------------------------------------


def has_dicm_marker(path: Path) -> bool:
    """True when ``path`` has the ``DICM`` marker after a 128-byte preamble (a DICOM Part 10 file)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:132] == b"DICM"


def is_dicom_name(path: Path) -> bool:
    """True for names DICOM files often have: ``*.dcm``/``*.dicom``/``*.ima``, no suffix, or a UID-like name."""
    suffix = path.suffix.lower()
    # "CT.1.2.840..." style names have dots in them: a "suffix" of digits is not a file type.
    return suffix in DICOM_SUFFIXES or suffix == "" or suffix[1:].isdigit()


def _walk(folder: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(root) / name


def read_header(path: Path, marker: bool | None = None) -> Any | None:
    """A DICOM file's header with its pixel data left on disk, or ``None`` when it is not DICOM.

    Raises
    ------
    DataError
        When the file has the ``DICM`` marker or a DICOM suffix but cannot be parsed (damaged
        or truncated).
    """
    import pydicom
    from pydicom.errors import InvalidDicomError

    if marker is None:
        marker = has_dicm_marker(path)
    named = path.suffix.lower() in DICOM_SUFFIXES
    if marker:
        check_dicom_inflate(path)  # a deflated dataset is inflated whole by dcmread: bound it first
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pydicom warns about every odd value; we check what we use
            ds = pydicom.dcmread(path, defer_size=_DEFER_BYTES, force=not marker)
    except InvalidDicomError as exc:
        if marker or named:
            raise DataError(f"{path}: not a valid DICOM file ({exc}); remove it from the folder or re-export "
                            "the series") from exc
        return None
    except Exception as exc:  # pydicom raises struct.error, EOFError, ValueError, ... on damaged files
        if marker or named:
            raise DataError(f"{path}: damaged or truncated DICOM file ({type(exc).__name__}: {exc}); remove it "
                            "from the folder or copy the series again") from exc
        return None
    if marker:
        with dicom_damage(path):
            _check_complete(path, ds)
    if not marker and not _looks_like_image_header(ds):
        if named:
            raise DataError(f"{path}: named like a DICOM file but holds no DICOM image; remove it from the folder")
        return None
    return ds


def _check_complete(path: Path, ds: Any) -> None:
    """Refuse a file cut short: pydicom reads a truncated value without complaint.

    The file meta group states its own length, and an element still in raw form knows where its
    value starts and how long it is; one reaching past the end of the file means truncation.
    """
    size = path.stat().st_size
    if len(ds) == 0:
        raise DataError(f"{path}: the DICOM file holds no data elements ({size} bytes); it is truncated or damaged — "
                        "copy the series again")
    meta = getattr(ds, "file_meta", None)
    meta_length = _int(meta.get("FileMetaInformationGroupLength")) if meta is not None else None
    if meta_length is not None and 132 + 12 + meta_length > size:
        raise DataError(f"{path}: the DICOM file is truncated (its header is cut short at {size} bytes); copy the "
                        "series again")
    # pydicom stops at the element the file ends in, the last one read (tag order is file order);
    # a few from the end cover elements it holds in converted form (sequences, deferred pixels).
    # A deferred value (pixel data) stays on disk: only its length and offset are looked at. In a
    # deflated file offsets count in the inflated stream, which pydicom holds in memory: values are
    # read there as before.
    keep_deferred = str(getattr(meta, "TransferSyntaxUID", "") if meta is not None else "") != DEFLATED_SYNTAX
    checked = 0
    for tag in reversed(list(ds.keys())):
        raw = ds.get_item(tag, keep_deferred=keep_deferred)
        length, start = getattr(raw, "length", None), getattr(raw, "value_tell", None)
        if length is None or start is None or length == 0xFFFFFFFF:
            continue
        checked += 1
        if checked > 3:
            break
        if start + length > size:
            raise DataError(f"{path}: the DICOM file is truncated (element {tag} needs {length} bytes at offset "
                            f"{start}, the file ends at {size}); copy the series again")


def _looks_like_image_header(ds: Any) -> bool:
    """A force-parsed file without the DICM marker counts only with an image's essentials."""
    try:
        return all(k in ds for k in ("Rows", "Columns")) and any(t in ds for t in _PIXEL_TAGS)
    except Exception:  # garbage parsed as elements can fail on any access
        return False


def _text(ds: Any, keyword: str) -> str:
    try:
        value = ds.get(keyword)
    except Exception:  # an unparsable value in a damaged header
        return ""
    if value is None:
        return ""
    if _is_multi(value):
        return "\\".join(str(v) for v in value)
    return str(value).strip()


def _raw_bytes(ds: Any, keyword: str) -> tuple[bytes, bool] | None:
    """A still-unconverted element's bytes and byte order, or ``None`` (absent, converted, deferred).

    Reading numbers and UIDs straight from the bytes skips pydicom's per-value conversion and
    validation, which costs more than parsing the whole header on a big series.
    """
    try:
        elem = ds.get_item(keyword)
    except Exception:  # a damaged header
        return None
    value = getattr(elem, "value", None)
    if type(elem).__name__ == "RawDataElement" and isinstance(value, bytes):
        return value, bool(getattr(elem, "is_little_endian", True))
    return None


def _ascii(ds: Any, keyword: str) -> str:
    """An ASCII-only value (UI, CS, IS, DS) as text, from the raw bytes when possible."""
    raw = _raw_bytes(ds, keyword)
    if raw is not None:
        return raw[0].decode("ascii", "replace").strip(" \x00")
    return _text(ds, keyword)


def _ushort(ds: Any, keyword: str) -> int | None:
    """A US (unsigned short) value, from the raw bytes when possible."""
    raw = _raw_bytes(ds, keyword)
    if raw is not None:
        data, little = raw
        return int.from_bytes(data[:2], "little" if little else "big") if len(data) >= 2 else None
    return _int(_first_value(ds.get(keyword)) if keyword in ds else None)


def _numbers(ds: Any, keyword: str) -> list[float] | None:
    """A DS/IS value (possibly several) as floats, ``None`` when absent or empty.

    Raises
    ------
    ValueError
        When the text is not numbers.
    """
    raw = _raw_bytes(ds, keyword)
    if raw is not None:
        text = raw[0].decode("ascii", "replace").strip(" \x00")
        return [float(v) for v in text.split("\\")] if text else None
    if keyword not in ds:
        return None
    value = ds.get(keyword)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    return [float(v) for v in value] if _is_multi(value) else [float(value)]


def _number(ds: Any, keyword: str, default: float) -> float:
    """The first number of a DS value, ``default`` when absent, empty, unparsable or not finite."""
    try:
        values = _numbers(ds, keyword)
    except (TypeError, ValueError):
        return default
    return values[0] if values and np.isfinite(values[0]) else default


def _int(value: Any, default: int | None = None) -> int | None:
    try:
        return int(value) if value is not None and str(value).strip() != "" else default
    except (TypeError, ValueError):
        return default


def _series_key(ds: Any, path: Path, folder: Path) -> str:
    uid = _ascii(ds, "SeriesInstanceUID")
    if uid:
        return uid
    try:
        rel = path.parent.relative_to(folder).as_posix()
    except ValueError:
        rel = path.parent.name
    parts = (rel if rel != "." else "", _ascii(ds, "Modality"), _ascii(ds, "SeriesNumber"),
             _text(ds, "SeriesDescription"), f"{_ushort(ds, 'Rows')}x{_ushort(ds, 'Columns')}")
    return "nouid:" + ":".join(parts)


def _uid_name(uid: str) -> str:
    from pydicom.uid import UID

    try:
        return str(UID(uid).name) if uid else ""
    except Exception:  # a malformed UID string
        return ""


def _classify(path: Path, ds: Any, folder: Path) -> DicomFile | None:
    """Wrap a header as a :class:`DicomFile`; ``None`` for objects without pixels (SR, RTSTRUCT, DICOMDIR)."""
    sop_class = _ascii(ds, "SOPClassUID") or _text(getattr(ds, "file_meta", {}), "MediaStorageSOPClassUID")
    if sop_class == _DICOMDIR_SOP_CLASS:
        return None
    modality = _ascii(ds, "Modality").upper()
    is_seg = modality == "SEG" or sop_class == SEG_SOP_CLASS
    if not is_seg and not any(t in ds for t in _PIXEL_TAGS):
        if "Image Storage" in _uid_name(sop_class):
            raise DataError(f"{path}: a {_uid_name(sop_class)} file without pixel data; it is damaged or truncated — "
                            "remove it from the folder or copy the series again")
        log.debug("%s: DICOM object without pixels (%s), skipped", path, modality or sop_class or "unknown")
        return None
    return DicomFile(path, ds, _series_key(ds, path, folder), "SEG" if is_seg else modality, is_seg)


def scan_folder(folder: PathLike, cancel: CancelFn | None = None,
                progress: ProgressFn | None = None) -> list[DicomFile]:
    """Every DICOM image or SEG file under ``folder`` (recursively), headers read, pixels left on disk.

    Raises
    ------
    DataError
        When the folder does not exist, holds more than :data:`MAX_SCAN_FILES` files, or a file
        that claims to be DICOM is damaged.
    CancelledError
        When ``cancel()`` turns true.
    """
    root = Path(folder)
    if not root.is_dir():
        raise DataError(f"{root}: not a folder; choose the folder that holds the DICOM files")
    found: list[DicomFile] = []
    for count, path in enumerate(_walk(root), start=1):
        if count > MAX_SCAN_FILES:
            raise DataError(f"{root}: holds more than {MAX_SCAN_FILES:,} files; choose the folder of one study or "
                            "series, not a whole archive")
        if cancel is not None and cancel():
            raise CancelledError(f"scanning {root} was cancelled")
        marker = has_dicm_marker(path)
        if not marker and not is_dicom_name(path):
            continue
        ds = read_header(path, marker)
        if ds is None:
            continue
        with dicom_damage(path):
            item = _classify(path, ds, root)
        if item is not None:
            found.append(item)
        if progress is not None and count % 50 == 0:
            progress({"event": "status", "message": f"Scanning {root.name}: {count} files"})
    return found


def group_series(files: list[DicomFile]) -> dict[str, list[DicomFile]]:
    """Files grouped by series key, image series first (by series number), SEG objects last."""
    groups: dict[str, list[DicomFile]] = {}
    for f in files:
        groups.setdefault(f.series_key, []).append(f)

    def order(item: tuple[str, list[DicomFile]]) -> tuple[bool, int, str, str]:
        key, members = item
        first = members[0]
        return (first.is_seg, _int(_ascii(first.dataset, "SeriesNumber"), 1 << 30) or 0,
                _text(first.dataset, "SeriesDescription"), key)

    return dict(sorted(groups.items(), key=order))


def describe_series(key: str, members: list[DicomFile]) -> SeriesInfo:
    """A :class:`SeriesInfo` for one group of files (no pixels read)."""
    with dicom_damage(members[0].path):
        return _describe_series(key, members)


def _describe_series(key: str, members: list[DicomFile]) -> SeriesInfo:
    first = members[0].dataset
    description = _text(first, "SeriesDescription")
    if not description:
        number = _text(first, "SeriesNumber")
        description = f"series {number}" if number else members[0].path.parent.name
    rows, cols = _ushort(first, "Rows"), _ushort(first, "Columns")
    size = (rows, cols) if rows and cols else None
    count = sum(m.frames for m in members) if not members[0].is_seg else len(members)
    return SeriesInfo(uid=key, description=description, modality=members[0].modality, count=count, size=size)


def list_dicom_series(folder: PathLike) -> list[SeriesInfo]:
    """The series under ``folder`` (image series first, then SEG objects), from headers only."""
    return [describe_series(k, v) for k, v in group_series(scan_folder(folder)).items()]


# --- geometry ---------------------------------------------------------------------------------


def _floats(ds: Any, keyword: str, n: int, where: Path) -> np.ndarray | None:
    try:
        numbers = _numbers(ds, keyword)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: {keyword} is not {n} numbers ({exc}); the header is damaged") from exc
    if numbers is None:
        return None
    values = np.array(numbers, dtype=np.float64)
    if values.size != n or not np.all(np.isfinite(values)):
        raise DataError(f"{where}: {keyword} should hold {n} finite numbers, got {values.tolist()}; "
                        "the header is damaged")
    return values


def _first_item(ds: Any, keyword: str) -> Any | None:
    try:
        seq = ds.get(keyword)
        return seq[0] if seq else None
    except Exception:
        return None


def _planes_of(item: DicomFile) -> list[_Plane]:
    """The planes of one file: itself, or each frame of an enhanced multi-frame file."""
    ds, path = item.dataset, item.path
    rows, cols = _ushort(ds, "Rows") or 0, _ushort(ds, "Columns") or 0
    if rows <= 0 or cols <= 0:
        raise DataError(f"{path}: the image has {rows}x{cols} pixels; the header is damaged")
    slope = _number(ds, "RescaleSlope", 1.0)
    intercept = _number(ds, "RescaleIntercept", 0.0)
    instance = _int(_ascii(ds, "InstanceNumber"))
    frames = item.frames
    if frames == 1 and "PerFrameFunctionalGroupsSequence" not in ds:
        spacing = _floats(ds, "PixelSpacing", 2, path)
        if spacing is None:
            spacing = _floats(ds, "ImagerPixelSpacing", 2, path)
        return [_Plane(item, None, rows, cols, _floats(ds, "ImagePositionPatient", 3, path),
                       _floats(ds, "ImageOrientationPatient", 6, path),
                       tuple(spacing) if spacing is not None else None, slope, intercept, instance)]
    shared = _first_item(ds, "SharedFunctionalGroupsSequence")
    per_frame = ds.get("PerFrameFunctionalGroupsSequence")
    if per_frame is None or len(per_frame) != frames:
        raise DataError(f"{path}: a multi-frame file of {frames} frames without per-frame positions; FedSM "
                        "reads enhanced (functional group) multi-frame files or one file per slice — convert "
                        "it with dcm2niix or your PACS")
    planes = []
    for index, group in enumerate(per_frame):
        def attr(sequence: str, keyword: str, n: int, group: Any = group) -> np.ndarray | None:
            for source in (group, shared):
                item_ = _first_item(source, sequence) if source is not None else None
                if item_ is not None and keyword in item_:
                    return _floats(item_, keyword, n, path)
            return None

        transform = None
        for source in (group, shared):
            transform = _first_item(source, "PixelValueTransformationSequence") if source is not None else None
            if transform is not None:
                break
        f_slope = _number(transform, "RescaleSlope", slope) if transform is not None else slope
        f_intercept = _number(transform, "RescaleIntercept", intercept) if transform is not None else intercept
        spacing = attr("PixelMeasuresSequence", "PixelSpacing", 2)
        planes.append(_Plane(item, index, rows, cols, attr("PlanePositionSequence", "ImagePositionPatient", 3),
                             attr("PlaneOrientationSequence", "ImageOrientationPatient", 6),
                             tuple(spacing) if spacing is not None else None, f_slope, f_intercept, index + 1))
    return planes


def _size_text(plane: _Plane) -> str:
    return f"{plane.columns}x{plane.rows}"


def _check_consistent(key: str, planes: list[_Plane]) -> None:
    """Same size, orientation and spacing on every plane, else a DataError naming both values."""
    first = planes[0]
    for p in planes[1:]:
        if (p.rows, p.columns) != (first.rows, first.columns):
            raise DataError(f"series {key} has slices of two sizes ({_size_text(first)} in {first.file.path.name} "
                            f"and {_size_text(p)} in {p.file.path.name}); choose one series, or move the files "
                            "of each size into their own folder")
    for p in planes[1:]:
        if (p.orientation is None) != (first.orientation is None) or (
                p.orientation is not None and np.abs(p.orientation - first.orientation).max() > _ORIENTATION_TOLERANCE):
            raise DataError(f"series {key} has slices of two orientations ({_vector(first.orientation)} in "
                            f"{first.file.path.name} and {_vector(p.orientation)} in {p.file.path.name}"
                            f"{_angle_text(first.orientation, p.orientation)}), e.g. a "
                            "localizer; choose one series, or move the slices of each orientation into their own "
                            "folder")
    for p in planes[1:]:
        if (p.spacing is None) != (first.spacing is None) or (
                p.spacing is not None and not np.allclose(p.spacing, first.spacing, rtol=_SPACING_TOLERANCE, atol=0)):
            raise DataError(f"series {key} has slices with two pixel spacings ({first.spacing} mm in "
                            f"{first.file.path.name} and {p.spacing} mm in {p.file.path.name}); choose one series")


def _angle_text(a: np.ndarray | None, b: np.ndarray | None) -> str:
    """``", planes 12.3 degrees apart"`` for two ImageOrientationPatient values; empty when one is missing."""
    if a is None or b is None:
        return ""
    normals = [np.cross(v[:3], v[3:]) for v in (a, b)]
    lengths = [float(np.linalg.norm(n)) for n in normals]
    if min(lengths) == 0:
        return ""
    cos = abs(float(normals[0] @ normals[1])) / (lengths[0] * lengths[1])
    degrees = float(np.degrees(np.arccos(min(1.0, cos))))
    if degrees < 0.01:  # same plane, rotated in it
        rows = float(np.degrees(np.arccos(np.clip(float(a[:3] @ b[:3]), -1.0, 1.0))))
        return f", rotated {rows:.2f} degrees within the plane"
    return f", planes {degrees:.2f} degrees apart"


def _vector(values: np.ndarray | None) -> str:
    return "none" if values is None else "[" + ", ".join(f"{float(v):.4g}" for v in values) + "]"


def _sorted_planes(key: str, planes: list[_Plane]) -> tuple[list[_Plane], np.ndarray, str]:
    """Planes in slice order, the LPS affine ``(4, 4)`` and how the order was found."""
    first = planes[0]
    orientation = first.orientation if first.orientation is not None else np.array([1.0, 0, 0, 0, 1.0, 0])
    row_dir, col_dir = orientation[:3], orientation[3:]
    if abs(np.linalg.norm(row_dir) - 1) > 0.01 or abs(np.linalg.norm(col_dir) - 1) > 0.01 \
            or abs(float(row_dir @ col_dir)) > 0.01:
        raise DataError(f"series {key}: ImageOrientationPatient {_vector(orientation)} is not two unit, "
                        "perpendicular directions; the header is damaged")
    normal = np.cross(row_dir, col_dir)
    spacing_rc = first.spacing if first.spacing is not None else (1.0, 1.0)
    if min(spacing_rc) <= 0:
        raise DataError(f"series {key}: PixelSpacing {spacing_rc} is not positive; the header is damaged")
    positions_known = all(p.position is not None for p in planes)
    if positions_known:
        distances = np.array([float(p.position @ normal) for p in planes])  # type: ignore[operator]
        order = np.argsort(distances, kind="stable")
        planes = [planes[i] for i in order]
        distances = distances[order]
        how = "ImagePositionPatient"
    else:
        planes = sorted(planes, key=lambda p: (p.instance is None, p.instance or 0, str(p.file.path)))
        distances = np.array([])
        how = "InstanceNumber (the series has no ImagePositionPatient)"
        if len(planes) > 1:
            log.warning("series %s has no slice positions; slices ordered by InstanceNumber", key)
    lps = np.eye(4)
    lps[:3, 0] = row_dir * spacing_rc[1]  # column index runs along the row direction
    lps[:3, 1] = col_dir * spacing_rc[0]
    lps[:3, 3] = planes[0].position if planes[0].position is not None else 0.0
    if len(planes) > 1 and positions_known:
        steps = np.diff(distances)
        if steps.min() < 1e-3:
            i = int(np.argmin(steps))
            raise DataError(f"series {key} has {len(planes)} slices but two of them ({planes[i].file.path.name} and "
                            f"{planes[i + 1].file.path.name}) lie at the same position: several acquisitions "
                            "(echoes, time points, masks) share this series UID; put each in its own folder and "
                            "open that folder")
        median = float(np.median(steps))
        uneven = np.abs(steps - median) > _STEP_TOLERANCE * median
        if uneven.any():
            i = int(np.flatnonzero(uneven)[0])
            raise DataError(f"series {key}: slices are not evenly spaced (step {steps[i]:.3g} mm between "
                            f"{planes[i].file.path.name} and {planes[i + 1].file.path.name}, {median:.3g} mm "
                            "elsewhere): a slice may be missing; check the folder holds the complete series")
        lps[:3, 2] = (planes[-1].position - planes[0].position) / (len(planes) - 1)  # type: ignore[operator]
    else:
        ds = first.file.dataset
        thickness = _number(ds, "SpacingBetweenSlices", 0.0) or _number(ds, "SliceThickness", 0.0) or 1.0
        lps[:3, 2] = normal * abs(thickness)
    return planes, lps, how


# --- pixels -----------------------------------------------------------------------------------


#: Transfer syntaxes whose pixel data is a plain little-endian array (decoded with ``frombuffer``).
_NATIVE_LITTLE_ENDIAN = ("1.2.840.10008.1.2", "1.2.840.10008.1.2.1")


def _native_pixels(item: DicomFile) -> np.ndarray | None:
    """Uncompressed greyscale pixels straight from the bytes, ``(frames, rows, cols)``; ``None`` otherwise.

    pydicom's generic pixel pipeline costs milliseconds per file in Python; for the common
    uncompressed case a ``frombuffer`` (plus the BitsStored masking / sign extension) is exact.
    """
    ds = item.dataset
    meta = getattr(ds, "file_meta", None)
    syntax = str(meta.get("TransferSyntaxUID", "")) if meta is not None else ""
    if syntax not in _NATIVE_LITTLE_ENDIAN or (_ushort(ds, "SamplesPerPixel") or 1) != 1 or "PixelData" not in ds:
        return None
    bits, stored = _ushort(ds, "BitsAllocated"), _ushort(ds, "BitsStored")
    signed = _ushort(ds, "PixelRepresentation") == 1
    if bits not in (8, 16, 32) or stored is None or not 0 < stored <= bits:
        return None
    rows, cols = _ushort(ds, "Rows") or 0, _ushort(ds, "Columns") or 0
    count = item.frames * rows * cols
    data = ds.PixelData
    if len(data) < count * bits // 8:
        raise DataError(f"{item.path}: pixel data holds {len(data)} bytes, {item.frames}x{rows}x{cols} pixels of "
                        f"{bits} bits need {count * bits // 8}; the file is truncated — copy the series again")
    pixels = np.frombuffer(data, dtype=f"<{'i' if signed else 'u'}{bits // 8}", count=count)
    pixels = pixels.reshape(item.frames, rows, cols)
    if stored < bits:
        shift = bits - stored
        if signed:  # the sign bit is bit stored-1: move it to the top and back (arithmetic shift)
            pixels = (pixels << shift) >> shift
        elif (pixels >> stored).any():  # bits above BitsStored (old overlays) are not part of the value
            pixels = pixels & ((1 << stored) - 1)
    return pixels


def _decode_file(item: DicomFile) -> tuple[np.ndarray, bool]:
    """Pixels of a file as ``(frames, rows, cols[, samples])`` and whether the rescale is already applied.

    Uncompressed pixel data is read directly. Otherwise two decoders are tried in turn, pydicom
    then GDCM (through SimpleITK, which applies the rescale itself), except for the files GDCM
    goes first on (:func:`_gdcm_first`). Callers silence pydicom's decoder warnings
    (``warnings.catch_warnings`` is not thread-safe, and files may decode on several threads).
    """
    with dicom_damage(item.path):
        _check_pixel_header(item)
    if "ModalityLUTSequence" not in item.dataset:
        pixels = _native_pixels(item)
        if pixels is not None:
            return pixels, False
    decoders = [("pydicom", _pydicom_pixels), ("GDCM", _gdcm_pixels)]
    if _gdcm_first(item):
        decoders.reverse()
    failures: list[str] = []
    for name, decode in decoders:
        try:
            pixels, rescaled = decode(item)
            break
        except Exception as exc:  # no decoder for the syntax, damaged or truncated pixel data
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    else:
        ts = _text(getattr(item.dataset, "file_meta", {}), "TransferSyntaxUID")
        raise DataError(f"{item.path}: the pixel data cannot be decoded ({'; '.join(failures)}; transfer syntax "
                        f"{ts or 'unknown'}); the file is damaged or truncated — copy the series again or export "
                        "it uncompressed")
    if item.frames == 1:
        pixels = pixels[None]
    return np.asarray(pixels), rescaled


def _check_series_size(where: str, shape: tuple[int, int, int]) -> None:
    """Refuse a series whose float32 volume would exceed :data:`MAX_VOXELS` before reserving it."""
    voxels = shape[0] * shape[1] * shape[2]
    if voxels > MAX_VOXELS:
        raise DataError(f"{where}: {shape[2]} slices of {shape[0]}x{shape[1]} pixels ({voxels:,} voxels), more "
                        f"than the {MAX_VOXELS:,} FedSM reads; the headers are damaged, or crop/downsample the "
                        "series first")


def _check_pixel_header(item: DicomFile) -> None:
    """Before any pixel is decoded: the declared size fits the budget, and every frame fits its header.

    A decoder allocates what the compressed frame's own codestream says, whatever ``Rows``/``Columns``
    claim, so each frame's codestream is parsed and checked against the header
    (:func:`engine.io.codestream.check_frame`); uncompressed pixel data much longer than the header
    needs is refused before it is read (:func:`engine.io.codestream.check_native_length`).
    """
    ds = item.dataset
    rows, cols = _ushort(ds, "Rows") or 0, _ushort(ds, "Columns") or 0
    frames = _int(_ascii(ds, "NumberOfFrames"), 1) or 1
    bits = _ushort(ds, "BitsAllocated") or 16
    samples = _ushort(ds, "SamplesPerPixel") or 1
    check_pixel_budget(item.path, rows, cols, frames, bits, samples)
    if "PixelData" not in ds:
        return
    header = FrameHeader(rows, cols, samples, bits)
    if not _is_compressed(item):
        length = getattr(ds.get_item("PixelData", keep_deferred=True), "length", None)
        if isinstance(length, int):
            check_native_length(item.path, length, header, frames)
        return
    check_compressed_frames(item.path, ds.PixelData, header, frames, _transfer_syntax(item))


def _transfer_syntax(item: DicomFile) -> str:
    return str(getattr(getattr(item.dataset, "file_meta", None), "TransferSyntaxUID", "") or "")


def _gdcm_first(item: DicomFile) -> bool:
    """Whether GDCM decodes this file before pydicom is tried.

    A compressed single-frame greyscale file: GDCM decodes JPEG 2000 ~1.5x faster than pydicom's
    plugins (OpenJPEG through Pillow, or pylibjpeg) and releases the GIL, so a compressed series
    also decodes in parallel. Multi-frame files stay with pydicom (their frames may carry their
    own rescale), and so do colour files (pydicom's YBR -> RGB conversion is the one the viewer
    expects) and files with a modality LUT (which pydicom applies).
    """
    ds = item.dataset
    return (item.frames == 1 and _is_compressed(item) and (_ushort(ds, "SamplesPerPixel") or 1) == 1
            and "ModalityLUTSequence" not in ds)


def _pydicom_pixels(item: DicomFile) -> tuple[np.ndarray, bool]:
    """pydicom's ``pixel_array``, with the modality LUT applied when the file has one."""
    ds = item.dataset
    pixels = ds.pixel_array
    if "ModalityLUTSequence" not in ds:
        return pixels, False
    from pydicom.pixels import apply_modality_lut

    return apply_modality_lut(pixels, ds), True


def _gdcm_pixels(item: DicomFile) -> tuple[np.ndarray, bool]:
    """Pixels decoded by GDCM's ImageIO (through SimpleITK) and ``True``: GDCM applies the rescale.

    A single frame comes as ``(rows, cols[, samples])``. Raises ``RuntimeError`` when GDCM cannot
    read the file.
    """
    import SimpleITK as sitk

    reader = sitk.ImageFileReader()
    reader.SetImageIO("GDCMImageIO")
    reader.SetFileName(str(item.path))
    image = reader.Execute()
    pixels = sitk.GetArrayFromImage(image)
    if item.frames == 1 and pixels.ndim >= 3 and pixels.shape[0] == 1 and image.GetNumberOfComponentsPerPixel() == 1:
        pixels = pixels[0]
    return pixels, True


def _is_compressed(item: DicomFile) -> bool:
    """Whether the file's pixel data is encapsulated (JPEG, JPEG 2000, RLE, ...)."""
    syntax = getattr(getattr(item.dataset, "file_meta", None), "TransferSyntaxUID", None)
    return bool(getattr(syntax, "is_compressed", False))


def _decode_in_order(items: list[DicomFile],
                     check_cancel: Callable[[], None]) -> Iterator[tuple[np.ndarray, bool]]:
    """``_decode_file`` of each item, yielded in order; files GDCM decodes several at a time.

    GDCM decodes a compressed file in C without the GIL, so a few threads overlap the files of
    a compressed series; uncompressed pixel data is one ``numpy.frombuffer`` and pydicom's
    decoders hold the GIL, so neither gains anything. At most ``2 * threads`` decoded files
    wait in memory. ``check_cancel`` runs before each file is
    handed out; when it raises, the files not yet started are dropped.
    """
    threads = min(DECODE_THREADS, len(items))
    if threads <= 1 or not any(_gdcm_first(item) for item in items):
        for item in items:
            check_cancel()
            yield _decode_file(item)
        return

    upcoming = iter(items)
    # The first file alone: any one-time set-up of a decoder library (GDCM's dictionaries,
    # pydicom's plugin probing) happens on one thread before several threads use it.
    check_cancel()
    yield _decode_file(next(upcoming))
    queue: deque[Future[tuple[np.ndarray, bool]]] = deque()
    with ThreadPoolExecutor(threads, thread_name_prefix="dicom-decode") as pool:
        try:
            for item in upcoming:
                check_cancel()
                queue.append(pool.submit(_decode_file, item))
                if len(queue) == 2 * threads:
                    yield queue.popleft().result()
            while queue:
                yield queue.popleft().result()
        finally:
            for future in queue:  # cancelled, a damaged file, or the reader stopped early
                future.cancel()


def _release_pixels(item: DicomFile) -> None:
    """Drop a decoded file's pixel bytes from its header, so a big series is not held twice."""
    for tag in _PIXEL_TAGS:
        if tag in item.dataset:
            del item.dataset[tag]


def _check_cancel(cancel: CancelFn | None, key: str) -> None:
    if cancel is not None and cancel():
        raise CancelledError(f"reading series {key} was cancelled")


def _descriptors(ds: Any, how: str) -> dict[str, str]:
    out = {}
    for keyword in DESCRIPTOR_KEYWORDS:
        value = _text(ds, keyword)
        if value:
            out[keyword] = value
    out["slice_order"] = how
    return out


def _is_multi(value: Any) -> bool:
    return isinstance(value, list | tuple) or type(value).__name__ == "MultiValue"


def _first_value(value: Any) -> Any:
    return (value[0] if len(value) else None) if _is_multi(value) else value


def _window(ds: Any) -> tuple[float, float] | None:
    c, w = _number(ds, "WindowCenter", np.nan), _number(ds, "WindowWidth", np.nan)
    return (c, w) if np.isfinite(c) and np.isfinite(w) and w > 0 else None


def read_series(files: list[DicomFile], source: Path, progress: ProgressFn | None = None,
                cancel: CancelFn | None = None) -> Study:
    """Read one series (the files :func:`group_series` put together) as a canonical :class:`Study`.

    Parameters
    ----------
    files
        The series' files, any order.
    source
        Folder the series was found in (``Study.source``).
    progress
        Called with ``{"event": "status", "message", "done", "total"}`` after each file.
    cancel
        Checked before each file; when it returns true :class:`CancelledError` is raised.

    Raises
    ------
    DataError
        When the series is a SEG, mixes sizes, orientations or spacings, has two slices at one
        position or uneven steps, or a file cannot be decoded.
    """
    if not files:
        raise DataError(f"{source}: no DICOM files in this series")
    key = files[0].series_key
    if files[0].is_seg:
        raise DataError(f"{files[0].path}: is a DICOM SEG (a mask), not an image series; open the series it "
                        "belongs to, then load the SEG as a mask")
    planes = []
    for f in files:
        with dicom_damage(f.path):
            planes.extend(_planes_of(f))
    with dicom_damage(files[0].path):
        samples = _ushort(files[0].dataset, "SamplesPerPixel") or 1
    if samples != 1:
        return _read_colour(key, files, planes, samples, source)
    _check_consistent(key, planes)
    planes, lps, how = _sorted_planes(key, planes)
    first = planes[0]
    ras = LPS_TO_RAS @ lps
    shape = (first.columns, first.rows, len(planes))  # (c, r, k): i along the row direction
    _check_series_size(f"{source}: series {key}", shape)
    try:
        ornt, affine, _ = canonical_layout(ras, shape)
    except DataError as exc:
        raise DataError(f"series {key}: {exc}") from exc
    # Voxels go into a slab buffer (slice, row, column), each slice written contiguously, with the
    # flips of the canonical order applied while writing; the study's array is a transposed view of
    # it, so axial slices stay contiguous and no second copy is made (strides are all positive).
    flip_c, flip_r, flip_k = (bool(ornt[axis, 1] < 0) for axis in range(3))
    buffer = np.empty((len(planes), first.rows, first.columns), dtype=np.float32)
    perm = [0, 0, 0]
    for source_axis in range(3):
        perm[int(ornt[source_axis, 0])] = 2 - source_axis  # buffer axis of source axis (c, r, k) = (2, 1, 0)
    array = buffer.transpose(perm)
    by_file: dict[int, list[tuple[int, _Plane]]] = {}
    for k, plane in enumerate(planes):
        by_file.setdefault(id(plane.file), []).append((len(planes) - 1 - k if flip_k else k, plane))
    groups = list(by_file.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decoded = _decode_in_order([members[0][1].file for members in groups], lambda: _check_cancel(cancel, key))
        with contextlib.closing(decoded):  # on an error, files still queued are dropped at once
            for done, (members, (pixels, rescaled)) in enumerate(zip(groups, decoded, strict=True), start=1):
                item = members[0][1].file
                if pixels.shape[1:] != (first.rows, first.columns):
                    raise DataError(f"{item.path}: pixel data is {pixels.shape[1:]} but the header says "
                                    f"{(first.rows, first.columns)}; the file is damaged")
                for slot, plane in members:
                    frame = pixels[plane.frame or 0]
                    frame = frame[::-1] if flip_r else frame
                    frame = frame[:, ::-1] if flip_c else frame
                    if rescaled or (plane.slope == 1.0 and plane.intercept == 0.0):
                        buffer[slot] = frame
                    else:
                        np.multiply(frame, np.float32(plane.slope), out=buffer[slot], casting="unsafe")
                        buffer[slot] += np.float32(plane.intercept)
                _release_pixels(item)
                if progress is not None:
                    progress({"event": "status", "message": f"Reading series {key}", "done": done,
                              "total": len(by_file)})
    window = _window(first.file.dataset) or robust_window(array)
    # dicom_files follow the canonical axis the slices stack along (k for axial acquisitions).
    ordered_files = [p.file.path for p in (reversed(planes) if flip_k else planes)]
    return Study(
        array=array,
        kind="volume",
        affine=affine,
        spacing=voxel_spacing(affine),
        modality=files[0].modality,
        window=window,
        source=source,
        source_format="dicom",
        description=_descriptors(first.file.dataset, how),
        series_uid=key,
        dicom_files=tuple(dict.fromkeys(ordered_files)),
        # (column, row, slice) in increasing position along the normal: SimpleITK's series grid.
        source_grid=SourceGrid(shape, ras, ornt),
    )


def _read_colour(key: str, files: list[DicomFile], planes: list[_Plane], samples: int, source: Path) -> Study:
    """A single colour DICOM image (ophthalmic photograph, secondary capture) as a photo study."""
    if samples != 3 or len(planes) != 1:
        raise DataError(f"series {key}: {len(planes)} colour images with {samples} samples per pixel; FedSM reads "
                        "colour DICOM only as a single photo — choose a greyscale series or one colour image")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pixels, _ = _decode_file(files[0])
    rgb = pixels[0]
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise DataError(f"{files[0].path}: colour pixel data has shape {rgb.shape}; the file is damaged")
    if rgb.dtype != np.uint8:
        top = int(rgb.max(initial=0))
        rgb = (rgb.astype(np.float64) * (255.0 / ((1 << max(top.bit_length(), 8)) - 1))).round().astype(np.uint8)
    return Study(
        array=np.ascontiguousarray(rgb),
        kind="photo",
        affine=np.eye(4),
        spacing=(1.0, 1.0),
        modality=files[0].modality or "OP",
        window=(127.5, 255.0),
        source=source,
        source_format="dicom",
        description=_descriptors(files[0].dataset, "single image"),
        series_uid=key,
        dicom_files=(files[0].path,),
    )


def choose_series(folder: Path, files: list[DicomFile], series_uid: str | None) -> tuple[str, list[DicomFile]]:
    """The series to read: ``series_uid``'s, or the only image series; DataError listing them otherwise."""
    groups = group_series(files)
    images = {k: v for k, v in groups.items() if not v[0].is_seg}
    if series_uid is not None:
        if series_uid in groups:
            return series_uid, groups[series_uid]
        raise DataError(f"{folder}: has no series {series_uid}; it holds {_listing(groups)}")
    if not images:
        segs = f" (only DICOM SEG masks: {_listing(groups)})" if groups else ""
        raise DataError(f"{folder}: no DICOM image series found{segs}; choose the folder that holds the image "
                        "files")
    if len(images) > 1:
        raise DataError(f"{folder}: holds {len(images)} image series: {_listing(images)}; pass the one to open "
                        "(series_uid, or choose it in the app)")
    key = next(iter(images))
    return key, images[key]


def _listing(groups: dict[str, list[DicomFile]]) -> str:
    infos = [describe_series(k, v) for k, v in groups.items()]
    return "; ".join(f"{i.uid} ({i.modality or '?'} '{i.description}', {i.count} images)" for i in infos)


def series_beside(path: PathLike, series_uid: str | None = None) -> tuple[str, list[DicomFile]]:
    """The series a DICOM file belongs to, gathered from the files in its folder (not recursive).

    ``series_uid`` picks another series of that folder instead. A file that is the only one of its
    series (a 2D image, an enhanced multi-frame file) gives a series of that file alone.

    Raises
    ------
    DataError
        When the file is not DICOM, holds no pixels, is a SEG, or a file beside it that claims to
        be DICOM is damaged.
    """
    p = Path(path)
    ds = read_header(p, has_dicm_marker(p))
    if ds is None:
        raise DataError(f"{p}: not a DICOM file; FedSM opens DICOM files, NIfTI/MHA/NRRD volumes and photos")
    with dicom_damage(p):
        item = _classify(p, ds, p.parent)
    if item is None:
        if _text(ds, "Modality").upper() == "RTSTRUCT":
            raise DataError(f"{p}: is an RT Structure Set (contours: a mask, not an image); open the image series it "
                            "outlines, then load the RTSTRUCT as its mask")
        raise DataError(f"{p}: a DICOM object without pixels ({_text(ds, 'Modality') or 'unknown modality'}); "
                        "open an image series")
    if item.is_seg and series_uid is None:
        raise DataError(f"{p}: is a DICOM SEG (a mask), not an image; open the series it belongs to, then load "
                        "the SEG as a mask")
    wanted = series_uid or item.series_key
    members = [item] if item.series_key == wanted else []
    for other in sorted(p.parent.iterdir()):
        if other == p or other.name.startswith(".") or not other.is_file():
            continue
        marker = has_dicm_marker(other)
        if not marker and not is_dicom_name(other):
            continue
        header = read_header(other, marker)
        with dicom_damage(other):
            sibling = _classify(other, header, p.parent) if header is not None else None
        if sibling is not None and sibling.series_key == wanted:
            members.append(sibling)
    if not members:
        raise DataError(f"{p}: no series {wanted} beside this file")
    return wanted, members


def read_dicom_file(path: PathLike, series_uid: str | None = None, progress: ProgressFn | None = None,
                    cancel: CancelFn | None = None) -> Study:
    """Open the series a DICOM file belongs to, from the files beside it (as DICOM viewers do)."""
    p = Path(path)
    _, members = series_beside(p, series_uid)
    return read_series(members, p.parent, progress=progress, cancel=cancel)
