"""Which rule picks an image's site in a FedSM super model, chosen on validation data (``site_routing="auto"``).

A FedSM super model can pick the site whose personalized model segments an image with the trained
selector and gamma (the paper's Algorithm 2) or with the site-style gate's nearest site
(:func:`engine.fl.style_gate.route_by_style`). Which one knows the sites better depends on how far
the selector has trained: after the paper's hundreds of rounds it names the site of nearly every
seen image with confidence above gamma; after the tens of one-step rounds a CPU affords, it names
fewer than the gate's Gaussians do (docs/results.md, "Selector (leave-one-site-out)").

``auto`` (the default) lets the federation measure both on the participating sites' VALIDATION
images in the last round and keep the better, the way FedSM already keeps each model's best round
and the routing guard keeps a personalized model only where it beat the global one:

- each site sends the selector's own-site confidence histogram (the statistics ``--gamma auto``
  uses, :func:`engine.fl.selector_gamma.histogram_statistics`) and, in part :data:`ROUTING_PART`,
  how many of its validation images the gate's nearest-site rule names correctly and how many it
  scored: two whole numbers, no per-image value. Both count images as the super model routes them:
  where the gate judges cases (every gate since 891cb49) an image counts with its volume's decision
  (the volume's mean selector probabilities, its nearest site by mean distance), since the predictor
  routes a volume whole (:mod:`engine.fl.cases`);
- the server computes each rule's share of validation images routed to their own site's model
  (the selector: top probability above the routing gamma, to the histogram's 0.01 resolution,
  rounding against the selector) and keeps the selector unless the style rule's share is higher
  (:func:`choose_site_routing`). The gate's threshold applies to both rules alike, so it is left
  out of the comparison.

Not in the FedSM paper: a validation-based choice between its selector and the field's
nearest-class-mean rule on style statistics (Lee et al., NeurIPS 2018).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from engine.errors import WeightsError
from engine.fl.selector_gamma import summed_histogram
from engine.fl.weights import Weights, all_finite

#: Site-routing settings a federation accepts: ``auto`` chooses between the two rules a bundle
#: records (:data:`engine.fl.style_gate.SITE_ROUTINGS`) on validation data.
AUTO = "auto"

#: Payload part of a site's last-round style-routing counts.
ROUTING_PART = "routing_stats"
#: Keys of :data:`ROUTING_PART`: validation images the gate's nearest site names correctly, and
#: validation images scored.
ROUTING_KEYS = ("style_own", "count")

#: Server-state part holding the federation's choice and the shares it rests on.
CHOICE_PART = "site_routing_choice"


def style_routing_statistics(nearest: np.ndarray, own_index: int) -> Weights:
    """A site's :data:`ROUTING_PART`: how many of its validation images the gate's nearest site names.

    Parameters
    ----------
    nearest
        ``(N,)`` each validation image's nearest site index (0-based, the federation's site order).
    own_index
        The site's own index in that order.
    """
    n = np.asarray(nearest, dtype=np.int64).reshape(-1)
    return {"style_own": torch.tensor([float((n == int(own_index)).sum())], dtype=torch.float64),
            "count": torch.tensor([float(len(n))], dtype=torch.float64)}


def check_routing_statistics(stats: Mapping[str, torch.Tensor], what: str) -> None:
    """Reject counts with wrong keys or shapes, that are not whole numbers, or name more images than scored."""
    if set(stats) != set(ROUTING_KEYS):
        raise WeightsError(f"{what}: keys {sorted(stats)}, expected {sorted(ROUTING_KEYS)}")
    for key in ROUTING_KEYS:
        t = stats[key]
        if tuple(t.shape) != (1,):
            raise WeightsError(f"{what}: {key} has shape {tuple(t.shape)}, expected (1,)")
        if not all_finite(t) or bool((t < 0).any()) or bool((t != torch.round(t)).any()):
            raise WeightsError(f"{what}: {key} must be a whole number >= 0")
    if float(stats["style_own"][0]) > float(stats["count"][0]):
        raise WeightsError(f"{what}: names {float(stats['style_own'][0]):g} images correctly but scored only "
                           f"{float(stats['count'][0]):g}")


def selector_own_share(histograms: Sequence[Mapping[str, torch.Tensor]], gamma: float, row: int = 0) -> float:
    """Share of validation images the selector sends to their own site's model at ``gamma``.

    Counts the images assigned to their own site whose top probability lies in a histogram bin
    that starts at or above ``gamma`` (Algorithm 2's ``> gamma`` to the bins' resolution; a bin
    that ``gamma`` cuts is left out), over all images scored, missed ones included. NaN without
    images.
    """
    summed, missed = summed_histogram(histograms, row)
    counts = summed.numpy()
    bins = len(counts)
    total = float(counts.sum()) + missed
    if total <= 0:
        return float("nan")
    # bins that start at or above gamma; where gamma falls inside a bin, that bin is left out
    first = min(int(np.ceil(float(gamma) * bins - 1e-9)), bins)
    return float(counts[first:].sum()) / total


def choose_site_routing(selector_share: float, style_stats: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    """The federation's rule from both rules' shares of validation images routed to their own site.

    Returns
    -------
    dict
        ``style`` (1.0 when style routing wins, 0.0 when the selector is kept: ties and a missing
        comparison keep the paper's selector), ``selector_own`` and ``style_own`` (the two shares;
        NaN when not measurable) and ``images`` (validation images the style counts cover).
    """
    own = float(sum(float(s["style_own"][0]) for s in style_stats))
    count = float(sum(float(s["count"][0]) for s in style_stats))
    style_share = own / count if count > 0 else float("nan")
    wins = bool(np.isfinite(style_share) and (not np.isfinite(selector_share) or style_share > selector_share))
    return {"style": 1.0 if wins else 0.0, "selector_own": float(selector_share), "style_own": style_share,
            "images": count}


def chosen_rule(requested: str, choice: Mapping[str, torch.Tensor] | None) -> str:
    """The rule ``requested`` resolves to: itself, or for ``auto`` the federation's choice (else the selector)."""
    if requested != AUTO:
        return requested
    if choice and float(choice["style"].reshape(-1)[0]) > 0.5:
        return "style"
    return "selector"


def choice_summary(choice: Mapping[str, torch.Tensor] | None) -> dict[str, float]:
    """The server-state choice as plain numbers (for a bundle's ``extra`` and the report), ``{}`` without one."""
    if not choice:
        return {}
    return {k: float(v.reshape(-1)[0]) for k, v in choice.items()}
