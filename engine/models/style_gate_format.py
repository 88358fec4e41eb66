"""The style gate's stored form: descriptor layouts, routing names and the bundle field's check.

Numpy only and below :mod:`engine.fl` and :mod:`engine.bundle`, which both read it: the bundle checks a
``style_gate`` field without importing the training code, and :mod:`engine.fl.style_gate` computes and fits
what these names describe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from engine.errors import ConfigError

#: Descriptor layout this engine computes and records in bundles; a new layout gets a new name
#: and the old ones stay readable (:data:`PER_CHANNEL`), so older bundles keep routing as they did.
DESCRIPTOR = "intensity-v2"

#: Intensity quantiles of the descriptor.
QUANTILES: tuple[float, ...] = (0.05, 0.25, 0.5, 0.75, 0.95)

#: Gradient-magnitude quantiles of the ``intensity-v2`` descriptor (edge sharpness and contrast).
GRADIENT_QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)

#: Side of the grid of regional means of the ``intensity-v2`` descriptor (bias field, vignetting,
#: field of view).
GRID = 3

#: Descriptor values per image channel, per layout. ``intensity-v1``: mean, std, the quantiles,
#: mean |dx|, mean |dy|. ``intensity-v2``: those, the GRID x GRID regional means, the gradient-
#: magnitude quantiles and the noise level (median |Laplacian|).
PER_CHANNEL: dict[str, int] = {"intensity-v1": 4 + len(QUANTILES),
                               "intensity-v2": 4 + len(QUANTILES) + GRID * GRID + len(GRADIENT_QUANTILES) + 1}

#: How a FedSM bundle picks an image's site: the trained selector and gamma (the paper's
#: Algorithm 2), or the gate's nearest site (:func:`engine.fl.style_gate.route_by_style`).
SITE_ROUTINGS = ("selector", "style")


def descriptor_size(channels: int, layout: str = DESCRIPTOR) -> int:
    """Length of an image's descriptor for ``channels`` image channels in ``layout``."""
    return per_channel(layout) * int(channels)


def per_channel(layout: str) -> int:
    if layout not in PER_CHANNEL:
        raise ConfigError(f"unknown style descriptor {layout!r}; this FedSM knows {', '.join(PER_CHANNEL)}")
    return PER_CHANNEL[layout]


def check_quantile(quantile: float) -> float:
    """``quantile`` if it is a number in (0, 1]; :class:`ConfigError` otherwise."""
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0.0 < float(quantile) <= 1.0:
        raise ConfigError(f"the style gate's quantile must be a number in (0, 1], got {quantile!r}")
    return float(quantile)


#: What the gate judges: ``image`` (each image by its own distance; bundles before 2026-11-30 have no
#: ``unit`` and judge images) or ``case`` (a volume by the mean distance of its slices; a photo is a case).
GATE_UNITS = ("image", "case")


def check_gate_metadata(meta: Mapping[str, object], site_names: Sequence[str], channels: int) -> None:
    """Check a bundle's ``style_gate`` field; :class:`ConfigError` names the first problem."""
    keys = {"descriptor", "sites", "means", "precision", "threshold", "quantile"}
    if set(meta) - {"unit"} != keys:
        raise ConfigError(f"style_gate must have the keys {sorted(keys)} (and optionally 'unit'), got {sorted(meta)}")
    if meta.get("unit", "image") not in GATE_UNITS:
        raise ConfigError(f"style_gate unit must be one of {', '.join(GATE_UNITS)}, got {meta['unit']!r}")
    if meta["descriptor"] not in PER_CHANNEL:
        raise ConfigError(f"style_gate uses descriptor {meta['descriptor']!r}; this FedSM knows "
                          f"{', '.join(PER_CHANNEL)}")
    sites = meta["sites"]
    if not isinstance(sites, list) or not sites or not all(s in site_names for s in sites) \
            or len(set(sites)) != len(sites):
        raise ConfigError(f"style_gate sites must be distinct names from site_names, got {sites!r}")
    d = descriptor_size(channels, str(meta["descriptor"]))
    try:
        means = np.asarray(meta["means"], dtype=np.float64)
        precision = np.asarray(meta["precision"], dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError("style_gate means and precision must be lists of numbers") from None
    if means.shape != (len(sites), d) or precision.shape != (d, d):
        raise ConfigError(f"style_gate means must be {len(sites)} x {d} and precision {d} x {d}, got "
                          f"{means.shape} and {precision.shape}")
    if not (np.isfinite(means).all() and np.isfinite(precision).all()):
        raise ConfigError("style_gate means and precision must be finite numbers")
    threshold = meta["threshold"]
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not np.isfinite(threshold) or threshold < 0):
        raise ConfigError(f"style_gate threshold must be a number >= 0 or null, got {threshold!r}")
    check_quantile(meta["quantile"])  # type: ignore[arg-type]
