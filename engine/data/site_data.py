"""A site's datalist loaded into arrays, ready for training and evaluation.

Images and masks are read by the engine's study readers (:func:`engine.io.readers.open_study`,
:func:`engine.io.masks.read_mask`), the path the viewer and inference take too, so a volume is in
the same RAS+ canonical order here as when it is segmented, and a mask must lie on its image's
grid. Mask values are mapped by the datalist's label convention (``"label_convention"``, default
per task; see :mod:`engine.io.label_conventions`). Every image then goes through
:mod:`engine.data.preprocess`, the same path inference takes, so a network sees identically
scaled inputs in training and in use:

- fundus: RGB photo -> ``rgb/255`` -> bilinear resize; label map (ORIGA style after the
  convention) -> disc, cup masks -> nearest resize;
- prostate: volume -> 1st..99th percentile scaling (per volume) -> every axial slice (empty ones
  too, so the networks learn to predict nothing there) -> bilinear resize; label volume likewise
  with nearest resize.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.datalist import load_datalist_with_info
from engine.data.disc_crop import disc_box
from engine.data.preprocess import (
    normalise_rgb,
    normalise_volume,
    read_task_channels,
    resize_images,
    resize_masks,
    volume_to_slices,
)
from engine.errors import ConfigError, DataError
from engine.io.label_conventions import DATALIST_KEY, LabelConvention, convention_for
from engine.io.readers import open_study
from engine.tasks import TaskSpec

#: Datalist section that fills each split.
SPLIT_SECTIONS: dict[str, str] = {"train": "training", "validation": "validation", "test": "testing"}


@dataclass
class SplitArrays:
    """The 2D samples of one split.

    Attributes
    ----------
    images
        ``float32 (N, C, S, S)``, normalised as the task says (see :mod:`engine.data.preprocess`).
    masks
        ``float32 (N, L, S, S)`` binary masks, ``L = task.out_channels``.
    case_ids
        ``int64 (N,)``: index of the case inside this split; all slices of a volume share it.
    """

    images: np.ndarray
    masks: np.ndarray
    case_ids: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.images)
        if len(self.masks) != n or len(self.case_ids) != n:
            raise ValueError(f"images, masks and case_ids must have the same length, got {n}, "
                             f"{len(self.masks)} and {len(self.case_ids)}")

    def __len__(self) -> int:
        return len(self.images)

    @property
    def num_cases(self) -> int:
        """Number of distinct cases (photos or volumes) in the split."""
        return len(np.unique(self.case_ids))

    @classmethod
    def empty(cls, channels: int, labels: int, size: int) -> SplitArrays:
        """A split with no samples but the right trailing shapes."""
        return cls(np.zeros((0, channels, size, size), np.float32),
                   np.zeros((0, labels, size, size), np.float32), np.zeros((0,), np.int64))


@dataclass
class SiteData:
    """One site's training, validation and test samples.

    Attributes
    ----------
    name
        The site's name (datalist ``"name"``, else its folder name).
    train, validation, test
        The datalist's ``training``, ``validation`` and ``testing`` sections as arrays.
    datalist
        The datalist file the site was loaded from.
    """

    name: str
    train: SplitArrays
    validation: SplitArrays
    test: SplitArrays
    datalist: Path | None = None

    @property
    def num_train(self) -> int:
        """Number of 2D training samples (slices for prostate): the site's FedAvg weight."""
        return len(self.train.images)


def _read_case(task: TaskSpec, image_path: Path, label_path: Path, convention: LabelConvention | None
               ) -> tuple[np.ndarray, np.ndarray]:
    """The study's array and its mask as the task's channels ``(L, *shape)`` for one datalist entry."""
    study = open_study(image_path)
    wanted = "volume" if task.volumetric else "photo"
    if study.kind != wanted:
        raise DataError(f"{image_path}: is a {study.kind}, but {task.name} images are {wanted}s; choose the "
                        f"{task.name} datalist or the other task")
    return study.array, read_task_channels(task, label_path, study, convention)


def _load_fundus_case(task: TaskSpec, image_path: Path, label_path: Path, size: int,
                      convention: LabelConvention | None = None, fundus_crop: str = "none"
                      ) -> tuple[np.ndarray, np.ndarray]:
    image, channels = _read_case(task, image_path, label_path, convention)
    box = disc_box(image, fundus_crop)  # full photos -> the disc-centred crop (engine.data.disc_crop)
    if box is not None:
        rows, cols = box.slices()
        image, channels = image[rows, cols], channels[:, rows, cols]
    images = resize_images(normalise_rgb(image)[None], size)
    masks = resize_masks(channels[None], size)
    return images, masks


