"""Per-case reductions: the slices of one volume share a case id, a photo is a case of one image.

A bundle whose site-style gate judges cases routes a volume whole (the gate, the nearest site and the
selector's choice are decided once per volume: :meth:`engine.inference.predictor.SuperModelPredictor.
decides_volumes`); the sites measure the routing rules on their validation cases the same way
(:mod:`engine.fl.routing_choice`, :mod:`engine.fl.selector_gamma`). These helpers are the one place
"each image gets its case's value" is computed.
"""

from __future__ import annotations

import numpy as np

from engine.errors import ConfigError


def case_index(cases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each image's case position (in ``np.unique(cases)`` order) and each case's image count."""
    c = np.asarray(cases)
    if c.ndim != 1:
        raise ConfigError(f"case ids must be one per image (1-D), got shape {c.shape}")
    _, index, counts = np.unique(c, return_inverse=True, return_counts=True)
    return index.reshape(-1), counts


def case_sizes(cases: np.ndarray) -> np.ndarray:
    """How many images each image's case holds, ``int64 (N,)``."""
    index, counts = case_index(cases)
    return counts[index].astype(np.int64)


def case_means(values: np.ndarray, cases: np.ndarray) -> np.ndarray:
    """Mean of each case's rows, one row per case in ``np.unique(cases)`` order (float64)."""
    index, counts = case_index(cases)
    return _means(values, index, counts)


def case_mean_rows(values: np.ndarray, cases: np.ndarray) -> np.ndarray:
    """Each row replaced by the mean of its case's rows, float64 with ``values``' shape.

    Parameters
    ----------
    values
        ``(N, ...)`` one row per image.
    cases
        ``(N,)`` case id per image; ids need not be sorted or contiguous.
    """
    index, counts = case_index(cases)
    return _means(values, index, counts)[index]


def _means(values: np.ndarray, index: np.ndarray, counts: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if len(v) != len(index):
        raise ConfigError(f"{len(v)} rows but {len(index)} case ids")
    sums = np.zeros((len(counts), *v.shape[1:]), dtype=np.float64)
    np.add.at(sums, index, v)
    return sums / counts.reshape(-1, *([1] * (v.ndim - 1)))
