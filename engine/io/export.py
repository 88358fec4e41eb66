"""Export a mask so other tools open it on top of its image, with its provenance attached.

The format follows the file name:

``.nii`` / ``.nii.gz``
    ``uint8`` label volume with the study's affine (sform and qform, code 1 "scanner"), so it
    lies exactly on the image in 3D Slicer, ITK-SNAP or any NIfTI viewer, also for studies read
    from DICOM (the affine is the study's canonical RAS+ one). Intent ``label``. Provenance as a
    NIfTI header extension (code 6, "comment", holding the JSON) and a sidecar.
``.png``
    2D photos only: 8-bit greyscale label map, values as given (ORIGA style for fundus: 0
    background, 1 rim, 2 cup). Provenance in an ``iTXt`` chunk keyed ``fedsm:provenance``.
``.dcm``
    DICOM SEG referencing the study's source series (DICOM studies only), see
    :mod:`engine.io.dicom_seg`. A summary of the provenance in ContentDescription and in each
    segment's algorithm identification; the full record in a sidecar.

The sidecar is ``<mask name without its suffix>.provenance.json`` beside the mask
(``case_mask.nii.gz`` -> ``case_mask.provenance.json``). The mask and its sidecar are written
to temporary files first and renamed into place only when both are complete, so a failed
export leaves neither.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import DataError
from engine.io.atomic import atomic_path
from engine.io.dicom_seg import build_dicom_seg, save_dicom_seg
from engine.io.guard import open_image
from engine.io.provenance import PROVENANCE_FORMAT, Provenance
from engine.io.study import LabelMap, Study

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

#: File name ending -> export format name.
FORMATS = {".nii.gz": "nifti", ".nii": "nifti", ".png": "png", ".dcm": "dicom-seg"}
#: PNG text chunk key holding the provenance JSON.
PNG_KEY = "fedsm:provenance"
#: NIfTI extension code for free text ("comment"); ours is recognised by its JSON ``format`` key.
NIFTI_COMMENT_CODE = 6
SIDECAR_SUFFIX = ".provenance.json"


def mask_format(path: PathLike) -> str:
    """``"nifti"``, ``"png"`` or ``"dicom-seg"`` from the file name; :class:`DataError` otherwise."""
    name = Path(path).name.lower()
    for suffix, fmt in FORMATS.items():
        if name.endswith(suffix):
            return fmt
    raise DataError(
        f"{path}: cannot tell the mask format from the name; end it with one of {', '.join(FORMATS)}"
    )


def _stem(path: Path) -> str:
    name = path.name
    for suffix in FORMATS:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def sidecar_path(mask_path: PathLike) -> Path:
    """Where the provenance sidecar of ``mask_path`` goes: ``<stem>.provenance.json`` beside it."""
    p = Path(mask_path)
    return p.with_name(_stem(p) + SIDECAR_SUFFIX)


def _label_array(study: Study, labels: LabelMap) -> np.ndarray:
    array = np.asarray(labels.array)
    if tuple(array.shape) != tuple(study.shape):
        raise DataError(
            f"the mask's shape {tuple(array.shape)} differs from the study's {tuple(study.shape)}; "
            "a mask must be aligned voxel for voxel with its study"
        )
    if array.dtype != np.uint8:
        if array.dtype != bool and not np.issubdtype(array.dtype, np.integer):
            raise DataError(f"a mask holds integer label values, got {array.dtype}")
        if array.size and (int(array.min()) < 0 or int(array.max()) > 255):
            raise DataError(
                f"mask values must be 0..255 to be stored as 8-bit labels, got {int(array.min())}..{int(array.max())}"
            )
        array = array.astype(np.uint8)
    return array


def export_mask(study: Study, labels: LabelMap, out_path: PathLike, provenance: Provenance | None = None) -> Path:
    """Write ``labels`` (aligned with ``study``) to ``out_path``; the format follows the suffix.

    Parameters
    ----------
    study
        The image the mask belongs to (its affine, kind and DICOM source are used).
    labels
        ``uint8`` label map of ``study.shape``.
    out_path
        ``.nii``/``.nii.gz``, ``.png`` (photos) or ``.dcm`` (DICOM SEG; DICOM studies). Folders are
        created.
    provenance
        Attached to the mask (and written as a sidecar for NIfTI and DICOM SEG) when given.

    Returns
    -------
    Path
        ``out_path``.

    Raises
    ------
    DataError
        Unknown suffix, a mask that does not fit the study, PNG for a volume, DICOM SEG for a
        study not read from DICOM, or a write that failed (nothing is left behind).
    """
    out = Path(out_path)
    fmt = mask_format(out)
    array = _label_array(study, labels)
    try:
        if fmt == "png":
            _write_png(study, array, out, provenance)
        elif fmt == "nifti":
            with _with_sidecar(out, provenance) as tmp:
                _write_nifti(study, array, tmp, provenance)
        else:
            seg = build_dicom_seg(study, LabelMap(array, labels.names, labels.source), provenance)
            with _with_sidecar(out, provenance) as tmp:
                save_dicom_seg(seg, tmp)
    except OSError as exc:
        raise DataError(f"{out}: could not write the mask ({exc}); check the folder exists and is writable") from exc
    log.info("exported %s mask %s", fmt, out)
    return out


@contextlib.contextmanager
def _with_sidecar(out: Path, provenance: Provenance | None):  # type: ignore[no-untyped-def]
    """Yield a temporary path for the mask; on success rename it and the sidecar into place.

    Both are complete on disk before either is renamed, so an error leaves neither.
    """
    with atomic_path(out) as tmp:
        if provenance is None:
            yield tmp
            # A sidecar left by an earlier export would describe another mask.
            sidecar_path(out).unlink(missing_ok=True)
            return
        with atomic_path(sidecar_path(out)) as side:
            yield tmp
            side.write_text(provenance.to_json() + "\n", encoding="utf-8")


def _source_nifti_header(study: Study) -> Any | None:
    """The source NIfTI's header when the study was read from one whose grid is still ``study.source_grid``."""
    import nibabel as nib

    grid = study.source_grid
    if grid is None or study.source_format != "nifti" or study.source is None or not Path(study.source).is_file():
        return None
    try:
        src = nib.load(str(study.source))
        same = (tuple(int(n) for n in src.shape[:3]) == tuple(grid.shape)
                and np.allclose(src.affine, grid.affine, atol=1e-6))
    except Exception:  # the source changed or went away since it was read: write without it
        return None
    return src.header if same and isinstance(src, nib.Nifti1Image | nib.Nifti2Image) else None


