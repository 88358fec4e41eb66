"""Label conventions: how a dataset stores its masks, and how they become the engine's label maps.

Real datasets disagree on what a mask file holds; a convention names one way and maps it to the
engine's own label maps, the form training (:mod:`engine.data.site_data`), validation
(:mod:`engine.data.validation`) and the viewer share:

==============  =====================================================  ==========================
name            files and values                                        engine label map
==============  =====================================================  ==========================
``origa``       one map: 0 background, 1 disc rim (disc minus cup),   as stored (fundus:
                2 cup                                                   disc = >= 1, cup = 2)
``drishti``     two soft maps per case, ``*_ODsegSoftmap.png`` (disc)   0, 1 rim, 2 cup: each map
                and ``*_cupsegSoftmap.png`` (cup); grey value = share   binarised at >= 128
                of 4 experts: 0, 64, 128, 191, 255                      (majority), cup wins
``binary``      one map, any value > 0 is the structure (0/1, 0/255)    0, 1
``multilabel``  one map of integer labels 0..255                        as stored (prostate: the
                                                                        union of labels > 0)
==============  =====================================================  ==========================

A datalist names its convention with the top-level key ``"label_convention"``; without it the
task's default applies (:data:`DEFAULT_CONVENTION`: ``origa`` for fundus, ``binary`` for
prostate). The label map becomes the task's channels through
:func:`engine.data.preprocess.label_channels` (fundus: disc = ``>= 1``, cup = ``== 2``;
prostate: ``> 0``), the one place that mapping lives.

Only numpy is imported at module level; reading files is :mod:`engine.io.masks`' job, which
:func:`engine.data.preprocess.read_task_channels` calls with a convention from here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import ConfigError, DataError

if TYPE_CHECKING:
    pass

PathLike = str | os.PathLike[str]

#: Names fundus label maps give their values (ORIGA style), shared by origa and drishti.
FUNDUS_NAMES: dict[int, str] = {1: "rim", 2: "cup"}
#: Drishti-GS soft maps: grey value = 255 * (experts who marked the pixel) / 4.
DRISHTI_VALUES = frozenset({0, 64, 128, 191, 255})
#: Drishti-GS majority threshold: at least 2 of 4 experts.
DRISHTI_THRESHOLD = 128
_DRISHTI_DISC = re.compile(r"ODsegSoftmap", re.IGNORECASE)
_DRISHTI_CUP = re.compile(r"cupsegSoftmap", re.IGNORECASE)


@dataclass(frozen=True)
class LabelConvention:
    """One way of storing masks (see the module docstring for the four known ones).

    Attributes
    ----------
    name
        ``"origa"``, ``"drishti"``, ``"binary"`` or ``"multilabel"``.
    summary
        One line for messages and ``--help``.
    tasks
        Tasks whose masks may use this convention.
    expected_values
        Raw values a mask file may hold; ``None``: any integer 0..255.
    strict
        Whether a value outside ``expected_values`` is an error (else a warning: drishti soft maps
        that were resized carry in-between greys and still binarise correctly).
    """

    name: str
    summary: str
    tasks: tuple[str, ...]
    expected_values: frozenset[int] | None
    strict: bool = True

    def label_files(self, label: PathLike) -> tuple[Path, ...]:
        """The file(s) holding one case's mask, given the path a datalist or user names.

        Drishti: the disc map and the cup map beside it, whichever of the two is named.
        """
        p = Path(label)
        if self.name != "drishti":
            return (p,)
        name = p.name
        if _DRISHTI_DISC.search(name):
            return p, p.with_name(_DRISHTI_DISC.sub("cupsegSoftmap", name))
        if _DRISHTI_CUP.search(name):
            return p.with_name(_DRISHTI_CUP.sub("ODsegSoftmap", name)), p
        raise DataError(f"{p}: a drishti label is the disc soft map named like 'case_ODsegSoftmap.png', with "
                        "'case_cupsegSoftmap.png' beside it; name the files so, or choose another convention")

    def unexpected_values(self, values: Sequence[int] | np.ndarray) -> list[int]:
        """Raw values (of one file) this convention does not allow, sorted."""
        present = sorted({int(v) for v in np.asarray(values).ravel()})
        if self.name == "binary":
            nonzero = [v for v in present if v != 0]
            outside = [v for v in present if v < 0]
            return outside or (nonzero if len(nonzero) > 1 else [])
        if self.expected_values is None:
            return [v for v in present if v < 0 or v > 255]
        return [v for v in present if v not in self.expected_values]

    def to_label_map(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """Raw mask array(s), in :meth:`label_files` order, -> the engine's ``uint8`` label map.

        Raises
        ------
        DataError
            When values the map cannot hold are present (checked with :meth:`unexpected_values`
            for strict conventions), or the arrays' shapes differ.
        """
        if len(arrays) != (2 if self.name == "drishti" else 1):
            raise ValueError(f"{self.name} expects {2 if self.name == 'drishti' else 1} array(s), got {len(arrays)}")
        if self.name == "drishti":
            disc, cup = arrays
            if disc.shape != cup.shape:
                raise DataError(f"the drishti disc map is {disc.shape} but the cup map is {cup.shape}; they must "
                                "have the same size")
            label = np.zeros(disc.shape, np.uint8)
            label[disc >= DRISHTI_THRESHOLD] = 1
            label[cup >= DRISHTI_THRESHOLD] = 2
            return label
        raw = arrays[0]
        if self.name == "binary":
            return (raw > 0).astype(np.uint8)
        bad = self.unexpected_values(np.unique(raw))
        if bad:
            allowed = ("integers 0..255" if self.expected_values is None
                       else ", ".join(map(str, sorted(self.expected_values))))
            raise DataError(f"has values {bad[:8]} that the {self.name} convention ({self.summary}) does not use "
                            f"(allowed: {allowed}); map the mask's values, or choose the convention the dataset uses")
        return raw.astype(np.uint8)

    def names(self, label_map: np.ndarray) -> dict[int, str]:
        """Label value -> structure name for a map this convention produced."""
        if self.name in ("origa", "drishti"):
            return dict(FUNDUS_NAMES)
        if self.name == "binary":
            return {1: "foreground"}
        return {int(v): f"label {int(v)}" for v in np.unique(label_map) if v != 0}


def convention_from_name(path: PathLike) -> str | None:
    """The convention a mask file's name identifies (Drishti-GS soft maps), else ``None``."""
    name = Path(path).name
    return "drishti" if _DRISHTI_DISC.search(name) or _DRISHTI_CUP.search(name) else None


