"""The vertical cup-to-disc ratio of a fundus label map, measured on cleaned masks, with a verdict.

The ratio is the cup's vertical extent over the disc's, as graders read it on the photo. It is
measured after :func:`engine.inference.postprocess.clean_fundus_masks` (largest component, holes
filled, cup inside the disc), so a stray speck far from the disc cannot stretch either extent.
:func:`vertical_cup_to_disc` also says when the number should not be trusted: no cup found, a
cup that leaves no rim (the usual sign of a failed segmentation), a disc too small to measure or
cut by the image edge, or a mask from which cleaning had to remove much.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from engine.inference.postprocess import clean_fundus_masks

#: Names a fundus label map uses for the optic disc (the rim is the disc minus the cup).
DISC_NAMES = frozenset({"disc", "optic disc", "rim", "disc rim", "od"})
CUP_NAMES = frozenset({"cup", "optic cup", "oc"})
#: Below this many pixels of disc height the ratio's resolution is worse than 0.1.
MIN_DISC_ROWS = 10
#: A rim thinner than this fraction of the disc's area: the cup fills the disc.
MIN_RIM_FRACTION = 0.05
#: Cleaning that removes more than this fraction of a structure's pixels makes the mask suspect.
MAX_REMOVED_FRACTION = 0.10


@dataclass(frozen=True)
class CupToDisc:
    """A vertical cup-to-disc ratio and whether it can be trusted.

    Attributes
    ----------
    value
        Cup height over disc height (0 when no cup was found).
    trusted
        False when :attr:`reason` names a problem with the masks.
    reason
        Why the value cannot be trusted (``""`` when it can).
    """

    value: float
    trusted: bool
    reason: str = ""


def _values(names: Mapping[int, str], wanted: frozenset[str]) -> list[int]:
    return [int(v) for v, n in names.items() if str(n).strip().lower() in wanted]


def _rows(mask: np.ndarray) -> tuple[int, int]:
    rows = np.flatnonzero(mask.any(axis=1))
    return int(rows[0]), int(rows[-1])


def vertical_cup_to_disc(labels: np.ndarray, names: Mapping[int, str]) -> CupToDisc | None:
    """Vertical cup-to-disc ratio of a 2D fundus label map (rows run top to bottom).

    The disc is every pixel labelled disc, rim or cup. Returns ``None`` when the map is not a
    2D disc/cup map or holds no disc.
    """
    cup_values = _values(names, CUP_NAMES)
    disc_values = _values(names, DISC_NAMES) + cup_values
    labels = np.asarray(labels)
    if not cup_values or len(disc_values) == len(cup_values) or labels.ndim != 2:
        return None
    raw_disc = np.isin(labels, disc_values)
    raw_cup = np.isin(labels, cup_values)
    if not raw_disc.any():
        return None
    disc, cup = (m.astype(bool) for m in clean_fundus_masks(np.stack([raw_disc, raw_cup])))
    top, bottom = _rows(disc)
    disc_rows = bottom - top + 1
    problems = []
    if not cup.any():
        return CupToDisc(0.0, False, "no cup found in the disc")
    cup_top, cup_bottom = _rows(cup)
    value = (cup_bottom - cup_top + 1) / disc_rows
    if disc_rows < MIN_DISC_ROWS:
        problems.append(f"the disc is only {disc_rows} pixels high")
    rim = disc.sum() - cup.sum()
    if rim < MIN_RIM_FRACTION * disc.sum():
        problems.append("the cup fills the disc (no rim left), which suggests a failed segmentation")
    if disc[0].any() or disc[-1].any() or disc[:, 0].any() or disc[:, -1].any():
        problems.append("the disc touches the image edge")
    for what, before, after in (("disc", raw_disc, disc), ("cup", raw_cup, cup)):
        removed = 1.0 - np.logical_and(before, after).sum() / max(int(before.sum()), 1)
        if removed > MAX_REMOVED_FRACTION:
            problems.append(f"{removed:.0%} of the {what} lay outside its main region and was ignored")
    return CupToDisc(float(value), not problems, "; ".join(problems))