def _write_nifti(study: Study, array: np.ndarray, path: Path, provenance: Provenance | None) -> None:
    """The mask on the source's own grid (voxel order, shape, affine; the source NIfTI's header copied).

    A NIfTI source's header is copied (its sform and qform with their codes, units, dim_info),
    with data type ``uint8``, no scaling, intent ``label`` and its extensions and text fields
    dropped; other sources get sform and qform (code 1) from the source grid's affine. Studies
    without a source grid (made in memory) are written in canonical order.
    """
    import nibabel as nib

    grid = study.source_grid
    if grid is not None and study.kind == "volume":
        array = np.ascontiguousarray(grid.to_source(array))
        affine = np.asarray(grid.affine, dtype=np.float64)
    else:
        affine = np.asarray(study.affine, dtype=np.float64)
    source_header = _source_nifti_header(study)
    if source_header is not None:
        header = nib.Nifti1Header()
        for key in ("dim_info", "xyzt_units", "qform_code", "sform_code", "quatern_b", "quatern_c", "quatern_d",
                    "qoffset_x", "qoffset_y", "qoffset_z", "srow_x", "srow_y", "srow_z", "pixdim", "slice_code",
                    "slice_start", "slice_end", "slice_duration", "toffset"):
            header[key] = source_header[key]
        img = nib.Nifti1Image(array, None, header=header)
        img.set_data_dtype(np.uint8)
        img.header.set_slope_inter(1.0, 0.0)
    else:
        img = nib.Nifti1Image(array, affine)
        img.set_data_dtype(np.uint8)
        # Both transforms, so viewers that prefer the qform (ITK-SNAP) and those that prefer the
        # sform (Slicer, nibabel) place the mask identically.
        img.set_sform(affine, code=1)
        img.set_qform(affine, code=1)
        img.header.set_xyzt_units("mm")
    img.header.set_intent("label")
    if provenance is not None:
        img.header["descrip"] = provenance.summary()[:79].encode("ascii", "replace")
        img.header.extensions.append(
            nib.nifti1.Nifti1Extension(NIFTI_COMMENT_CODE, provenance.to_json(indent=None).encode("utf-8"))
        )
    nib.save(img, str(path))