CONVENTIONS: dict[str, LabelConvention] = {c.name: c for c in (
    LabelConvention("origa", "ORIGA style, one map: 0 background, 1 disc rim, 2 cup (disc = >=1, cup = 2)",
                    ("fundus",),
                    frozenset({0, 1, 2})),
    LabelConvention("drishti", "two soft maps per case (*_ODsegSoftmap, *_cupsegSoftmap), majority >= 128",
                    ("fundus",), DRISHTI_VALUES, strict=False),
    LabelConvention("binary", "one map, any value > 0 is the structure", ("prostate",), None),
    LabelConvention("multilabel", "one map of integer labels 0..255, kept as they are", ("prostate",), None),
)}
#: The convention a task's datalist uses when it names none.
DEFAULT_CONVENTION: dict[str, str] = {"fundus": "origa", "prostate": "binary"}
#: Datalist top-level key naming the convention.
DATALIST_KEY = "label_convention"


def get_convention(name: str) -> LabelConvention:
    """The convention called ``name``; :class:`ConfigError` listing the known ones otherwise."""
    try:
        return CONVENTIONS[str(name).strip().lower()]
    except KeyError:
        raise ConfigError(f"unknown label convention {name!r}; choose one of: {', '.join(CONVENTIONS)}") from None


def convention_for(task: str | None, stated: object = None, override: str | None = None) -> LabelConvention:
    """The convention that applies: ``override`` (e.g. ``--convention``), else the datalist's, else the task's.

    Raises
    ------
    ConfigError
        When the name is unknown, or the convention does not suit ``task``.
    """
    if override:
        name = override
    elif isinstance(stated, str) and stated.strip():
        name = stated
    elif task in DEFAULT_CONVENTION:
        name = DEFAULT_CONVENTION[task]  # type: ignore[index]
    else:
        name = "multilabel"
    convention = get_convention(name)
    if task is not None and task not in convention.tasks:
        suits = [c.name for c in CONVENTIONS.values() if task in c.tasks]
        raise ConfigError(f"label convention {convention.name!r} does not suit the {task} task (it gives "
                          f"{'disc and cup' if task == 'fundus' else 'one structure'}); use one of: {', '.join(suits)}")
    return convention
