"""Masks (label maps) read onto an opened study, voxel for voxel, never resampled.

:func:`open_mask` reads

- label images (PNG, TIFF, BMP; single channel, or RGB with three equal channels) for photos,
  and 2D NIfTI (as :mod:`engine.io.export` writes for photos); JPEG is refused, its lossy
  compression changes label values;
- NIfTI, MHA/MHD, NRRD/NHDR label volumes and DICOM image series of labels (a folder or one of
  its files) for volumes, put in the study's RAS+ canonical order through their own geometry;
- DICOM SEG files, through :func:`engine.io.dicom_seg.read_dicom_seg`;
- DICOM RT Structure Sets (RTSTRUCT): contours rasterised onto the study by
  :func:`engine.io.rtstruct.read_rtstruct`.

The mask's geometry must be the study's: the same shape, and every voxel centre within
:data:`GRID_TOLERANCE` voxel of the study's (so a NIfTI written by another tool in another voxel
order still fits). Anything else is a :class:`~engine.errors.DataError` with both geometries
(shape, spacing, origin) and what to do. The one exception is a mask on a *part* of the study's
own grid — e.g. expert masks drawn on 5 of 64 slices, shipped as a 5-slice DICOM series: its
voxels are placed where they belong and the rest is 0 (logged); :func:`read_mask` with
``allow_partial=False`` (used by ``fedsm validate-data``) refuses it instead. Nothing is
interpolated.

Values: a label map holds whole numbers 0..255. A ``convention``
(:mod:`engine.io.label_conventions`) maps a dataset's values to the engine's; without one,
values are kept as stored and named ``"label N"``, except that a photo's map of values within
{0, 1, 2} is taken as ORIGA style (1 rim, 2 cup), the form FedSM writes fundus masks in.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import ConfigError, DataError
from engine.io.dicom_seg import read_dicom_seg
from engine.io.dicom_series import SEG_SOP_CLASS, has_dicm_marker
from engine.io.export import embedded_provenance, mask_format
from engine.io.guard import check_dicom_inflate, dicom_damage, open_image
from engine.io.label_conventions import FUNDUS_NAMES, get_convention
from engine.io.readers import open_study
from engine.io.rtstruct import is_rtstruct, read_rtstruct
from engine.io.study import LabelMap, Study
from engine.io.volumes import read_itk_volume, read_nifti_volume, to_canonical, volume_format

if TYPE_CHECKING:
    from engine.io.label_conventions import LabelConvention

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

#: Largest distance, in voxels, between a mask voxel's centre and the study voxel it is taken for.
GRID_TOLERANCE = 0.1
#: Axes closer than this (degrees) count as the same orientation in messages (header rounding).
SAME_ORIENTATION_DEG = 0.01
#: Largest ``--tolerate-orientation`` accepted: beyond it a mask is not "on the same grid".
MAX_TOLERATED_DEG = 10.0
_ORIENTATION_TOLERANCE = {"degrees": 0.0}
_LABEL_IMAGE_SUFFIXES = (".png", ".tif", ".tiff", ".bmp")


@dataclass(frozen=True)
class MaskReading:
    """A mask read onto a study, with what validation needs to know about the files.

    Attributes
    ----------
    labels
        The label map (``uint8``, ``study.shape``).
    raw_values
        Per file read, the distinct values it stores (before any convention mapping).
    partial
        ``None``, or a sentence saying which part of the study the mask covers when it was placed
        on a part of the grid.
    """

    labels: LabelMap
    raw_values: tuple[tuple[int, ...], ...]
    partial: str | None = None


# --- geometry ---------------------------------------------------------------------------------


def describe_geometry(shape: tuple[int, ...], affine: np.ndarray) -> str:
    """``shape (X, Y, Z), spacing a x b x c mm, origin (x, y, z) mm RAS`` for messages."""
    affine = np.asarray(affine, dtype=float)
    spacing = np.sqrt((affine[:3, :3] ** 2).sum(axis=0))
    origin = ", ".join(f"{round(float(v), 2) + 0.0:.2f}" for v in affine[:3, 3])
    return (f"shape {tuple(int(n) for n in shape)}, spacing {' x '.join(f'{s:.4g}' for s in spacing)} mm, "
            f"origin ({origin}) mm RAS")


def set_orientation_tolerance(degrees: float) -> None:
    """Accept masks whose orientation header differs from the study's by up to ``degrees`` (process-wide).

    Set from ``--tolerate-orientation DEG`` by ``fedsm validate-data`` and ``fedsm simulate``;
    :func:`read_mask`'s own ``tolerate_orientation`` argument overrides it. Such a mask must
    otherwise be on the study's voxel grid: same shape and spacing, and a corner or the centre
    of its grid within half a voxel of the study's; it is then taken voxel for voxel (logged),
    never resampled.

    Raises
    ------
    ConfigError
        When ``degrees`` is not a number in ``[0, MAX_TOLERATED_DEG]``.
    """
    if not isinstance(degrees, int | float) or not np.isfinite(degrees) or not 0 <= degrees <= MAX_TOLERATED_DEG:
        raise ConfigError(f"--tolerate-orientation must be a number of degrees in [0, {MAX_TOLERATED_DEG:g}], got "
                          f"{degrees!r}")
    _ORIENTATION_TOLERANCE["degrees"] = float(degrees)


def orientation_tolerance() -> float:
    """The process-wide orientation tolerance in degrees (0 unless :func:`set_orientation_tolerance` was called)."""
    return _ORIENTATION_TOLERANCE["degrees"]


def axis_angles(affine: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Angle in degrees between each voxel axis of ``affine`` and the same axis of ``other``."""
    a = np.asarray(affine, dtype=float)[:3, :3]
    b = np.asarray(other, dtype=float)[:3, :3]
    a = a / np.linalg.norm(a, axis=0)
    b = b / np.linalg.norm(b, axis=0)
    return np.degrees(np.arccos(np.clip((a * b).sum(axis=0), -1.0, 1.0)))


