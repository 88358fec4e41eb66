"""Volumes from NIfTI (nibabel) and MetaImage/NRRD (SimpleITK), in the engine's canonical order.

Every volume leaves this module as a :class:`engine.io.study.Study` of kind ``"volume"``:
``float32 (X, Y, Z)`` in RAS+ closest-canonical voxel order (what :func:`nibabel.as_closest_canonical`
gives), the matching voxel -> RAS+ mm affine, the spacing along each array axis, and a display
window from robust percentiles of the data. :func:`canonical_layout` and :func:`to_canonical` are
shared with the DICOM reader, so every source format ends up in the same order.

- NIfTI: the header's affine (sform when set, else qform), intensity scaling applied. A 2D image
  becomes ``Z = 1``; a 4D file with one volume is squeezed; several volumes are refused. A
  ``.nii.gz`` is decompressed to the end of its gzip stream, so a damaged or truncated file fails
  gzip's CRC/length check instead of loading wrong voxels.
- MHA/MHD/NRRD/NHDR: SimpleITK's origin, spacing and direction (LPS, as ITK stores them) are
  turned into a RAS+ affine. 2D images become ``Z = 1``; colour (vector) images are refused.

nibabel and SimpleITK are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import gzip
import logging
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import DataError
from engine.io.study import SourceGrid, Study, source_view

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

NIFTI_SUFFIXES = (".nii.gz", ".nii")
ITK_SUFFIXES = (".mha", ".mhd", ".nrrd", ".nhdr")
#: Largest volume read, in voxels: 4 GB as float32. Bigger ones must be cropped or downsampled first.
MAX_VOXELS = 1_000_000_000
#: Percentiles of the data that make the default display window (robust to a few hot voxels).
WINDOW_PERCENTILES = (0.5, 99.5)
#: Voxels sampled for the window percentiles (a strided subsample: cheap on big volumes).
_WINDOW_SAMPLES = 1_000_000
#: Most bytes a ``.nii.gz`` may inflate to past its voxel data (nothing belongs there).
MAX_TRAILING_BYTES = 16 << 20
#: Bytes decompressed per read when a gzip stream is read on to its end to check its CRC.
_GZIP_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
#: What :mod:`gzip` raises for a damaged or truncated stream (bad CRC or length, bad deflate data, early end).
_GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)
#: LPS <-> RAS: flip the first two world axes.
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


def volume_format(path: PathLike) -> str | None:
    """``"nifti"``, ``"mha"`` or ``"nrrd"`` from the file name, else ``None``."""
    name = Path(path).name.lower()
    if name.endswith(NIFTI_SUFFIXES):
        return "nifti"
    if name.endswith((".mha", ".mhd")):
        return "mha"
    if name.endswith((".nrrd", ".nhdr")):
        return "nrrd"
    return None


# --- canonical order -------------------------------------------------------------------------


def canonical_layout(affine: np.ndarray, shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray,
                                                                                 tuple[int, int, int]]:
    """How a volume of ``shape`` with ``affine`` (voxel -> RAS+) maps to RAS+ closest-canonical order.

    Returns
    -------
    ornt, canonical_affine, canonical_shape
        nibabel orientation (``ornt[i] = (output axis, flip)`` for source axis ``i``), the affine
        of the reordered voxels and their shape.

    Raises
    ------
    DataError
        When the affine is degenerate (an axis of zero length, NaN or Inf).
    """
    from nibabel.orientations import inv_ornt_aff, io_orientation

    affine = np.asarray(affine, dtype=np.float64)
    if not np.all(np.isfinite(affine)):
        raise DataError(f"the voxel-to-world transform has NaN or Inf entries: {affine[:3].tolist()}")
    try:
        ornt = io_orientation(affine)
    except (np.linalg.LinAlgError, ValueError) as exc:
        raise DataError(f"the voxel-to-world transform cannot be inverted ({exc}): "
                        f"{np.round(affine[:3], 4).tolist()}; fix the file's spacing/orientation") from None
    if np.isnan(ornt).any():
        raise DataError(f"the voxel-to-world transform is degenerate (an axis has zero length): "
                        f"{np.round(affine[:3], 4).tolist()}; fix the file's spacing/orientation")
    canonical_affine = affine @ inv_ornt_aff(ornt, shape)
    canonical_shape = tuple(int(shape[int(np.flatnonzero(ornt[:, 0] == a)[0])]) for a in range(3))
    return ornt, canonical_affine, canonical_shape  # type: ignore[return-value]


def to_canonical(array: np.ndarray, affine: np.ndarray, dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``(array, affine)`` reordered to RAS+ closest-canonical order, C-contiguous ``dtype``."""
    ornt, canonical_affine, shape = canonical_layout(affine, tuple(array.shape[:3]))  # type: ignore[arg-type]
    out = np.empty(shape, dtype=dtype)
    source_view(out, ornt)[...] = array
    return out, canonical_affine


