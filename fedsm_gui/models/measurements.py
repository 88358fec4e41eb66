"""Clinical measurements from masks (Qt-free)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

#: Names a fundus label map uses for the optic disc (the rim is the disc minus the cup).
_DISC_NAMES = {"disc", "optic disc", "rim", "disc rim", "od"}
_CUP_NAMES = {"cup", "optic cup", "oc"}


def _values(names: Mapping[int, str], wanted: set[str]) -> list[int]:
    return [int(v) for v, n in names.items() if n.strip().lower() in wanted]


def vertical_cup_to_disc(labels: np.ndarray, names: Mapping[int, str]) -> float | None:
    """Vertical cup-to-disc ratio of a 2D fundus label map (rows run top to bottom).

    The disc is every pixel labelled disc, rim or cup (the cup lies inside the disc); the ratio
    is the cup's vertical extent over the disc's, in pixels, as graders measure it on the
    photo. Returns ``None`` when the map has no disc or cup labels or no disc pixels.
    """
    cup_values = _values(names, _CUP_NAMES)
    disc_values = _values(names, _DISC_NAMES) + cup_values
    if not cup_values or len(disc_values) == len(cup_values) or labels.ndim != 2:
        return None
    disc_rows = np.flatnonzero(np.isin(labels, disc_values).any(axis=1))
    if disc_rows.size == 0:
        return None
    cup_rows = np.flatnonzero(np.isin(labels, cup_values).any(axis=1))
    if cup_rows.size == 0:
        return 0.0
    return float(cup_rows[-1] - cup_rows[0] + 1) / float(disc_rows[-1] - disc_rows[0] + 1)