def _same_grid_but_orientation(shape: tuple[int, ...], affine: np.ndarray, study: Study) -> bool:
    """Same shape and spacing (0.1 %) as the study, and the grids meet at a corner or the centre.

    A tool that rounds the orientation keeps the origin of the file (a corner of the grid, in
    whichever voxel order the file has), or turns the grid about its centre: within half a voxel
    there, only the axes' directions differ.
    """
    affine = np.asarray(affine, dtype=float)
    spacing = np.linalg.norm(affine[:3, :3], axis=0)
    study_spacing = np.linalg.norm(np.asarray(study.affine, dtype=float)[:3, :3], axis=0)
    if shape != tuple(study.shape) or not np.allclose(spacing, study_spacing, rtol=1e-3, atol=0):
        return False
    to_study = np.linalg.inv(np.asarray(study.affine, dtype=float)) @ affine
    last = np.asarray(shape, dtype=float) - 1
    points = np.array([[i, j, k] for i in (0, last[0]) for j in (0, last[1]) for k in (0, last[2])] + [last / 2])
    mapped = (to_study[:3, :3] @ points.T + to_study[:3, 3:4]).T
    return bool((np.abs(mapped - points).max(axis=1) <= 0.5).any())


def _grid_offset(shape: tuple[int, ...], affine: np.ndarray, study: Study) -> np.ndarray | None:
    """Integer voxel offset of the mask's grid inside the study's, or ``None`` when it is not on it."""
    to_study = np.linalg.inv(np.asarray(study.affine, dtype=float)) @ np.asarray(affine, dtype=float)
    corners = np.array([[i, j, k, 1.0] for i in (0, shape[0] - 1) for j in (0, shape[1] - 1)
                        for k in (0, shape[2] - 1)]).T
    mapped = (to_study @ corners)[:3]
    offset = np.rint(mapped[:, 0])
    if np.abs(mapped - (corners[:3] + offset[:, None])).max() > GRID_TOLERANCE:
        return None
    return offset.astype(int)


