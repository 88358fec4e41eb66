"""Clean a network's masks the way the field does before anyone reads them.

A segmentation network's raw output has stray specks, holes and, for nested structures, parts
of the inner structure outside the outer one. Optic disc and cup pipelines (REFUGE entries,
the ORIGA/Drishti literature) and nnU-Net's post-processing keep the largest connected
component of each structure, fill its holes and clip the cup to the disc; the cup-to-disc ratio
is then measured on the cleaned masks (:mod:`engine.inference.cup_disc`).
:func:`clean_fundus_masks` does that for the fundus task; :func:`largest_component` and
:func:`fill_holes` work on one binary mask.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest face-connected component of a binary mask (2D or 3D), ``bool``.

    Ties go to the component found first in array order; an empty mask stays empty.
    """
    binary = np.asarray(mask) > 0
    labels, count = ndimage.label(binary)
    if count <= 1:
        return binary
    sizes = np.bincount(labels.ravel())
    sizes[0] = 0
    return labels == int(np.argmax(sizes))


def fill_holes(mask: np.ndarray) -> np.ndarray:
    """``mask`` with every background region that does not touch the border filled, ``bool``."""
    return np.asarray(ndimage.binary_fill_holes(np.asarray(mask) > 0), dtype=bool)


def clean_fundus_masks(masks: np.ndarray) -> np.ndarray:
    """Clean binary ``(2, H, W)`` disc and cup masks (the cup is part of the disc).

    The disc becomes its largest connected component with holes filled; the cup is first
    clipped to that disc, then reduced to its largest component with holes filled. Returns
    ``uint8`` masks of the same shape.
    """
    masks = np.asarray(masks)
    if masks.ndim != 3 or masks.shape[0] != 2:
        raise ValueError(f"fundus masks must be (2, H, W) disc and cup, got shape {masks.shape}")
    disc = fill_holes(largest_component(masks[0]))
    cup = fill_holes(largest_component(np.logical_and(masks[1] > 0, disc)))
    return np.stack([disc, cup]).astype(np.uint8)

