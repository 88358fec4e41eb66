"""One entry point for every study format: list what a path holds, open one study.

:func:`open_study` decides by content first, then by name:

- a folder: its DICOM series (searched recursively; see :mod:`engine.io.dicom_series`);
- a file with the DICOM marker, or named ``*.dcm``/``*.dicom``/``*.ima``/without a suffix: the
  DICOM series it belongs to, gathered from its folder;
- ``*.nii``/``*.nii.gz``/``*.mha``/``*.mhd``/``*.nrrd``/``*.nhdr``: a volume (:mod:`engine.io.volumes`);
- PNG/JPEG/TIFF/BMP content or name: a photo (:mod:`engine.io.photos`); a PNG saved as ``.jpg``
  opens as what it is.

Every failure is an :class:`engine.errors.DataError` naming the path and what to do.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import DataError
from engine.io.dicom_series import describe_series, is_dicom_name, list_dicom_series, read_dicom_file, series_beside
from engine.io.guard import open_image
from engine.io.photos import photo_format, read_photo
from engine.io.study import SeriesInfo, Study
from engine.io.volumes import LPS_TO_RAS, canonical_layout, read_volume, volume_format

PathLike = str | os.PathLike[str]
ProgressFn = Callable[[dict[str, Any]], None]
CancelFn = Callable[[], bool]

#: File signatures of the photo formats Pillow reads (checked before the name).
_PHOTO_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"II*\x00", b"MM\x00*", b"II+\x00", b"BM")
SUPPORTED = ("DICOM folders and files, NIfTI (.nii, .nii.gz), MetaImage (.mha, .mhd), NRRD (.nrrd, .nhdr), "
             "photos (.png, .jpg, .jpeg, .tif, .tiff, .bmp)")


def _head(path: Path, size: int = 132) -> bytes:
    try:
        with path.open("rb") as fh:
            return fh.read(size)
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc}); check the file's permissions") from exc


def detect_format(path: PathLike) -> str:
    """What :func:`open_study` would read ``path`` as: ``"dicom-folder"``, ``"dicom"``, ``"volume"`` or ``"photo"``.

    Raises
    ------
    DataError
        When the path does not exist, or is a file of no supported type.
    """
    p = Path(path)
    if p.is_dir():
        return "dicom-folder"
    if not p.exists():
        raise DataError(f"{p}: no such file or folder; check the path")
    if not p.is_file():
        raise DataError(f"{p}: not a regular file; choose an image file or a DICOM folder")
    head = _head(p)
    if len(head) == 0:
        raise DataError(f"{p}: the file is empty; copy or export it again")
    if len(head) == 132 and head[128:132] == b"DICM":
        return "dicom"
    if volume_format(p) is not None:
        return "volume"
    if head.startswith(_PHOTO_MAGIC) or photo_format(p) is not None:
        return "photo"
    if is_dicom_name(p):
        return "dicom"
    raise DataError(f"{p}: unsupported file type; FedSM opens {SUPPORTED}")


def list_series(path: PathLike) -> list[SeriesInfo]:
    """What can be opened at ``path``, described from headers only (no pixels decoded).

    Parameters
    ----------
    path
        A folder: every DICOM series under it (recursively), image series first, then DICOM SEG
        objects (modality ``"SEG"``; they are masks, open them with :func:`engine.io.masks.open_mask`).
        Non-DICOM files in a folder are not listed: open them as files.
        A DICOM file: its series, counted from the files beside it.
        A volume or photo file: one entry whose ``uid`` is the path.

    Returns
    -------
    list of SeriesInfo
        Empty for a folder without DICOM files.
    """
    p = Path(path)
    kind = detect_format(p)
    if kind == "dicom-folder":
        return list_dicom_series(p)
    if kind == "dicom":
        return [describe_series(*series_beside(p))]
    if kind == "volume":
        return [_volume_info(p)]
    return [_photo_info(p)]


def _volume_info(path: Path) -> SeriesInfo:
    """Slices and slice size of a volume, in canonical order, from its header."""
    try:
        if volume_format(path) == "nifti":
            import nibabel as nib

            img = nib.load(str(path))
            shape = tuple(int(n) for n in img.shape[:3])
            affine = np.asarray(img.affine)
        else:
            import SimpleITK as sitk

            reader = sitk.ImageFileReader()
            reader.SetFileName(str(path))
            reader.ReadImageInformation()
            full = reader.GetDimension()
            shape = tuple(int(n) for n in reader.GetSize()[:3])
            dim = len(shape)
            lps = np.eye(4)
            direction = np.asarray(reader.GetDirection()).reshape(full, full)[:dim, :dim]
            lps[:dim, :dim] = direction * np.asarray(reader.GetSpacing()[:dim])
            affine = LPS_TO_RAS @ lps
        shape = (*shape, *([1] * (3 - len(shape))))
        _, _, canonical = canonical_layout(affine, shape)  # type: ignore[arg-type]
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from exc
    except Exception as exc:  # nibabel/ITK raise many types on broken headers
        raise DataError(f"{path}: not a readable volume header ({exc}); re-export the file") from exc
    return SeriesInfo(uid=str(path), description=path.name, modality="", count=canonical[2],
                      size=(canonical[1], canonical[0]))


def _photo_info(path: Path) -> SeriesInfo:
    with open_image(path, "image") as img:
        width, height = img.size
    return SeriesInfo(uid=str(path), description=path.name, modality="OP", count=1, size=(height, width))


def open_study(path: PathLike, series_uid: str | None = None, progress: ProgressFn | None = None,
               cancel: CancelFn | None = None) -> Study:
    """Open a photo, a volume or a DICOM series as a :class:`Study` (see the module docstring).

    Parameters
    ----------
    path
        A file or a DICOM folder.
    series_uid
        Which series of a DICOM folder (or of a DICOM file's folder) to open, as
        :func:`list_series` lists it. Needed when a folder holds several image series; for a
        volume or photo file it may be the file's own path or ``None``.
    progress
        Called with ``{"event": "status", "message", "done", "total"}`` while a series is read.
    cancel
        Checked between DICOM files; :class:`engine.errors.CancelledError` when it returns true.

    Raises
    ------
    DataError
        When the path is missing, empty, of no supported type, damaged, or a folder holds no or
        several image series (the message lists them: uid, description, count).
    """
    p = Path(path)
    kind = detect_format(p)
    if kind == "dicom-folder":
        return _open_dicom_folder(p, series_uid, progress, cancel)
    if kind == "dicom":
        return read_dicom_file(p, series_uid, progress=progress, cancel=cancel)
    if series_uid is not None and series_uid != str(p):
        raise DataError(f"{p}: is a single {kind} file, it has no series {series_uid}; open it without a series")
    if kind == "volume":
        return read_volume(p)

    return read_photo(p)


def _open_dicom_folder(folder: Path, series_uid: str | None, progress: ProgressFn | None,
                       cancel: CancelFn | None) -> Study:
    """A folder's DICOM series; a folder of photos or volume files says to open one of them."""
    from engine.io.dicom_series import choose_series, read_series, scan_folder

    files = scan_folder(folder, cancel=cancel, progress=progress)
    if series_uid is None and all(f.is_seg for f in files):
        others = sorted(x.name for x in folder.iterdir()
                        if x.is_file() and (photo_format(x) is not None or volume_format(x) is not None))
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise DataError(f"{folder}: holds no DICOM series but {len(others)} image file(s) ({shown}); open one "
                            "of those files instead of the folder")
    _, members = choose_series(folder, files, series_uid)
    return read_series(members, folder, progress=progress, cancel=cancel)