def fit_to_study(array: np.ndarray, affine: np.ndarray, study: Study, path: Path,
                 allow_partial: bool = True, tolerate_orientation: float | None = None
                 ) -> tuple[np.ndarray, str | None]:
    """Check a canonical mask volume against the study; place it when it covers part of the grid.

    Returns
    -------
    array, partial
        ``array`` with the study's shape, and ``None`` or a sentence about the covered part.

    Raises
    ------
    DataError
        When the mask is not on the study's grid (message with both geometries, and the angle
        when the orientations differ), or covers only part of it and ``allow_partial`` is false.
        A mask on the study's grid whose orientation differs by at most ``tolerate_orientation``
        degrees (default: :func:`orientation_tolerance`) is taken voxel for voxel.
    """
    shape = tuple(int(n) for n in array.shape)
    offset = _grid_offset(shape, affine, study)
    if offset is not None and shape == tuple(study.shape) and not offset.any():
        return array, None
    end = offset + np.asarray(shape) if offset is not None else None
    if offset is not None and end is not None and (offset >= 0).all() and (end <= np.asarray(study.shape)).all():
        axes = [f"{'ijk'[a]} {offset[a]}..{end[a] - 1} of {study.shape[a]}" for a in range(3)
                if shape[a] != study.shape[a]]
        where = (f"{path}: the mask ({describe_geometry(shape, affine)}) covers only part of the grid of the study "
                 f"{study.source or ''} ({describe_geometry(study.shape, study.affine)}): {', '.join(axes)}")
        if not allow_partial:
            raise DataError(f"{where}; a training mask must cover the whole image — export the mask on the image's "
                            "full grid, or leave the case out")
        out = np.zeros(study.shape, dtype=array.dtype)
        out[offset[0]:end[0], offset[1]:end[1], offset[2]:end[2]] = array  # type: ignore[index]
        log.warning("%s; voxels outside it are set to 0", where)
        return out, f"covers {', '.join(axes)}"
    angles = axis_angles(affine, study.affine)
    worst = float(angles.max())
    if worst > SAME_ORIENTATION_DEG:
        limit = orientation_tolerance() if tolerate_orientation is None else float(tolerate_orientation)
        same_grid = _same_grid_but_orientation(shape, affine, study)
        turned = (f"the mask's orientation differs from the study's by {worst:.2f} degrees (axes i, j, k: "
                  f"{', '.join(f'{a:.2f}' for a in angles)})")
        if same_grid and worst <= limit:
            log.warning("%s: %s; accepted voxel for voxel (orientation tolerance %g degrees)", path, turned, limit)
            return array, None
        suggested = float(np.ceil(worst * 100) / 100)
        advice = (f"it has the image's shape and spacing and meets its grid, so if it was drawn on this image and "
                  f"only its orientation header was rounded, accept it with --tolerate-orientation {suggested:g}"
                  if same_grid and worst <= MAX_TOLERATED_DEG else
                  "choose the mask made for this image, or resample it onto the image with nearest-neighbour "
                  "interpolation first")
        raise DataError(f"{path}: {turned} — mask: {describe_geometry(shape, affine)}; study {study.source or ''}: "
                        f"{describe_geometry(study.shape, study.affine)}. FedSM never resamples masks silently: "
                        f"{advice}")
    raise DataError(f"{path}: the mask's geometry does not match the study's — mask: "
                    f"{describe_geometry(shape, affine)}; study {study.source or ''}: "
                    f"{describe_geometry(study.shape, study.affine)}. FedSM never resamples masks silently: "
                    "choose the mask made for this image, or resample it onto the image with "
                    "nearest-neighbour interpolation first")


# --- reading ----------------------------------------------------------------------------------


def read_label_image(path: Path) -> np.ndarray:
    """A single-channel label image (2D); RGB is accepted when its three channels are equal."""
    # open_image checks the size before decoding and turns Pillow's errors into DataError.
    with open_image(path, "mask") as img:
        mode = img.mode
        img.load()
        if mode in ("L", "P", "I", "I;16", "I;16B", "I;16L", "I;16N"):
            return np.asarray(img).astype(np.int64) if mode.startswith("I") else np.asarray(img, np.uint8)
        if mode == "1":
            return np.asarray(img, dtype=np.uint8)
        if mode in ("LA", "PA"):
            return np.asarray(img.getchannel(0), dtype=np.uint8)
        if mode in ("RGB", "RGBA"):
            rgb = np.asarray(img, dtype=np.uint8)[:, :, :3]
            if (rgb[:, :, 0] == rgb[:, :, 1]).all() and (rgb[:, :, 0] == rgb[:, :, 2]).all():
                return np.ascontiguousarray(rgb[:, :, 0])
            raise DataError(f"{path}: the mask is a colour ({mode}) image; a label map has one value per "
                            "pixel — save it as 8-bit greyscale with one value per label")
        raise DataError(f"{path}: the mask is a {mode} image; save it as 8-bit greyscale with one value "
                        "per label")


