"""Which model segments each image: the FedSM routing rules, as pure numpy functions.

Convention everywhere: routed model index 0 is the global model, index ``k`` (1..K) is the
personalized model of site ``k`` (``site_names[k - 1]``).
"""

from __future__ import annotations

import math

import numpy as np

from engine.errors import ConfigError
from engine.fl.cases import case_mean_rows


def _check_probs(probs: np.ndarray, min_classes: int, what: str) -> np.ndarray:
    p = np.asarray(probs)
    if p.ndim != 2 or p.shape[1] < min_classes:
        raise ConfigError(
            f"selector probabilities must have shape (N, {what}) with at least {min_classes} "
            f"column(s), got {p.shape}"
        )
    if not np.issubdtype(p.dtype, np.floating):
        raise ConfigError(f"selector probabilities must be floating point, got {p.dtype}")
    return p


def check_gamma(gamma: object) -> float:
    """Return ``gamma`` as a float if it is a finite number in [0, 1], else raise :class:`ConfigError`."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float, np.integer, np.floating)):
        raise ConfigError(f"gamma must be a number in [0, 1], got {gamma!r}")
    value = float(gamma)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"gamma must be in [0, 1], got {gamma}; 0.5 is a usual starting point")
    return value


def routing_gamma(bundle_gamma: float, gamma: object = None) -> float:
    """The gamma a run routes with: ``gamma`` when the user gave one (checked), else the bundle's.

    The one place the default is resolved: the predictor, a study's segmentation and a file run's record
    all call this.
    """
    return float(bundle_gamma) if gamma is None else check_gamma(gamma)


def confidence(probs: np.ndarray) -> np.ndarray:
    """Selector confidence per image: the largest probability, shape ``(N,)``.

    Parameters
    ----------
    probs
        ``(N, C)`` softmax outputs of the selector (C = K or K + 1).
    """
    p = _check_probs(probs, 1, "C")
    if p.shape[0] == 0:
        return np.zeros(0, dtype=p.dtype)
    return p.max(axis=1)


def case_mean_probabilities(probs: np.ndarray, cases: np.ndarray) -> np.ndarray:
    """Each image's row replaced by its case's mean selector probabilities, shape ``(N, C)``.

    A volume is routed whole (its slices decided as one, by their mean): one model segments every
    slice, so a 3-D mask is never stitched from two models' slices, and averaging a volume's slices
    takes out the slice-to-slice noise of the selector. Photos are cases of one image and keep
    their own rows.

    Parameters
    ----------
    probs
        ``(N, C)`` selector softmax.
    cases
        ``(N,)`` case id per image (the slices of one volume share one).
    """
    p = _check_probs(probs, 1, "C")
    c = np.asarray(cases)
    if c.shape != (p.shape[0],):
        raise ConfigError(f"{p.shape[0]} selector rows but case ids of shape {c.shape}")
    return case_mean_rows(p, c).astype(p.dtype)


def route_fedsm(probs: np.ndarray, gamma: float) -> np.ndarray:
    """FedSM routing (paper, Algorithm 2).

    The personalized model of the most likely site is used only when the selector is sure
    enough: ``max(p) > gamma`` (strictly); otherwise the global model, which generalises
    better to images that look like no single site.

    Parameters
    ----------
    probs
        ``(N, K)`` selector softmax over the K sites.
    gamma
        Threshold in [0, 1]. ``gamma = 1`` always picks the global model; ``gamma = 0`` picks
        a personalized model unless the selector gives it probability exactly 0.

    Returns
    -------
    numpy.ndarray
        ``int64 (N,)`` routed model index: ``argmax(p) + 1`` or 0.
    """
    p = _check_probs(probs, 1, "K")
    threshold = check_gamma(gamma)
    if p.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    best = p.argmax(axis=1).astype(np.int64)
    sure = p.max(axis=1) > threshold
    return np.where(sure, best + 1, 0).astype(np.int64)


def route_fedsm_extra(probs: np.ndarray) -> np.ndarray:
    """FedSM-extra routing (paper, Algorithm 4): plain argmax over the K + 1 models.

    Parameters
    ----------
    probs
        ``(N, K + 1)`` selector softmax; column 0 is the global model, column ``k`` site ``k``'s
        personalized model.

    Returns
    -------
    numpy.ndarray
        ``int64 (N,)`` routed model index (ties go to the lower index, i.e. towards global).
    """
    p = _check_probs(probs, 2, "K + 1")
    if p.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    return p.argmax(axis=1).astype(np.int64)
