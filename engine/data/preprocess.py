"""Intensity scaling, label mapping and resizing shared by training and inference.

Training and inference must see images scaled the same way; both go through this module and
bundles record the task's normalisation name (see :mod:`engine.tasks`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from engine.io.label_conventions import convention_for
from engine.io.masks import read_mask
from engine.tasks import TaskSpec

if TYPE_CHECKING:
    from engine.io.label_conventions import LabelConvention
    from engine.io.study import Study


def normalise_rgb(image: np.ndarray) -> np.ndarray:
    """``uint8 (H, W, 3)`` photo -> ``float32 (3, H, W)`` in [0, 1] (normalisation ``rgb/255``)."""
    return np.ascontiguousarray(image.transpose(2, 0, 1), dtype=np.float32) / 255.0


def normalise_volume(volume: np.ndarray) -> np.ndarray:
    """Scale a volume's 1st..99th intensity percentiles to [0, 1], clipped.

    Percentiles, not min/max, so a few hot voxels do not squash the tissue contrast; the
    same rule holds at every site, which keeps the sites' true scanner differences visible.
    """
    lo, hi = np.percentile(volume, (1.0, 99.0))
    scale = float(hi - lo) if hi > lo else 1.0
    return np.clip((volume.astype(np.float32) - lo) / scale, 0.0, 1.0)


def volume_to_slices(volume: np.ndarray) -> np.ndarray:
    """``(X, Y, Z)`` volume -> ``(Z, 1, X, Y)`` stack of axial slices."""
    return np.ascontiguousarray(np.moveaxis(volume, 2, 0)[:, None])


def slices_to_volume(slices: np.ndarray) -> np.ndarray:
    """``(Z, X, Y)`` stack of slices -> ``(X, Y, Z)`` volume (inverse of the slicing)."""
    return np.ascontiguousarray(np.moveaxis(slices, 0, 2))


def fundus_label_channels(label_map: np.ndarray) -> np.ndarray:
    """ORIGA-style map (0 background, 1 rim, 2 cup) -> ``float32 (2, H, W)`` disc, cup masks."""
    return np.stack([label_map >= 1, label_map == 2]).astype(np.float32)


def fundus_channels_to_label(masks: np.ndarray) -> np.ndarray:
    """Binary ``(2, H, W)`` disc, cup masks -> ORIGA-style ``uint8`` map (cup wins over disc)."""
    label = np.zeros(masks.shape[1:], dtype=np.uint8)
    label[masks[0] > 0] = 1
    label[masks[1] > 0] = 2
    return label


def label_channels(task: TaskSpec, label_map: np.ndarray) -> np.ndarray:
    """Map a stored label map to the task's ``(out_channels, ...)`` binary masks."""
    if task.name == "fundus":
        return fundus_label_channels(label_map)
    return (label_map > 0).astype(np.float32)[None]


def resize_images(batch: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of ``(N, C, H, W)`` float images to ``(N, C, size, size)``."""
    if batch.shape[-2:] == (size, size):
        return batch
    with torch.no_grad():
        t = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32))
        out = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    return out.numpy()


def resize_masks(batch: np.ndarray, size: int) -> np.ndarray:
    """Nearest-neighbour resize of ``(N, C, H, W)`` binary masks to ``(N, C, size, size)``."""
    if batch.shape[-2:] == (size, size):
        return batch
    with torch.no_grad():
        t = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32))
        out = F.interpolate(t, size=(size, size), mode="nearest")
    return out.numpy()


def read_task_channels(task: TaskSpec, label: str | os.PathLike[str], study: Study,
                       convention: LabelConvention | None = None) -> np.ndarray:
    """A case's mask file(s), read onto its study through a convention, as the task's binary channels.

    Returns
    -------
    numpy.ndarray
        ``float32 (task.out_channels, *study.shape)`` (fundus: disc, cup; prostate: gland).

    Raises
    ------
    DataError
        When the mask is missing, unreadable, off the study's grid (partial masks included) or
        holds values the convention does not use.
    """
    conv = convention if convention is not None else convention_for(task.name)
    labels = read_mask(label, study, conv, allow_partial=False).labels.array
    return label_channels(task, labels)