def _is_seg(path: Path) -> bool:
    if not path.is_file() or not has_dicm_marker(path):
        return False
    import pydicom

    check_dicom_inflate(path)
    try:
        ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["Modality", "SOPClassUID"])
    except Exception as exc:  # damaged header
        raise DataError(f"{path}: damaged DICOM file ({type(exc).__name__}: {exc}); copy it again") from exc
    # The file meta's SOP class too: it still names a SEG whose dataset was cut before its Modality.
    with dicom_damage(path):
        meta = getattr(ds, "file_meta", None)
        return (str(ds.get("Modality", "")).upper() == "SEG" or str(ds.get("SOPClassUID", "")) == SEG_SOP_CLASS
                or str(meta.get("MediaStorageSOPClassUID", "") if meta is not None else "") == SEG_SOP_CLASS)


def _is_rtstruct(path: Path) -> bool:
    return is_rtstruct(path)


def _photo_mask(path: Path, study: Study) -> np.ndarray:
    fmt = volume_format(path)
    if fmt == "nifti":
        data, _, _ = read_nifti_volume(path)
        if data.shape[2] != 1:
            raise DataError(f"{path}: is a volume of {data.shape[2]} slices, but the study is a 2D photo; choose "
                            "the photo's mask (PNG or a 2D NIfTI)")
        raw = data[:, :, 0]
    elif fmt is not None:
        raise DataError(f"{path}: a {fmt.upper()} volume cannot be a photo's mask; use a PNG label map")
    elif path.suffix.lower() in (".jpg", ".jpeg"):
        raise DataError(f"{path}: JPEG compression changes a label map's values; save the mask as PNG")
    elif path.is_dir() or _is_seg(path):
        raise DataError(f"{path}: DICOM masks belong to DICOM volumes; a photo's mask is a PNG label map")
    else:
        raw = read_label_image(path)
    if raw.shape != tuple(study.shape):
        (h, w), (sh, sw) = raw.shape[:2], study.shape
        raise DataError(f"{path}: the mask is {w}x{h} pixels but its image {study.source or ''} is {sw}x{sh} "
                        "(width x height); they must have the same size — choose the mask made for this image, "
                        "or re-export it at the image's size")
    return raw


def _volume_mask(path: Path, study: Study, allow_partial: bool, tolerate_orientation: float | None = None
                 ) -> tuple[np.ndarray, str | None]:
    fmt = volume_format(path)
    if fmt is not None:
        data, affine, _ = read_nifti_volume(path) if fmt == "nifti" else read_itk_volume(path)
        try:
            array, canonical_affine = to_canonical(data, affine)
        except DataError as exc:
            raise DataError(f"{path}: {exc}") from exc
        return fit_to_study(array, canonical_affine, study, path, allow_partial, tolerate_orientation)
    if path.is_dir() or path.suffix.lower() not in _LABEL_IMAGE_SUFFIXES:
        labels = open_study(path)
        if labels.kind != "volume":
            raise DataError(f"{path}: a colour DICOM image cannot be a mask; use a label series, NIfTI or DICOM SEG")
        return fit_to_study(labels.array, labels.affine, study, path, allow_partial, tolerate_orientation)
    raise DataError(f"{path}: a {path.suffix} image is a 2D label map for photos; a volume's mask is NIfTI, "
                    "MHA/NRRD, a DICOM SEG or a DICOM label series")


def _integer_values(raw: np.ndarray, path: Path) -> tuple[int, ...]:
    values = np.unique(raw)
    if values.dtype.kind == "f":
        if not np.isfinite(values).all():
            raise DataError(f"{path}: the mask has NaN or Inf values; a label map holds whole numbers 0..255")
        fractional = values[values != np.round(values)]
        if fractional.size:
            raise DataError(f"{path}: the mask has non-integer values (e.g. {float(fractional[0]):.4g}); a label map "
                            "holds whole numbers — it may have been resampled with linear interpolation, use "
                            "nearest neighbour")
    return tuple(int(v) for v in values)


