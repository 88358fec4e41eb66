"""Segment files on disk with a super-model bundle and record which model handled what.

One call reads a photo, a volume or a folder of them, writes one mask per input beside a
``routing.json`` that says, per image or slice, which model segmented it and how sure the
selector was.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

import engine
from engine.bundle.supermodel import SuperModelBundle, file_sha256, load_bundle
from engine.data.preprocess import (
    fundus_channels_to_label,
    normalise_rgb,
    normalise_volume,
    slices_to_volume,
    volume_to_slices,
)
from engine.errors import DataError
from engine.inference.predictor import CancelCheck, Prediction, ProgressCallback, SuperModelPredictor
from engine.io.atomic import write_text_atomic
from engine.io.files import read_nifti, read_rgb_image, write_label_png, write_nifti
from engine.tasks import TaskSpec, get_task

PathLike = str | os.PathLike[str]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
VOLUME_SUFFIXES = (".nii", ".nii.gz")
ROUTING_FILE = "routing.json"
_SUPPORTED = f"2D photos ({', '.join(IMAGE_SUFFIXES)}) or NIfTI volumes ({', '.join(VOLUME_SUFFIXES)})"


@dataclass(frozen=True)
class _Input:
    path: Path
    volumetric: bool

    @property
    def stem(self) -> str:
        name = self.path.name
        for suffix in (".nii.gz", *IMAGE_SUFFIXES, ".nii"):
            if name.lower().endswith(suffix):
                return name[: -len(suffix)]
        return self.path.stem

    @property
    def mask_name(self) -> str:
        return f"{self.stem}_mask.nii.gz" if self.volumetric else f"{self.stem}_mask.png"


def _kind(path: Path) -> bool | None:
    """True for a volume, False for a 2D photo, None for an unsupported file."""
    name = path.name.lower()
    if name.endswith(VOLUME_SUFFIXES):
        return True
    if name.endswith(IMAGE_SUFFIXES):
        return False
    return None


def _collect_inputs(input_path: Path, out_dir: Path) -> list[_Input]:
    if not input_path.exists():
        raise DataError(f"{input_path}: not found; choose an image, a NIfTI volume or a folder of them")
    if input_path.is_file():
        kind = _kind(input_path)
        if kind is None:
            raise DataError(f"{input_path}: unsupported file type; supported are {_SUPPORTED}")
        return [_Input(input_path, kind)]
    # A folder: its supported files, in name order. Masks this tool wrote into the same folder on
    # an earlier run are skipped, so running twice does not segment the masks.
    writes_here = out_dir.resolve() == input_path.resolve()
    inputs = []
    for path in sorted(input_path.iterdir()):
        kind = _kind(path)
        if kind is None or not path.is_file() or path.name.startswith("."):
            continue
        item = _Input(path, kind)
        if writes_here and item.stem.endswith("_mask"):
            continue
        inputs.append(item)
    if not inputs:
        raise DataError(f"{input_path}: the folder holds no files to segment; supported are {_SUPPORTED}")
    return inputs


def _check_inputs(inputs: list[_Input], task: TaskSpec, bundle: SuperModelBundle) -> None:
    """Fail before any work when an input does not suit the bundle's task or two masks collide."""
    for item in inputs:
        if item.volumetric and not task.volumetric:
            raise DataError(
                f"{item.path}: is a NIfTI volume, but the bundle {bundle.describe()} segments {task.name} "
                f"(2D photos: {', '.join(IMAGE_SUFFIXES)}); choose a {task.name} photo or a volume bundle"
            )
        if not item.volumetric and task.volumetric:
            raise DataError(
                f"{item.path}: is a 2D photo, but the bundle {bundle.describe()} segments {task.name} "
                f"(MRI volumes: {', '.join(VOLUME_SUFFIXES)}); choose a NIfTI volume or a fundus bundle"
            )
    by_mask: dict[str, list[str]] = {}
    for item in inputs:
        by_mask.setdefault(item.mask_name, []).append(item.path.name)
    clashes = {mask: names for mask, names in by_mask.items() if len(names) > 1}
    if clashes:
        mask, names = next(iter(clashes.items()))
        raise DataError(f"inputs {', '.join(names)} would all be written to {mask}; rename all but one")


def _count_images(item: _Input) -> int:
    """Images (slices) an input holds, read from the header only, for an up-front progress total."""
    if not item.volumetric:
        return 1
    import nibabel as nib

    try:
        shape = nib.load(str(item.path)).shape
    except Exception:  # a broken file is reported properly when it is read
        return 1
    return int(shape[2]) if len(shape) >= 3 else 1


def _label_map(task: TaskSpec, masks: np.ndarray) -> np.ndarray:
    """Binary ``(L, ...)`` masks -> ``uint8`` label map of shape ``(...)``.

    Fundus uses the ORIGA convention (0 background, 1 rim, 2 cup); other tasks write channel
    ``i`` as value ``i + 1``, later channels winning where structures overlap.
    """
    if task.name == "fundus":
        return fundus_channels_to_label(masks)
    label = np.zeros(masks.shape[1:], dtype=np.uint8)
    for channel in range(masks.shape[0]):
        label[masks[channel] > 0] = channel + 1
    return label