def _load_volume_case(task: TaskSpec, image_path: Path, label_path: Path, size: int,
                      convention: LabelConvention | None = None) -> tuple[np.ndarray, np.ndarray]:
    volume, channels = _read_case(task, image_path, label_path, convention)
    images = resize_images(volume_to_slices(normalise_volume(volume)), size)
    # channels are (L, X, Y, Z); slices first: (Z, L, X, Y).
    masks = resize_masks(np.ascontiguousarray(np.moveaxis(channels, 3, 0)), size)
    return images, masks


def _hw(shape: tuple[int, ...]) -> str:
    return f"{shape[1]}x{shape[0]}"


def load_split(entries: list[dict[str, Any]], task: TaskSpec, image_size: int,
               progress: Callable[[int, int], None] | None = None,
               convention: LabelConvention | None = None, fundus_crop: str = "none") -> SplitArrays:
    """Load one datalist section's cases into :class:`SplitArrays`.

    Parameters
    ----------
    entries
        Entries as :func:`engine.data.datalist.load_datalist` returns them (absolute paths).
    task
        The task: decides readers, normalisation and label channels.
    image_size
        Side ``S`` of the square arrays.
    progress
        Called with ``(cases done, cases)`` after each case.
    convention
        How the masks store their labels; ``None``: the task's default convention.
    fundus_crop
        ``"auto"``: full fundus photographs are cropped around the optic disc first
        (:mod:`engine.data.disc_crop`); ``"none"``: photos are used whole.
    """
    images, masks, ids = [], [], []
    for i, entry in enumerate(entries):
        if task.volumetric:
            img, msk = _load_volume_case(task, Path(entry["image"]), Path(entry["label"]), image_size, convention)
        else:
            img, msk = _load_fundus_case(task, Path(entry["image"]), Path(entry["label"]), image_size, convention,
                                         fundus_crop)
        images.append(img.astype(np.float32, copy=False))
        masks.append((msk > 0.5).astype(np.float32))
        ids.append(np.full(len(img), i, dtype=np.int64))
        if progress is not None:
            progress(i + 1, len(entries))
    if not images:
        return SplitArrays.empty(task.in_channels, task.out_channels, image_size)
    return SplitArrays(np.concatenate(images), np.concatenate(masks), np.concatenate(ids))


def load_site(datalist_path: str | os.PathLike[str], task: TaskSpec, image_size: int,
              name: str | None = None, fundus_crop: str = "none") -> SiteData:
    """Load a site's datalist into arrays.

    Parameters
    ----------
    datalist_path
        The site's datalist JSON (paths relative to it).
    task
        The task the site's data is for; a datalist whose ``"task"`` key names another task is refused.
    image_size
        Side ``S`` every image and mask is resized to.
    name
        Site name; defaults to the datalist's ``"name"``, else the datalist's folder name.
    fundus_crop
        ``"auto"``: crop full fundus photographs around the optic disc (:mod:`engine.data.disc_crop`).

    Returns
    -------
    SiteData
        Missing ``"validation"``/``"testing"`` sections give empty splits of shape ``(0, C, S, S)``.

    Raises
    ------
    ConfigError
        When ``image_size`` is not a positive integer.
    DataError
        When the datalist is broken, has no training cases, is for another task or names a label
        convention that does not suit it, a file is missing or unreadable, a mask does not match
        its image's geometry or its values are not the convention's.
    """
    if isinstance(image_size, bool) or not isinstance(image_size, int | np.integer) or image_size < 1:
        raise ConfigError(f"image_size must be a positive integer, got {image_size!r}")
    path = Path(datalist_path)
    sections, info = load_datalist_with_info(path)
    stated = info.get("task")
    if isinstance(stated, str) and stated != task.name:
        raise DataError(f"{path}: this datalist is for task {stated!r}, not {task.name!r}; choose the "
                        f"{task.name} datalist or the {stated} task")
    if not sections.get("training"):
        raise DataError(f"{path}: the 'training' section is empty; list at least one image and label")
    if name is None:
        stated_name = info.get("name")
        name = stated_name if isinstance(stated_name, str) and stated_name else path.absolute().parent.name
    try:
        convention = convention_for(task.name, info.get(DATALIST_KEY))
    except ConfigError as exc:
        raise DataError(f"{path}: {exc}") from exc
    splits = {attr: load_split(sections.get(section, []), task, int(image_size), convention=convention,
                               fundus_crop=fundus_crop)
              for attr, section in SPLIT_SECTIONS.items()}
    return SiteData(name, splits["train"], splits["validation"], splits["test"], datalist=path.absolute())
