"""A federated, validation-chosen routing threshold for FedSM's selector (``--gamma auto``).

Algorithm 2 sends an image to site k's model when the selector's top probability (for site k)
exceeds gamma, and to the global model otherwise. A fixed gamma means different things for
different selectors: an under-confident selector (short runs) sends few seen images to their
own site's model at gamma 0.6. The out-of-distribution-detection convention (Hendrycks &
Gimpel 2017 and after: "at 95% TPR") is to set the threshold from in-distribution validation
data so that a fixed fraction of it passes. Federated:

- each site scores its VALIDATION images with the trained selector and sends (1) a histogram,
  counts in :data:`GAMMA_BINS` equal bins on [0, 1], of the selector's top probability over the
  images it assigns to their own site, and (2) the count of images it assigns to another site:
  aggregates, no per-image value. When temperature scaling is fitted in the same round, it
  sends one row per grid temperature, so the server can use the row of the temperature it picks;
- the server adds the histograms and picks the largest bin edge ``gamma`` such that at least
  ``pass_fraction`` (default :data:`DEFAULT_PASS_FRACTION`, the convention's 95%) of the
  recognised validation images have top probability >= gamma; it records gamma, the fraction
  and the federation's validation accuracy in the bundle.

Why only recognised images: an image the selector assigns to another site goes to the wrong
model whatever gamma is, so lowering gamma for it only lets more unseen images through; the
images that gamma can send to their own model are the recognised ones. So the share of seen
images reaching their own model is about ``accuracy * pass_fraction``. gamma is never below
``1 / K`` (a top probability always is at least that), and bin edges make the choice
conservative by at most one bin width (1 / :data:`GAMMA_BINS`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from engine.errors import ConfigError, WeightsError
from engine.fl.cases import case_mean_rows
from engine.fl.weights import Weights, all_finite

#: Equal-width bins on [0, 1] of a site's own-site probability histogram (resolution 0.01).
GAMMA_BINS = 100
#: Fraction of participating sites' validation images that must pass the chosen gamma by default.
DEFAULT_PASS_FRACTION = 0.95
#: Keys of a site's statistics in its calibration-round update: the histogram, and the count of
#: validation images the selector assigns to another site.
HISTOGRAM_KEY = "counts"
MISSED_KEY = "missed"


def check_pass_fraction(value: float) -> float:
    """Return ``value`` if it is a fraction in (0, 1], else raise :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < float(value) <= 1.0:
        raise ConfigError(f"gamma pass fraction must be a number in (0, 1], got {value!r} "
                          f"(e.g. {DEFAULT_PASS_FRACTION}: that share of recognised validation images passes gamma)")
    return float(value)