def voxel_spacing(affine: np.ndarray) -> tuple[float, float, float]:
    """Millimetres per voxel along each array axis (column norms of the affine)."""
    return tuple(float(v) for v in np.sqrt((np.asarray(affine)[:3, :3] ** 2).sum(axis=0)))  # type: ignore[return-value]


def robust_window(array: np.ndarray) -> tuple[float, float]:
    """Display ``(center, width)`` spanning the 0.5th..99.5th percentiles of the finite values."""
    flat = array.reshape(-1)
    step = max(1, flat.size // _WINDOW_SAMPLES)
    sample = flat[::step]
    sample = sample[np.isfinite(sample)]
    if sample.size == 0:
        return 0.0, 1.0
    lo, hi = (float(v) for v in np.percentile(sample, WINDOW_PERCENTILES))
    if hi <= lo:
        lo, hi = float(sample.min()), float(sample.max())
    width = hi - lo if hi > lo else 1.0
    return (lo + hi) / 2.0, width


def _check_voxels(path: Path, shape: tuple[int, ...]) -> None:
    if any(int(n) <= 0 for n in shape):
        raise DataError(f"{path}: the volume has no voxels (shape {tuple(shape)}); re-export it")
    total = int(np.prod([int(n) for n in shape], dtype=np.int64))
    if total > MAX_VOXELS:
        raise DataError(f"{path}: the volume has {total:,} voxels (shape {tuple(shape)}), more than the "
                        f"{MAX_VOXELS:,} FedSM reads; crop or downsample it first")


def _existing(path: PathLike) -> Path:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: file not found; check the path")
    return p


def _axcodes(affine: np.ndarray) -> str:
    """The file's axis codes (``"LPS"``, ...); ``"?"`` where an axis is degenerate."""
    from nibabel.orientations import aff2axcodes

    return "".join(str(c) if c is not None else "?" for c in aff2axcodes(affine))


def _checked_affine(path: Path, affine: Any) -> np.ndarray:
    """The file's voxel-to-world affine, refused when NaN/Inf or so large its orientation cannot be found.

    A NaN in a NIfTI's ``srow`` (or qform quaternion) would otherwise surface as numpy's
    ``LinAlgError: SVD did not converge`` from the orientation code.
    """
    from nibabel.orientations import io_orientation

    affine = np.asarray(affine, dtype=np.float64)
    if affine.shape != (4, 4) or not np.all(np.isfinite(affine)):
        raise DataError(f"{path}: the voxel-to-world transform (NIfTI sform/qform, or origin/spacing/direction) has "
                        f"NaN or Inf entries: {np.round(affine[:3], 4).tolist()}; the header is damaged — fix it "
                        "(e.g. fslorient, or re-export the image)")
    try:
        io_orientation(affine)
    except (np.linalg.LinAlgError, ValueError) as exc:
        raise DataError(f"{path}: the voxel-to-world transform cannot be inverted ({exc}); the header is damaged — "
                        "re-export the image") from None
    return affine


# --- NIfTI ------------------------------------------------------------------------------------


def _gzip_error(path: Path, exc: BaseException) -> DataError:
    return DataError(f"{path}: the compressed (gzip) data is damaged or truncated ({exc}); copy or re-export the file")


def _gzip_damage(path: Path) -> BaseException | None:
    """What is wrong with a gzip file's stream (read to its end in chunks); ``None`` when intact or not gzip."""
    try:
        with path.open("rb") as fh:
            if fh.read(2) != _GZIP_MAGIC:
                return None
        with gzip.open(path, "rb") as stream:
            total = 0
            while chunk := stream.read(_GZIP_CHUNK):
                total += len(chunk)
                if total > 4 * MAX_VOXELS:  # no voxel data is that long: stop reading a bomb
                    return DataError(f"inflates to more than {4 * MAX_VOXELS / 2**30:.1f} GiB")
    except (*_GZIP_ERRORS, OSError) as exc:
        return exc
    return None


def _nifti_voxels(img: Any, path: Path) -> np.ndarray:
    """Every voxel of a loaded NIfTI image as ``float32`` (scaling applied), in file order.

    A ``.gz`` file is read through one gzip stream to its very end, so :mod:`gzip` checks the
    CRC-32 and length in the stream's trailer: nibabel stops after the voxel bytes and never
    reaches it, and a damaged byte that still inflates would otherwise load as wrong voxels. The
    stream is decompressed once; the rest after the voxels is read in chunks, not kept.
    """
    if not path.name.lower().endswith(".gz"):
        return np.asarray(img.dataobj, dtype=np.float32)
    with gzip.open(path, "rb") as stream:
        checked = type(img).from_stream(stream)
        data = np.asarray(checked.dataobj, dtype=np.float32)
        trailing = 0
        while chunk := stream.read(_GZIP_CHUNK):
            trailing += len(chunk)
            if trailing > MAX_TRAILING_BYTES:  # nothing follows a NIfTI's voxels: a bomb, not an image
                raise DataError(f"{path}: more than {MAX_TRAILING_BYTES >> 20} MiB of compressed data follow the "
                                "voxels; the file is damaged or hostile — re-export it")
    return data


def read_nifti_volume(path: PathLike) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """A NIfTI file's voxels in file order as 3D (scaling applied), its affine and descriptors.

    Raises
    ------
    DataError
        When the file is missing, unreadable, damaged or truncated (for ``.nii.gz`` the whole gzip
        stream is checked, CRC included), not 2D/3D (a 4D file with one volume is fine), too big,
        or not a scalar image.
    """
    import nibabel as nib

    p = _existing(path)
    try:
        img = nib.load(str(p))
    except Exception as exc:  # nibabel raises many unrelated types for broken files
        damage = _gzip_damage(p)
        if damage is not None:  # nibabel reports a damaged stream as "cannot work out file type"
            raise _gzip_error(p, damage) from exc
        raise DataError(f"{p}: not a readable NIfTI file ({exc}); re-export it as .nii.gz") from exc
    if not isinstance(img, nib.Nifti1Image | nib.Nifti2Image):
        raise DataError(f"{p}: is a {type(img).__name__}, not NIfTI; save it as .nii.gz")
    shape = tuple(int(n) for n in img.shape)
    if len(shape) == 4 and shape[3] == 1:
        shape = shape[:3]
    if len(shape) == 2:
        shape = (*shape, 1)
    if len(shape) != 3:
        raise DataError(f"{p}: has shape {tuple(img.shape)}, not one 3D volume; split the 4D series and "
                        "choose one volume (e.g. fslsplit or nibabel's four_to_three)")
    _check_voxels(p, shape)
    dtype = img.get_data_dtype()
    if dtype.names is not None or np.issubdtype(dtype, np.complexfloating):
        raise DataError(f"{p}: holds {dtype} voxels (colour or complex); FedSM reads scalar volumes — "
                        "convert it to one grey value per voxel")
    try:
        data = _nifti_voxels(img, p).reshape(shape)
    except DataError:
        raise
    except _GZIP_ERRORS as exc:
        raise _gzip_error(p, exc) from exc
    except Exception as exc:  # truncated data, wrong sizes in the header
        raise DataError(f"{p}: the voxel data cannot be read ({exc}); the file is damaged or truncated, "
                        "re-export it") from exc
    try:
        affine = _checked_affine(p, img.affine)
    except DataError:
        raise
    except Exception as exc:  # nibabel computing a qform affine from a damaged quaternion
        raise DataError(f"{p}: the NIfTI orientation (sform/qform) cannot be read ({exc}); the header is damaged — "
                        "re-export it") from None
    return data, affine, {"format": type(img).__name__.replace("Image", ""), "file_orientation": _axcodes(affine)}


# --- MetaImage / NRRD -------------------------------------------------------------------------


def read_itk_volume(path: PathLike) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """An MHA/MHD/NRRD/NHDR file's voxels as ``(X, Y, Z)``, its RAS+ affine and descriptors.

    Raises
    ------
    DataError
        When the file is missing, unreadable, not 2D/3D, too big or not a scalar image.
    """
    import SimpleITK as sitk

    p = _existing(path)
    reader = sitk.ImageFileReader()
    reader.SetFileName(str(p))
    try:
        reader.ReadImageInformation()
    except RuntimeError as exc:
        raise DataError(f"{p}: not a readable MetaImage/NRRD file ({_itk_reason(exc)}); re-export it") from exc
    dim = reader.GetDimension()
    size = tuple(int(n) for n in reader.GetSize())
    if dim == 4 and size[3] == 1:
        size = size[:3]
    if len(size) not in (2, 3):
        raise DataError(f"{p}: has {dim} dimensions (size {size}), not one 3D volume; save one volume per file")
    if reader.GetNumberOfComponents() != 1:
        raise DataError(f"{p}: has {reader.GetNumberOfComponents()} values per voxel (a colour or vector image); "
                        "FedSM reads scalar volumes — convert it to one grey value per voxel")
    _check_voxels(p, size if len(size) == 3 else (*size, 1))
    try:
        image = reader.Execute()
    except RuntimeError as exc:
        raise DataError(f"{p}: the voxel data cannot be read ({_itk_reason(exc)}); the file is damaged, truncated "
                        "or its data file is missing — re-export it") from exc
    if image.GetDimension() == 4:
        image = image[:, :, :, 0]
    data = sitk.GetArrayFromImage(image)  # (z, y, x) or (y, x); a copy: the image's buffer dies with it
    spacing = np.asarray(image.GetSpacing(), dtype=np.float64)
    origin = np.asarray(image.GetOrigin(), dtype=np.float64)
    direction = np.asarray(image.GetDirection(), dtype=np.float64).reshape(len(spacing), len(spacing))
    lps = np.eye(4)
    if data.ndim == 2:
        data = data[None]
        lps[:2, :2] = direction * spacing
        lps[:2, 3] = origin
    else:
        lps[:3, :3] = direction * spacing
        lps[:3, 3] = origin
    array = np.asarray(data, dtype=np.float32).transpose(2, 1, 0)
    affine = _checked_affine(p, LPS_TO_RAS @ lps)
    description = {"format": "NRRD" if volume_format(p) == "nrrd" else "MetaImage",
                   "file_orientation": _axcodes(affine)}
    modality = _itk_modality(reader)
    if modality:
        description["Modality"] = modality
    return array, affine, description


def _itk_reason(exc: BaseException) -> str:
    """The useful last line of an ITK exception (its messages carry C++ file paths first)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _itk_modality(reader: Any) -> str:
    """MetaImage's ``Modality = MET_MOD_CT`` style key, as ``"CT"``; empty when absent."""
    for key in ("Modality", "modality"):
        if reader.HasMetaDataKey(key):
            value = reader.GetMetaData(key).strip()
            return value.removeprefix("MET_MOD_") if value.startswith("MET_MOD_") and value != "MET_MOD_UNKNOWN" else ""
    return ""


# --- Study ------------------------------------------------------------------------------------


def read_volume(path: PathLike) -> Study:
    """Read a NIfTI, MHA/MHD or NRRD/NHDR volume as a canonical :class:`Study`.

    Raises
    ------
    DataError
        When the file cannot be used (see :func:`read_nifti_volume`, :func:`read_itk_volume`).
    """
    p = Path(path)
    fmt = volume_format(p)
    if fmt is None:
        raise DataError(f"{p}: not a volume file name; volumes end in {', '.join(NIFTI_SUFFIXES + ITK_SUFFIXES)}")
    if fmt == "nifti":
        data, affine, description = read_nifti_volume(p)
    else:
        data, affine, description = read_itk_volume(p)
    try:
        array, canonical_affine = to_canonical(data, affine)
        ornt, _, _ = canonical_layout(affine, tuple(data.shape[:3]))  # type: ignore[arg-type]
    except DataError as exc:
        raise DataError(f"{p}: {exc}") from exc
    if not np.isfinite(array).all():
        log.warning("%s: has NaN or Inf voxels; they are kept", p)
    return Study(
        array=array,
        kind="volume",
        affine=canonical_affine,
        spacing=voxel_spacing(canonical_affine),
        modality=description.pop("Modality", ""),
        window=robust_window(array),
        source=p,
        source_format=fmt,
        description=description,
        source_grid=SourceGrid(tuple(int(n) for n in data.shape[:3]), affine, ornt),  # type: ignore[arg-type]
    )
