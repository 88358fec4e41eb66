"""Minimal readers and writers for the files the engine trains and infers on.

Fundus photos and label maps are PNG (photos may also be JPG/TIFF/BMP); prostate volumes and
label volumes are NIfTI. Arrays use one convention everywhere:

- RGB photo: ``uint8`` array ``(H, W, 3)``.
- 2D label map: ``uint8`` array ``(H, W)``.
- Volume: array ``(X, Y, Z)`` as nibabel returns it (voxel axes of the file) plus its 4x4
  affine; axial slices are ``volume[:, :, z]``.

Every failure is a :class:`engine.errors.DataError` naming the file and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from engine.errors import DataError
from engine.io.atomic import atomic_path
from engine.io.guard import open_image
from engine.io.volumes import read_nifti_volume

PathLike = str | os.PathLike[str]


def _existing(path: PathLike) -> Path:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: file not found; check the path (it is resolved relative to the datalist)")
    return p


def read_rgb_image(path: PathLike) -> np.ndarray:
    """Read a colour photo as ``uint8 (H, W, 3)``; greyscale or RGBA files are converted."""
    p = _existing(path)
    with open_image(p, "image") as img:
        rgb = img.convert("RGB")
        return np.asarray(rgb, dtype=np.uint8).copy()


def read_label_png(path: PathLike) -> np.ndarray:
    """Read a single-channel label map as ``uint8 (H, W)``.

    Raises
    ------
    DataError
        When the file is not an image, is not single-channel, is damaged, or declares more than
        :data:`engine.io.guard.MAX_PIXELS` pixels (checked before decoding).
    """
    p = _existing(path)
    with open_image(p, "label image") as img:
        if img.mode not in ("L", "P", "1"):
            raise DataError(
                f"{p}: a label map must be a single-channel 8-bit PNG, this one is mode "
                f"{img.mode!r}; save it as 8-bit greyscale with one value per label"
            )
        return np.asarray(img, dtype=np.uint8).copy()


def write_rgb_png(path: PathLike, image: np.ndarray) -> None:
    """Write a ``uint8 (H, W, 3)`` photo as PNG, atomically."""
    from PIL import Image

    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected uint8 (H, W, 3), got {image.dtype} {image.shape}")
    with atomic_path(path) as tmp:
        Image.fromarray(image, mode="RGB").save(tmp, format="PNG")


def write_label_png(path: PathLike, labels: np.ndarray) -> None:
    """Write a ``uint8 (H, W)`` label map as 8-bit greyscale PNG, atomically."""
    from PIL import Image

    if labels.ndim != 2:
        raise ValueError(f"expected a 2D label map, got shape {labels.shape}")
    with atomic_path(path) as tmp:
        Image.fromarray(labels.astype(np.uint8), mode="L").save(tmp, format="PNG")


def read_nifti(path: PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Read a 3D NIfTI volume through :func:`engine.io.volumes.read_nifti_volume`.

    Returns
    -------
    volume, affine
        ``float32 (X, Y, Z)`` voxel array in the file's voxel order (scaling applied; a 2D image
        has ``Z = 1``) and its ``(4, 4)`` affine.

    Raises
    ------
    DataError
        When the file is missing, damaged or truncated (a ``.nii.gz``'s gzip CRC is checked), or
        not one scalar 2D/3D volume.
    """
    data, affine, _ = read_nifti_volume(_existing(path))
    return data, affine


def write_nifti(path: PathLike, volume: np.ndarray, affine: np.ndarray) -> None:
    """Write ``volume`` with ``affine`` as NIfTI (gzip when the name ends ``.gz``), atomically."""
    import nibabel as nib

    img = nib.Nifti1Image(volume, affine)
    if np.issubdtype(volume.dtype, np.integer):
        img.set_data_dtype(volume.dtype)
    with atomic_path(path) as tmp:
        nib.save(img, str(tmp))