def _write_png(study: Study, array: np.ndarray, out: Path, provenance: Provenance | None) -> None:
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    if study.kind != "photo":
        raise DataError(
            f"{out}: PNG holds one 2D image, but the study is a volume of {study.num_slices} slices; export it "
            "as .nii.gz (or .dcm for a DICOM series)"
        )
    info = PngInfo()
    if provenance is not None:
        info.add_itxt(PNG_KEY, provenance.to_json(indent=None))
    with atomic_path(out) as tmp:
        Image.fromarray(array, mode="L").save(tmp, format="PNG", pnginfo=info)


# --- reading provenance back ----------------------------------------------------------------------


def read_provenance(path: PathLike) -> Provenance:
    """The provenance of an exported mask (or of its ``.provenance.json`` sidecar).

    NIfTI and PNG carry the full record themselves; a DICOM SEG's full record is its sidecar,
    and without one the SEG's own summary is returned (no per-slice records).

    Raises
    ------
    DataError
        When the file does not exist or carries no FedSM provenance.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: file not found")
    if p.name.endswith(SIDECAR_SUFFIX):
        return Provenance.from_json(p.read_bytes(), str(p))
    fmt = mask_format(p)
    embedded = embedded_provenance(p, fmt)
    if embedded is not None:
        return embedded
    side = sidecar_path(p)
    if side.is_file():
        return Provenance.from_json(side.read_bytes(), str(side))
    if fmt == "dicom-seg":
        summary = _seg_summary(p)
        if summary is not None:
            return summary
    raise DataError(f"{p}: carries no FedSM provenance (and there is no {side.name} beside it)")


def embedded_provenance(path: Path, fmt: str) -> Provenance | None:
    if fmt == "nifti":
        import nibabel as nib

        try:
            header = nib.load(str(path)).header
        except Exception as exc:  # nibabel raises many unrelated types for broken files
            raise DataError(f"{path}: not a readable NIfTI file ({exc})") from None
        for ext in header.extensions:
            if ext.get_code() == NIFTI_COMMENT_CODE and PROVENANCE_FORMAT.encode() in ext.get_content():
                return Provenance.from_json(ext.get_content(), f"{path} (header extension)")
        return None
    if fmt == "png":
        with open_image(path, "PNG") as img:
            text: dict[str, Any] = dict(getattr(img, "text", {}))
        return Provenance.from_json(str(text[PNG_KEY]), f"{path} ({PNG_KEY} chunk)") if PNG_KEY in text else None
    return None


def _seg_summary(path: Path) -> Provenance | None:
    """The provenance summary a FedSM DICOM SEG carries in its algorithm identification."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(path, stop_before_pixels=True)
    except (InvalidDicomError, OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable DICOM file ({exc})") from None
    segments = ds.get("SegmentSequence") or []
    algorithms = [s.SegmentationAlgorithmIdentificationSequence[0]
        for s in segments
        if s.get("SegmentationAlgorithmIdentificationSequence")]
    ours = [a for a in algorithms if a.get("AlgorithmName") == "FedSM super model"]
    if not ours:
        return None
    params = dict(
        item.split("=", 1) for item in str(ours[0].get("AlgorithmParameters", "")).split(",") if "=" in item
    )
    date, time = str(ds.get("ContentDate", "")), str(ds.get("ContentTime", ""))
    created = (
        f"{date[:4]}-{date[4:6]}-{date[6:8]}T{time[:2]}:{time[2:4]}:{time[4:6]}" if len(date) == 8 and len(time) >= 6
        else ""
    )
    gamma = params.get("gamma", "none")
    try:
        return Provenance(
            bundle_name=params.get("bundle", ""),
            bundle_sha256=params.get("bundle_sha256", ""),
            task=params.get("task", ""),
            method=params.get("method", ""),
            routing=params.get("routing", ""),
            gamma=None if gamma == "none" else float(gamma),
            engine_version=str(ours[0].get("AlgorithmVersion", "")),
            created=created,
            forced_model=None if params.get("forced_model", "none") == "none" else params["forced_model"],
            labels={int(s.SegmentNumber): str(s.SegmentLabel) for s in segments},
        )
    except ValueError as exc:
        raise DataError(f"{path}: the FedSM algorithm parameters are malformed ({exc})") from None