def own_site_histogram(probs: np.ndarray, labels: np.ndarray, bins: int = GAMMA_BINS) -> tuple[np.ndarray, int]:
    """Histogram of the top probability of images assigned to their own site, and the others' count.

    Parameters
    ----------
    probs
        ``(N, K)`` selector probabilities.
    labels
        ``(N,)`` the image's own site index.

    Returns
    -------
    counts, missed
        ``(bins,)`` counts on equal bins of [0, 1] (last bin closed) of ``probs[i].max()`` over
        images with ``argmax == labels[i]``; the number of images with another argmax.
    """
    p = np.asarray(probs, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if p.ndim != 2 or len(p) != len(y):
        raise ConfigError(f"probabilities {p.shape} and labels {y.shape} do not match")
    hit = p.argmax(1) == y if len(y) else np.zeros(0, dtype=bool)
    top = p.max(1)[hit] if len(y) else np.zeros(0)
    # bin j holds top probabilities in [j / bins, (j + 1) / bins), computed as floor(p * bins) so that
    # the edge j / bins itself lands in bin j (np.histogram's float edges put 0.7 in bin 6 of 10)
    which = np.clip(np.floor(np.clip(top, 0.0, 1.0) * bins).astype(np.int64), 0, bins - 1)
    counts = np.bincount(which, minlength=bins)
    return counts.astype(np.float64), int((~hit).sum())


def histogram_statistics(logits: torch.Tensor, labels: np.ndarray, temperatures: Sequence[float] = (1.0,),
                         bins: int = GAMMA_BINS, cases: np.ndarray | None = None) -> Weights:
    """A site's statistics, one row per temperature: ``counts (T, bins)`` and ``missed (T, 1)``, float64.

    ``cases``: each image's case, where the super model routes a volume whole (a gate that judges
    cases): every image then counts with its volume's mean probabilities, as the predictor routes it
    (:func:`engine.fl.cases.case_mean_rows`); ``None``: each image with its own.
    """
    z = logits.to(torch.float64)

    def probabilities(t: float) -> np.ndarray:
        p = torch.softmax(z / t, dim=1).numpy()
        return case_mean_rows(p, cases) if cases is not None and len(p) else p

    rows = [own_site_histogram(probabilities(t), labels, bins) for t in temperatures]
    return {HISTOGRAM_KEY: torch.from_numpy(np.stack([r[0] for r in rows])),
            MISSED_KEY: torch.tensor([[float(r[1])] for r in rows], dtype=torch.float64)}


def check_histogram_statistics(stats: Mapping[str, torch.Tensor], rows: int, what: str,
                               bins: int = GAMMA_BINS) -> None:
    """Reject statistics with wrong keys or shapes, or counts that are not whole numbers >= 0."""
    if set(stats) != {HISTOGRAM_KEY, MISSED_KEY}:
        raise WeightsError(f"{what}: keys {sorted(stats)}, expected {sorted((HISTOGRAM_KEY, MISSED_KEY))}")
    shapes = {HISTOGRAM_KEY: (rows, bins), MISSED_KEY: (rows, 1)}
    for key, shape in shapes.items():
        counts = stats[key]
        if tuple(counts.shape) != shape:
            raise WeightsError(f"{what}: {key} has shape {tuple(counts.shape)}, expected {shape}")
        if not all_finite(counts) or bool((counts < 0).any()) or bool((counts != torch.round(counts)).any()):
            raise WeightsError(f"{what}: {key} must hold whole numbers >= 0")


def gamma_from_histogram(counts: np.ndarray | torch.Tensor, pass_fraction: float, num_classes: int) -> float:
    """The largest bin edge with at least ``pass_fraction`` of the histogram's images at or above it.

    Parameters
    ----------
    counts
        ``(bins,)`` histogram (of recognised images' top probability) summed over sites.
    pass_fraction
        Share of validation images that must pass, in (0, 1].
    num_classes
        K, the number of sites the selector knows: gamma is at least ``1 / K``.

    Returns
    -------
    float
        gamma in ``[1 / K, 1 - 1 / bins]``; ``1 / K`` when the histogram is empty.
    """
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    frac = check_pass_fraction(pass_fraction)
    if num_classes < 1:
        raise ConfigError(f"the selector needs at least one class, got {num_classes}")
    floor = 1.0 / num_classes
    total = float(c.sum())
    if total <= 0:
        return floor
    at_or_above = np.cumsum(c[::-1])[::-1]  # images in bins j.. = own probability >= edge j
    ok = np.nonzero(at_or_above >= frac * total - 1e-9)[0]
    edge = float(ok.max()) / len(c)
    return float(max(edge, floor))


def summed_histogram(stats: Sequence[Mapping[str, torch.Tensor]], row: int = 0) -> tuple[torch.Tensor, float]:
    """All sites' own-site histograms added up (row ``row``) and their total missed count.

    Used by :func:`choose_gamma` and by the routing choice (:mod:`engine.fl.routing_choice`).
    """
    if not stats:
        raise WeightsError("no confidence histograms arrived; at least one site must answer the calibration round")
    bins = stats[0][HISTOGRAM_KEY].shape[1]
    counts = sum((s[HISTOGRAM_KEY][row].to(torch.float64) for s in stats), torch.zeros(bins, dtype=torch.float64))
    return counts, float(sum(float(s[MISSED_KEY][row].sum()) for s in stats))


def choose_gamma(stats: Sequence[Mapping[str, torch.Tensor]], pass_fraction: float, num_classes: int,
                 row: int = 0) -> dict[str, float]:
    """Gamma from all sites' statistics (row ``row``: the chosen temperature's).

    Returns
    -------
    dict
        ``gamma``, ``pass_fraction``, ``images`` (validation images counted), ``accuracy``
        (share the selector assigns to their own site; NaN without images).
    """
    counts, missed = summed_histogram(stats, row)
    hits = float(counts.sum())
    return {"gamma": gamma_from_histogram(counts, pass_fraction, num_classes), "pass_fraction": float(pass_fraction),
            "images": hits + missed, "accuracy": hits / (hits + missed) if hits + missed else float("nan")}


#: ``--gamma`` value that asks the federation to choose gamma from validation histograms.
AUTO = "auto"


def parse_gamma(value: float | str) -> float | str:
    """``"auto"`` or a routing threshold in [0, 1] (numbers may come as text from the command line)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"gamma {value!r} is neither a number in [0, 1] nor 'auto'") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"gamma must be a number in [0, 1] or 'auto', got {value!r}")
    return float(value)
