"""Segment one :class:`~engine.io.study.Study` with a super model: the path the CLI and the GUI share.

A photo is one image; a volume is segmented as its axial slices ``array[:, :, k]`` (canonical
RAS+ order, see :mod:`engine.io.study`) in one batched call. Images are scaled with the bundle's
task normalisation, resized to the networks' input size inside the predictor, and the masks come
back at the study's resolution, so the label map is aligned voxel for voxel with the study.

Predictors are cached by (bundle SHA-256, device): re-running the same study with another gamma
or a forced model, as the desktop app does, reuses the loaded networks.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.bundle.split import is_split_bundle, load_split_bundle
from engine.bundle.supermodel import BundleMetadata, file_sha256, load_bundle, read_metadata
from engine.data.disc_crop import CROP_MODES, CropBox, disc_box
from engine.data.preprocess import (
    fundus_channels_to_label,
    normalise_rgb,
    normalise_volume,
    slices_to_volume,
    volume_to_slices,
)
from engine.device import resolve_device
from engine.errors import ConfigError, DataError
from engine.inference.postprocess import clean_fundus_masks
from engine.inference.predictor import CancelCheck, Prediction, ProgressCallback, SuperModelPredictor
from engine.inference.routing import check_gamma, routing_gamma
from engine.inference.split_predictor import SplitPredictor
from engine.io.provenance import ImageRecord, Provenance, utc_now
from engine.io.study import LabelMap, Study
from engine.tasks import TaskSpec, get_task
from engine.threads import use_free_cores

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

#: Loaded predictors kept for re-runs: a few MB to ~0.5 GB each (classic selector head).
PREDICTOR_CACHE_SIZE = 2


# --- the predictor cache ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedBundle:
    """A predictor with the identity of the file it was built from."""

    predictor: SuperModelPredictor
    sha256: str
    name: str


_lock = threading.Lock()
_predictors: OrderedDict[tuple[str, str], SuperModelPredictor] = OrderedDict()
#: (resolved path, size, mtime_ns) -> SHA-256, so a cache hit does not re-hash the file.
_hashes: dict[tuple[str, int, int], str] = {}


def _bundle_sha256(path: Path) -> str:
    if not path.is_file():
        read_metadata(path)  # raises the bundle's own "not found" / "is a folder" error
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _lock:
        known = _hashes.get(key)
    if known is None:
        known = file_sha256(path)
        with _lock:
            _hashes[key] = known
    return known


def load_predictor(bundle_path: PathLike, device: str = "auto") -> LoadedBundle:
    """The predictor for a bundle on a device, from the cache when the same file was loaded before.

    The key is the file's SHA-256 and the resolved device, so an edited or replaced bundle file is
    loaded afresh and ``"auto"`` shares an entry with the device it resolves to.

    Raises
    ------
    BundleError
        When the bundle cannot be read or its weights do not fit.
    DeviceError, ConfigError
        When the device is unavailable or unknown.
    """
    path = Path(bundle_path)
    sha = _bundle_sha256(path)
    torch_device, _ = resolve_device(device)
    if torch_device.type == "cpu":
        use_free_cores()  # CPU inference on a shared machine: only the cores that are free
    key = (sha, str(torch_device))
    with _lock:
        predictor = _predictors.get(key)
        if predictor is not None:
            _predictors.move_to_end(key)
            return LoadedBundle(predictor, sha, path.name)
    # Built outside the lock: loading takes seconds and must not block other lookups.

    if is_split_bundle(path):  # BlackFed: a client net per site and the server net

        predictor = SplitPredictor(load_split_bundle(path), device=str(torch_device))  # type: ignore[assignment]
    else:
        predictor = SuperModelPredictor(load_bundle(path), device=str(torch_device))
    with _lock:
        _predictors[key] = predictor
        _predictors.move_to_end(key)
        while len(_predictors) > PREDICTOR_CACHE_SIZE:
            _predictors.popitem(last=False)
    log.info("loaded super model %s (sha256 %s) on %s", path.name, sha[:12], torch_device)
    return LoadedBundle(predictor, sha, path.name)


def clear_predictor_cache() -> None:
    """Forget every cached predictor (frees their memory once no caller holds them)."""
    with _lock:
        _predictors.clear()
        _hashes.clear()


# --- labels ----------------------------------------------------------------------------------------


def masks_to_label_map(task: TaskSpec, masks: np.ndarray) -> np.ndarray:
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


def label_names(task: TaskSpec) -> dict[int, str]:
    """Label value -> structure name of the maps :func:`masks_to_label_map` writes."""
    if task.name == "fundus":
        return {1: "rim", 2: "cup"}
    return {i + 1: name for i, name in enumerate(task.label_names)}


# --- segmentation ----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StudySegmentation:
    """A super model's segmentation of one study.

    Attributes
    ----------
    labels
        ``uint8`` label map of ``study.shape`` (see :func:`label_names`).
    records
        One per image: the photo, or axial slice ``k`` (``index == k``).
    model_names
        Routable models: ``("global", <site 1>, ..., <site K>)``.
    device
        Torch device the networks ran on.
    gamma
        Routing threshold used (``None`` for argmax-routed FedSM-extra bundles).
    bundle_sha256, bundle_name
        Identity of the bundle file.
    task, method, routing
        From the bundle's metadata.
    forced_model
        The model every image was sent to, ``None`` when routed.
    created
        ISO 8601 UTC time of the segmentation.
    """

    labels: LabelMap
    records: tuple[ImageRecord, ...]
    model_names: tuple[str, ...]
    device: str
    gamma: float | None
    bundle_sha256: str
    bundle_name: str
    task: str
    method: str
    routing: str
    forced_model: str | None = None
    created: str = field(default_factory=utc_now)

    @property
    def models_used(self) -> dict[str, int]:
        """Images per routed model name, sorted by name."""
        counts: dict[str, int] = {}
        for record in self.records:
            counts[record.model] = counts.get(record.model, 0) + 1
        return dict(sorted(counts.items()))

    def provenance(self) -> Provenance:
        """The record attached to an exported mask (see :mod:`engine.io.provenance`)."""
        return Provenance(
            bundle_name=self.bundle_name,
            bundle_sha256=self.bundle_sha256,
            task=self.task,
            method=self.method,
            routing=self.routing,
            gamma=self.gamma,
            created=self.created,
            device=self.device,
            forced_model=self.forced_model,
            labels=dict(self.labels.names),
            images=self.records,
        )


def check_study_fits(study: Study, task: TaskSpec, what: str) -> None:
    """:class:`DataError` when ``study`` is not the kind of image ``task`` segments."""
    where = study.source or "the study"
    if study.kind == "volume" and not task.volumetric:
        raise DataError(
            f"{where}: is a volume, but {what} segments {task.name} photos; choose a {task.name} photo or a "
            "volume bundle"
        )
    if study.kind == "photo" and task.volumetric:
        raise DataError(
            f"{where}: is a 2D photo, but {what} segments {task.name} volumes; choose a volume (NIfTI, DICOM "
            "series, MHA/NRRD) or a photo bundle"
        )
    array = np.asarray(study.array)
    if study.kind == "photo" and (array.ndim != 3 or array.shape[2] != task.in_channels):
        raise DataError(f"{where}: a photo must be (H, W, {task.in_channels}), got shape {array.shape}")
    if study.kind == "volume" and array.ndim != 3:
        raise DataError(f"{where}: a volume must be (X, Y, Z), got shape {array.shape}")
    if array.size == 0:
        raise DataError(f"{where}: the image is empty (shape {array.shape})")


def study_images(task: TaskSpec, study: Study) -> np.ndarray:
    """The ``float32 (N, C, H, W)`` images the networks see: the photo, or the axial slices."""
    if study.kind == "photo":
        return normalise_rgb(np.asarray(study.array, dtype=np.uint8))[None]
    return volume_to_slices(normalise_volume(np.asarray(study.array)))


def _force_index(force_model: str | int | None, model_names: list[str]) -> int | None:
    if force_model is None:
        return None
    if isinstance(force_model, str):
        if force_model not in model_names:
            raise ConfigError(f"force_model {force_model!r} is not a model of this bundle; choose one of "
                              f"{', '.join(model_names)}")
        return model_names.index(force_model)
    if isinstance(force_model, bool) or not isinstance(force_model, (int, np.integer)) or not (
        0 <= int(force_model) < len(model_names)
    ):
        raise ConfigError(
            f"force_model must be a model name ({', '.join(model_names)}) or index 0..{len(model_names) - 1}, "
            f"got {force_model!r}"
        )
    return int(force_model)


def _records(prediction: Prediction, model_names: list[str], prob_names: list[str]) -> tuple[ImageRecord, ...]:
    records = []
    for i, probs in enumerate(prediction.probabilities):
        order = np.argsort(-probs, kind="stable")
        records.append(
            ImageRecord(
                index=i,
                model=model_names[int(prediction.routed[i])],
                confidence=float(prediction.confidence[i]),
                probabilities={name: float(p) for name, p in zip(prob_names, probs, strict=True)},
                runner_up=prob_names[int(order[1])] if len(order) > 1 else None,
                reason=prediction.reasons[i] if i < len(prediction.reasons) else "",
            )
        )
    return tuple(records)


def _disc_box(study: Study, meta: BundleMetadata | Any) -> CropBox | None:
    """The disc-centred crop a photo gets under the bundle's ``extra["fundus_crop"]`` (``None``: whole photo).

    Metadata without ``extra`` (a split bundle's view) means no crop.
    """
    extra = getattr(meta, "extra", None)
    mode = extra.get("fundus_crop", "none") if isinstance(extra, dict) else "none"
    if study.kind != "photo" or mode not in CROP_MODES:
        return None
    return disc_box(np.asarray(study.array, dtype=np.uint8), mode)


def segment_with(
    loaded: LoadedBundle,
    study: Study,
    gamma: float | None = None,
    force_model: str | int | None = None,
    batch_size: int = 16,
    progress: ProgressCallback | None = None,
    cancel: CancelCheck | None = None,
) -> StudySegmentation:
    """:func:`segment_study` with an already loaded predictor (see :func:`load_predictor`)."""
    predictor = loaded.predictor
    meta = predictor.metadata
    task = get_task(meta.task)
    check_study_fits(study, task, f"the bundle {loaded.name}")
    model_names = list(meta.model_names)
    forced = _force_index(force_model, model_names)
    used_gamma = routing_gamma(meta.gamma, gamma) if meta.routing == "gamma" else None
    if gamma is not None and meta.routing != "gamma":
        check_gamma(gamma)  # still refuse nonsense, even where argmax routing ignores it

    images = study_images(task, study)
    box = _disc_box(study, meta)
    if box is not None:  # the bundle was trained on disc-centred crops of full photos (engine.data.disc_crop)
        images = np.ascontiguousarray(images[(slice(None), slice(None), *box.slices())])
    prediction = predictor.predict(
        images, gamma=gamma, batch_size=batch_size, force_model=forced,
        progress=progress, cancel=cancel, cases=np.zeros(len(images), dtype=np.int64),  # a study is one case
    )
    if study.kind == "photo":
        masks = prediction.masks[0]
        if task.name == "fundus":
            masks = clean_fundus_masks(masks)  # largest component, holes filled, cup inside the disc
        label = masks_to_label_map(task, masks)
        if box is not None:  # the crop's mask back into a full-size map, background outside the crop
            full = np.zeros(np.asarray(study.array).shape[:2], dtype=label.dtype)
            full[box.slices()] = label
            label = full
    else:
        # (Z, L, X, Y) -> (L, Z, X, Y) -> (Z, X, Y) -> (X, Y, Z)
        label = slices_to_volume(masks_to_label_map(task, prediction.masks.transpose(1, 0, 2, 3)))
    prob_names = model_names if meta.routing in ("argmax", "none") else list(meta.site_names)
    return StudySegmentation(
        labels=LabelMap(array=label, names=label_names(task)),
        records=_records(prediction, model_names, prob_names),
        model_names=tuple(model_names),
        device=str(predictor.device),
        gamma=used_gamma,
        bundle_sha256=loaded.sha256,
        bundle_name=loaded.name,
        task=meta.task,
        method=meta.method,
        routing=meta.routing,
        forced_model=None if forced is None else model_names[forced],
    )


def segment_study(
    bundle_path: PathLike,
    study: Study,
    gamma: float | None = None,
    device: str = "auto",
    force_model: str | int | None = None,
    batch_size: int = 16,
    progress: ProgressCallback | None = None,
    cancel: CancelCheck | None = None,
) -> StudySegmentation:
    """Segment a photo or a volume with a super-model bundle.

    Parameters
    ----------
    bundle_path
        The super-model ``.safetensors`` file (loaded once per device, then cached).
    study
        A photo for a fundus bundle, a volume for a prostate bundle.
    gamma
        Routing threshold in [0, 1]; ``None`` uses the bundle's. Ignored (but checked) by
        FedSM-extra bundles, which route by argmax.
    device
        ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:<i>"``.
    force_model
        Send every image to this model instead of routing: ``"global"``, a site name, or its
        index (0 global, k site k). The selector still runs, so records keep its probabilities.
    batch_size
        Images or slices per forward pass.
    progress
        ``(done, total)`` image-steps after every batch; each image counts once for the selector
        and once for its U-Net, so ``total = 2 * study.num_slices``.
    cancel
        Checked before every batch; :class:`~engine.errors.CancelledError` when it returns True.

    Returns
    -------
    StudySegmentation
        Labels aligned with the study, a record per image or slice, and :meth:`~StudySegmentation.provenance`.

    Raises
    ------
    DataError
        When the study is not the kind of image the bundle segments.
    ConfigError
        Bad gamma, batch size or forced model.
    BundleError, DeviceError
        When the bundle or the device cannot be used.
    CancelledError
        When ``cancel`` returned True.
    """
    loaded = load_predictor(bundle_path, device)
    return segment_with(loaded, study, gamma=gamma, force_model=force_model, batch_size=batch_size,
                        progress=progress, cancel=cancel)