def read_mask(path: PathLike, study: Study, convention: str | LabelConvention | None = None,
              allow_partial: bool = True, tolerate_orientation: float | None = None) -> MaskReading:
    """Read a mask onto ``study`` (see the module docstring), with the raw values of its file(s).

    Parameters
    ----------
    path
        Mask file or DICOM label folder; for the ``drishti`` convention either soft map of a case.
    study
        The opened image the mask belongs to.
    convention
        A name or :class:`~engine.io.label_conventions.LabelConvention`, or ``None`` (values as
        stored).
    allow_partial
        Whether a mask on a part of the study's grid is placed (the rest 0) or refused.
    tolerate_orientation
        Degrees by which a label volume's orientation may differ from the study's when it is
        otherwise on the study's grid (see :func:`set_orientation_tolerance`, the default).
        DICOM SEG and RTSTRUCT masks are placed by their own geometry and do not use it.

    Raises
    ------
    DataError
        When a file is missing or unreadable, the geometry does not match, or values do not fit
        the convention (or are not whole numbers 0..255).
    ConfigError
        When ``convention`` is not a known name.
    """
    conv = get_convention(convention) if isinstance(convention, str) else convention
    first = Path(path)
    files = conv.label_files(first) if conv is not None else (first,)
    for f in files:
        if not f.exists():
            raise DataError(f"{f}: mask not found; check the path" + (
                f" (the {conv.name} convention needs {', '.join(p.name for p in files)})" if len(files) > 1 and conv
                else ""))
    if len(files) == 1 and (_is_seg(files[0]) or _is_rtstruct(files[0])):
        seg = read_dicom_seg(files[0], study) if _is_seg(files[0]) else read_rtstruct(files[0], study)
        values = (tuple(int(v) for v in np.unique(seg.array)),)
        if conv is None:
            return MaskReading(seg, values)
        label = _apply(conv, [seg.array], files[0])
        return MaskReading(LabelMap(label, conv.names(label), files[0]), values)
    raws, partial = [], None
    for f in files:
        if study.kind == "photo":
            raw = _photo_mask(f, study)
        else:
            raw, note = _volume_mask(f, study, allow_partial, tolerate_orientation)
            partial = partial or note
        raws.append(raw)
    values = tuple(_integer_values(r, f) for r, f in zip(raws, files, strict=True))
    if conv is not None:
        label = _apply(conv, raws, files[0])
        names = conv.names(label)
    else:
        if values[0] and (values[0][0] < 0 or values[0][-1] > 255):
            raise DataError(f"{first}: the mask has values from {values[0][0]} to {values[0][-1]}; a label map holds "
                            "whole numbers 0..255 — map its values, or name a convention (e.g. binary)")
        label = raws[0].astype(np.uint8)
        if study.kind == "photo" and set(values[0]) <= {0, 1, 2}:
            names = dict(FUNDUS_NAMES)
        else:
            names = {v: f"label {v}" for v in values[0] if v != 0}
        names.update(_exported_names(first, set(values[0])))
    return MaskReading(LabelMap(np.ascontiguousarray(label), names, first), values, partial)


def _exported_names(path: Path, values: set[int]) -> dict[int, str]:
    """Label names a mask exported by FedSM carries in its embedded provenance (NIfTI, PNG).

    Only names of values the mask holds; an empty dict for any other file, and for a file whose
    provenance cannot be read (the mask itself was read fine: its names are a nicety).
    """
    try:
        provenance = embedded_provenance(path, mask_format(path))  # None for a DICOM SEG or no record
    except DataError:
        return {}
    if provenance is None:
        return {}
    return {value: name for value, name in provenance.labels.items() if value in values and value != 0}


def _apply(conv: LabelConvention, raws: list[np.ndarray], where: Path) -> np.ndarray:
    try:
        return conv.to_label_map(raws)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from exc


def open_mask(path: PathLike, study: Study, convention: str | None = None) -> LabelMap:
    """Read a mask (label map) aligned voxel for voxel with ``study``; see :func:`read_mask`."""
    return read_mask(path, study, convention).labels