def _image_records(
    prediction: Prediction, model_names: list[str], prob_names: list[str]
) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "model": model_names[int(prediction.routed[i])],
            "confidence": float(prediction.confidence[i]),
            "probabilities": {
                name: float(p) for name, p in zip(prob_names, prediction.probabilities[i], strict=True)
            },
        }
        for i in range(len(prediction.routed))
    ]


def infer_path(
    bundle_path: PathLike,
    input_path: PathLike,
    out_dir: PathLike,
    gamma: float | None = None,
    device: str = "auto",
    progress: ProgressCallback | None = None,
    cancel: CancelCheck | None = None,
    batch_size: int = 16,
) -> dict[str, Any]:
    """Segment a photo, a volume, or every such file in a folder, with a super-model bundle.

    Parameters
    ----------
    bundle_path
        The super-model ``.safetensors`` file.
    input_path
        A 2D photo (PNG/JPG/JPEG/TIF/TIFF/BMP; fundus bundles), a NIfTI volume (.nii/.nii.gz;
        prostate bundles, segmented slice by slice in one batched call) or a folder of them
        (not recursive).
    out_dir
        Created if needed. Receives ``<stem>_mask.png`` (ORIGA label map: 0 background,
        1 rim, 2 cup) or ``<stem>_mask.nii.gz`` (``uint8`` labels, the source's affine) per
        input, and ``routing.json``.
    gamma
        Routing threshold; ``None`` uses the bundle's. Ignored by FedSM-extra bundles.
    device
        See :func:`engine.inference.device.resolve_device`.
    progress
        ``(done, total)`` over all inputs, in image-steps (each image or slice counts once for the
        selector and once for its U-Net).
    cancel
        Checked before every batch; raises :class:`engine.errors.CancelledError` when it returns True.
    batch_size
        Images or slices per forward pass.

    Returns
    -------
    dict
        The content of ``routing.json``: bundle path and SHA-256, gamma, device, and per input
        its mask file and one record per image or slice (index, model, confidence,
        probabilities by name).

    Raises
    ------
    DataError
        Missing input, unsupported file type, empty folder, an input that does not fit the
        bundle's task, or an unreadable file.
    BundleError
        When the bundle cannot be used.
    """
    bundle_file = Path(bundle_path)
    source = Path(input_path)
    out = Path(out_dir)
    inputs = _collect_inputs(source, out)

    bundle = load_bundle(bundle_file)
    bundle_sha256 = file_sha256(bundle_file)
    meta = bundle.metadata
    task = get_task(meta.task)  # known: load_bundle validated the metadata
    _check_inputs(inputs, task, bundle)
    predictor = SuperModelPredictor(bundle, device=device)
    del bundle  # the networks hold their own copy; the classic selector alone is ~0.5 GB

    model_names = meta.model_names
    prob_names = model_names if meta.routing == "argmax" else list(meta.site_names)
    counts = [_count_images(item) for item in inputs]
    total = 2 * sum(counts)
    offset = 0

    def relay(done: int, _total: int) -> None:
        if progress is not None:
            progress(min(offset + done, total), total)

    records: list[dict[str, Any]] = []
    out.mkdir(parents=True, exist_ok=True)
    for item, count in zip(inputs, counts, strict=True):
        mask_path = out / item.mask_name
        if item.volumetric:
            volume, affine = read_nifti(item.path)
            slices = volume_to_slices(normalise_volume(volume))
            prediction = predictor.predict(
                slices, gamma=gamma, batch_size=batch_size, progress=relay, cancel=cancel
            )
            # (Z, L, X, Y) -> (L, Z, X, Y): the label rule works on any trailing shape.
            labels = _label_map(task, prediction.masks.transpose(1, 0, 2, 3))
            write_nifti(mask_path, slices_to_volume(labels), affine)
            shape = list(volume.shape)
        else:
            image = read_rgb_image(item.path)
            prediction = predictor.predict(
                normalise_rgb(image)[None], gamma=gamma, batch_size=batch_size, progress=relay, cancel=cancel
            )
            write_label_png(mask_path, _label_map(task, prediction.masks[0]))
            shape = list(image.shape[:2])
        offset += 2 * count
        used = Counter(model_names[int(k)] for k in prediction.routed)
        records.append(
            {
                "input": str(item.path.resolve()),
                "mask": mask_path.name,
                "kind": "volume" if item.volumetric else "image",
                "shape": shape,
                "models_used": dict(sorted(used.items())),
                "images": _image_records(prediction, model_names, prob_names),
            }
        )

    result: dict[str, Any] = {
        "bundle": {"path": str(bundle_file.resolve()), "sha256": bundle_sha256},
        "task": meta.task,
        "method": meta.method,
        "routing": meta.routing,
        "gamma": (meta.gamma if gamma is None else float(gamma)) if meta.routing == "gamma" else None,
        "device": str(predictor.device),
        "mixed_precision": predictor.use_amp,
        "created": datetime.now(UTC).replace(microsecond=0).isoformat(),
        "engine_version": engine.__version__,
        "inputs": records,
    }
    write_text_atomic(out / ROUTING_FILE, json.dumps(result, indent=2, allow_nan=False) + "\n")
    return result
