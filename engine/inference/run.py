"""Segment files on disk with a super-model bundle and record which model handled what.

One call reads a photo, a volume (NIfTI, MHA/NRRD, a DICOM series) or a folder of them,
segments each through :func:`engine.inference.study.segment_with` (the path the desktop app uses
too) and writes one mask per input through :func:`engine.io.export.export_mask`, with its
provenance, beside a ``routing.json`` that says, per image or slice, which model segmented it and
how sure the selector was.

File names often name patients (``DOE^JOHN_1970-01-01.png``), so by default nothing written or
printed names an input: each input is a *case* named by the hash of its content
(:func:`engine.io.privacy.neutral_name`, e.g. ``case-3f2a9c01d4``), its mask is
``<case>_mask.<ext>``, and ``routing.json``, the printed summary and the log say the case.
``keep_names`` (``fedsm infer --keep-names``) names masks and records after the inputs instead;
``name_map`` writes which case is which input to a file the user chose (kept apart from outputs
that are shared). Error messages still name the file that has the problem: they are for the person
who runs the command.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine
from engine.errors import ConfigError, DataError
from engine.inference.predictor import CancelCheck, ProgressCallback
from engine.inference.routing import routing_gamma
from engine.inference.screening import screen_inputs, task_warnings
from engine.inference.study import LoadedBundle, load_predictor, segment_with
from engine.io.atomic import write_text_atomic
from engine.io.export import export_mask
from engine.io.privacy import content_name, neutral_name, public_path
from engine.io.provenance import utc_now
from engine.io.readers import detect_format, list_series, open_study
from engine.io.study import Study
from engine.tasks import TaskSpec, get_task

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
VOLUME_SUFFIXES = (".nii.gz", ".nii", ".mha", ".mhd", ".nrrd", ".nhdr")
ROUTING_FILE = "routing.json"
#: ``--format`` choices and the mask file ending each writes.
MASK_FORMATS = {"nifti": ".nii.gz", "png": ".png", "dicom-seg": ".dcm"}
_SUPPORTED = (
    f"2D photos ({', '.join(IMAGE_SUFFIXES)}), volumes ({', '.join(VOLUME_SUFFIXES)}) and DICOM series"
)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class _Input:
    """One thing to segment: a file, or one DICOM series of a folder."""

    path: Path
    volumetric: bool | None  # None: a DICOM series, photo or volume is known once it is read
    stem: str
    series_uid: str | None = None
    slices_hint: int = 1  # header estimate, for an up-front progress total

    @property
    def is_dicom(self) -> bool:
        return self.series_uid is not None

    def mask_name(self, fmt: str) -> str:
        return f"{self.stem}_mask{MASK_FORMATS[fmt]}"

    def describe(self) -> str:
        return f"{self.path} (series {self.series_uid})" if self.is_dicom else str(self.path)


def _file_stem(path: Path) -> str:
    name = path.name
    for suffix in (*VOLUME_SUFFIXES, *IMAGE_SUFFIXES):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _file_kind(path: Path) -> bool | None:
    """True for a volume file, False for a 2D photo, None for anything else (by name)."""
    name = path.name.lower()
    if name.endswith(VOLUME_SUFFIXES):
        return True
    if name.endswith(IMAGE_SUFFIXES):
        return False
    return None


def _slices_hint(path: Path) -> int:
    """Axial slices of a volume file from its header, for the progress total; 1 when unreadable."""
    try:
        return max(int(list_series(path)[0].count), 1)
    except DataError:  # a broken file is reported properly when it is read
        return 1


def _dicom_inputs(path: Path, stem: str) -> list[_Input]:
    """Each image series under a folder (or the series of a DICOM file); SEG objects are masks and skipped."""
    found = [info for info in list_series(path) if info.modality != "SEG"]
    inputs = []
    for info in found:
        name = stem
        if len(found) > 1:  # several series: tell their masks apart by description and UID tail
            label = _UNSAFE.sub("_", info.description).strip("_")[:40]
            name = f"{stem}_{label}_{info.uid[-8:]}" if label else f"{stem}_{info.uid[-8:]}"
        inputs.append(_Input(path, None, name, series_uid=info.uid, slices_hint=max(int(info.count), 1)))
    return inputs


def _collect_inputs(input_path: Path, out_dir: Path) -> list[_Input]:
    """What to segment, decided from names and headers only (no pixels read)."""
    if not input_path.exists():
        raise DataError(f"{input_path}: not found; choose an image, a volume, a DICOM folder or a folder of them")
    if input_path.is_file():
        kind = detect_format(input_path)  # DataError naming the supported types for anything else
        if kind == "dicom":
            return _dicom_inputs(input_path, input_path.parent.name)
        volumetric = kind == "volume"
        return [_Input(input_path, volumetric, _file_stem(input_path))]
    # A folder: its photos and volume files in name order (not recursive), then the DICOM series
    # under it (recursive). Masks this tool wrote into the same folder on an earlier run are
    # skipped, so running twice does not segment them.
    writes_here = out_dir.resolve() == input_path.resolve()
    inputs = []
    for path in sorted(input_path.iterdir()):
        kind = _file_kind(path)
        if kind is None or not path.is_file() or path.name.startswith("."):
            continue
        if writes_here and _file_stem(path).endswith("_mask"):
            continue
        inputs.append(_Input(path, kind, _file_stem(path)))
    try:
        inputs.extend(_dicom_inputs(input_path, input_path.name))
    except DataError as exc:
        if not inputs:
            raise DataError(f"{input_path}: the folder holds no files to segment ({exc})") from exc
        # Photos or volumes were found; a damaged DICOM file or an overfull folder beside them
        # must not stop those.
        log.warning("%s: DICOM series skipped (%s)", input_path, exc)
    if not inputs:
        raise DataError(f"{input_path}: the folder holds no files to segment; supported are {_SUPPORTED}")
    return inputs


def _resolve_format(fmt: str | None, volumetric: bool) -> str:
    if fmt is None:
        return "nifti" if volumetric else "png"
    return fmt


def _check_inputs(inputs: list[_Input], task: TaskSpec, bundle_name: str, fmt: str | None,
                  keep_names: bool) -> None:
    """Fail before any work when an input does not suit the bundle, the format, or two masks named after
    their inputs collide (neutral names of different content differ; equal content is numbered)."""
    for item in inputs:
        # A DICOM series is a volume or a (colour) photo; read it to know, expect the task's kind.
        volumetric = task.volumetric if item.volumetric is None else item.volumetric
        if volumetric and not task.volumetric:
            raise DataError(
                f"{item.describe()}: is a volume, but the bundle {bundle_name} segments {task.name} "
                f"(2D photos: {', '.join(IMAGE_SUFFIXES)}); choose a {task.name} photo or a volume bundle"
            )
        if not volumetric and task.volumetric:
            raise DataError(
                f"{item.describe()}: is a 2D photo, but the bundle {bundle_name} segments {task.name} "
                f"(volumes: {', '.join(VOLUME_SUFFIXES)} or DICOM series); choose a volume or a fundus bundle"
            )
        chosen = _resolve_format(fmt, volumetric)
        if chosen == "png" and volumetric:
            raise DataError(f"{item.describe()}: is a volume and PNG holds one 2D image; use --format nifti")
        if chosen == "dicom-seg" and not item.is_dicom:
            raise DataError(
                f"{item.describe()}: a DICOM SEG must reference a DICOM series and this input is not one; "
                "use --format nifti"
            )
    if not keep_names:
        return
    by_mask: dict[str, list[str]] = {}
    for item in inputs:
        expected = task.volumetric if item.volumetric is None else item.volumetric
        by_mask.setdefault(item.mask_name(_resolve_format(fmt, expected)), []).append(item.describe())
    clashes = {mask: names for mask, names in by_mask.items() if len(names) > 1}
    if clashes:
        mask, names = next(iter(clashes.items()))
        raise DataError(f"inputs {', '.join(names)} would all be written to {mask}; rename all but one")


def _open(item: _Input, cancel: CancelCheck | None) -> Study:
    return open_study(item.path, series_uid=item.series_uid, cancel=cancel)


def infer_path(
    bundle_path: PathLike,
    input_path: PathLike,
    out_dir: PathLike,
    gamma: float | None = None,
    device: str = "auto",
    progress: ProgressCallback | None = None,
    cancel: CancelCheck | None = None,
    batch_size: int = 16,
    mask_format: str | None = None,
    force_model: str | None = None,
    keep_names: bool = False,
    name_map: PathLike | None = None,
) -> dict[str, Any]:
    """Segment a photo, a volume, a DICOM series, or every such input in a folder.

    Parameters
    ----------
    bundle_path
        The super-model ``.safetensors`` file.
    input_path
        A 2D photo (PNG/JPG/JPEG/TIF/TIFF/BMP; fundus bundles), a volume (NIfTI, MHA/MHD,
        NRRD/NHDR; prostate bundles), a DICOM file (its series), or a folder: its photos and
        volume files (not recursive) and every DICOM image series under it (recursive; SEG
        objects are masks and skipped). Volumes are segmented as axial slices of their canonical
        RAS+ form (:mod:`engine.io.study`) in one batched call.
    out_dir
        Created if needed. Receives ``<case>_mask.<ext>`` per input (``<case>``: ``case-`` and 10
        hex digits of the SHA-256 of the input's files, ``-2``, ``-3`` ... added for inputs of equal
        content), provenance sidecars for NIfTI and DICOM SEG masks (see :mod:`engine.io.export`),
        and ``routing.json``.
    gamma
        Routing threshold; ``None`` uses the bundle's. Ignored by FedSM-extra bundles.
    device
        See :func:`engine.device.resolve_device`.
    progress
        ``(done, total)`` over all inputs, in image-steps (each image or slice counts once for the
        selector and once for its U-Net). The total comes from file headers up front and is
        corrected when an input turns out to hold another number of axial slices.
    cancel
        Checked before every batch; raises :class:`engine.errors.CancelledError` when it returns True.
    batch_size
        Images or slices per forward pass.
    mask_format
        ``"nifti"`` (``.nii.gz``), ``"png"`` (photos) or ``"dicom-seg"`` (``.dcm``, DICOM inputs);
        ``None``: NIfTI for volumes, PNG for photos.
    force_model
        ``None`` routes every image with the selector; ``"global"`` or a site's name sends every
        image to that model (``fedsm infer --model-choice``).
    keep_names
        Name masks ``<stem>_mask.<ext>`` after their inputs (``<stem>``: the file name without
        suffix, or the DICOM folder's name, plus the series description and UID tail when a
        folder holds several series) and record each input's path in ``routing.json``; off by
        default (see the module docstring).
    name_map
        A file to write ``{case: input}`` to (JSON, the input relative to ``input_path``, plus the
        series UID of a DICOM series); nothing is written when ``None``.

    Returns
    -------
    dict
        The content of ``routing.json``: bundle path and SHA-256, gamma, device, ``names``
        (``"neutral"`` or ``"kept"``), and per input its case (or, keeping names, its path), mask
        file, format and one record per image or slice (index, model, confidence, probabilities
        by name, runner-up).

    Raises
    ------
    DataError
        Missing input, unsupported file type, empty folder, an input that does not fit the
        bundle's task or the mask format, or an unreadable file.
    BundleError
        When the bundle cannot be used.
    ConfigError
        Unknown mask format, bad gamma or batch size.
    """
    bundle_file = Path(bundle_path)
    source = Path(input_path)
    out = Path(out_dir)
    if mask_format is not None and mask_format not in MASK_FORMATS:
        raise ConfigError(f"unknown mask format {mask_format!r}; choose one of {', '.join(MASK_FORMATS)}")
    inputs = _collect_inputs(source, out)
    # masks (named by a datalist, or label maps by content) are not segmented; see screening.py

    inputs, skipped, warnings = screen_inputs(inputs, source)
    if not inputs:
        raise DataError(f"{source}: every file there is a mask or label map ({skipped[0]['reason']}); choose the "
                        "folder of images")

    loaded: LoadedBundle = load_predictor(bundle_file, device)
    meta = loaded.predictor.metadata
    task = get_task(meta.task)  # known: load_bundle validated the metadata
    _check_inputs(inputs, task, loaded.name, mask_format, keep_names)
    if keep_names:
        for entry in skipped:
            log.warning("skipped %s: %s", entry["input"], entry["reason"])
    else:  # a skipped file (of the input folder) is a case too: its content's hash, not its name
        skipped = [{"case": content_name([source / entry["input"]]), "reason": entry["reason"]} for entry in skipped]
        for entry in skipped:
            log.warning("skipped %s: %s", entry["case"], entry["reason"])

    hints = [_slices_hint(item.path) if item.volumetric else item.slices_hint
             for item in inputs]
    total = 2 * sum(hints)
    offset = 0

    def relay(done: int, _total: int) -> None:
        if progress is not None:
            progress(min(offset + done, total), total)

    records: list[dict[str, Any]] = []
    cases: dict[str, str] = {}  # case -> the input, for name_map
    out.mkdir(parents=True, exist_ok=True)
    for n, item in enumerate(inputs):
        study = _open(item, cancel)
        # Correct the up-front estimate with the real number of axial slices.
        total += 2 * (study.num_slices - hints[n])
        seg = segment_with(loaded, study, gamma=gamma, batch_size=batch_size, progress=relay, cancel=cancel,
                           force_model=force_model)
        offset += 2 * study.num_slices
        # Relative to the input the user named (folders may name patients): no absolute path.
        shown = public_path(item.path, source)
        case = ""
        if not keep_names or name_map is not None:  # hashing reads the input's files once more
            case = _unique(neutral_name(study), cases)
            cases[case] = shown + (f" (series {item.series_uid})" if item.is_dicom else "")
        label = shown if keep_names else case
        notes = [f"{label}: {note}" for note in warnings.get(str(item.path), [])]
        notes += task_warnings(study, task, where=label)
        for note in notes:
            log.warning("%s", note)
        fmt = _resolve_format(mask_format, study.kind == "volume")
        mask_name = item.mask_name(fmt) if keep_names else f"{case}_mask{MASK_FORMATS[fmt]}"
        mask_path = export_mask(study, seg.labels, out / mask_name, seg.provenance())
        record: dict[str, Any] = {"input": shown} if keep_names else {"case": case}
        record.update({
            "mask": mask_path.name,
            "format": fmt,
            "kind": "volume" if study.kind == "volume" else "image",
            "shape": list(study.shape),
            "models_used": seg.models_used,
            "images": [r.to_dict() for r in seg.records],
        })
        if notes:
            record["warnings"] = notes
        # A series without a UID is keyed by its folder and description (names, maybe): kept names only.
        if item.is_dicom and (keep_names or not str(item.series_uid).startswith("nouid:")):
            record["series_uid"] = item.series_uid
        records.append(record)
        log.info("segmented %s -> %s", label, mask_path.name)

    result: dict[str, Any] = {
        "bundle": {"path": bundle_file.name, "sha256": loaded.sha256},
        "task": meta.task,
        "method": meta.method,
        "routing": meta.routing,
        "gamma": routing_gamma(meta.gamma, gamma) if meta.routing == "gamma" else None,
        "forced_model": force_model,
        "device": str(loaded.predictor.device),
        "mixed_precision": loaded.predictor.use_amp,
        "created": utc_now(),
        "engine_version": engine.__version__,
        "names": "kept" if keep_names else "neutral",
        "inputs": records,
    }
    extra = getattr(meta, "extra", None) or {}  # a split bundle's view has none
    if extra.get("distilled"):  # FedIOD's student: say how it was trained and at what privacy cost
        result["distilled"] = {"epsilon": extra.get("epsilon"), "delta": extra.get("delta")}
    if skipped:
        result["skipped"] = skipped
    write_text_atomic(out / ROUTING_FILE, json.dumps(result, indent=2, allow_nan=False) + "\n")
    if name_map is not None:
        write_text_atomic(Path(name_map), json.dumps(cases, indent=2) + "\n")
    return result


def _unique(case: str, taken: dict[str, str]) -> str:
    """``case``, or ``case-2``, ``case-3`` ... when an earlier input of the run had the same content."""
    if case not in taken:
        return case
    n = 2
    while f"{case}-{n}" in taken:
        n += 1
    return f"{case}-{n}"
