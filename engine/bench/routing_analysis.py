"""Dice and routing of a FedSM super model over a range of gamma, on any set of sites.

Every model of the super model segments every image once; routing for each gamma then only
picks, per image, which of those masks to keep. So a sweep over ten gammas costs one pass of
each model. The sweep is the paper's Algorithm 2 alone, image by image: what
:class:`~engine.inference.predictor.SuperModelPredictor` produces at that gamma with the style gate
and the routing guard off and without cases (with a gate that judges cases, the predictor decides a
volume whole, ``report.json``'s ``selector`` section measures that routing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.fl.evaluation import dice_per_case, segment_with
from engine.inference.predictor import SuperModelPredictor
from engine.inference.routing import route_fedsm
from engine.tasks import TaskSpec


def _mean_dice(masks: np.ndarray, split: Any) -> float:
    return float(dice_per_case(masks, split.masks, split.case_ids).mean())


def model_outputs(task: TaskSpec, bundle: Any, predictor: Any, images: np.ndarray,
                  device: str) -> tuple[np.ndarray, np.ndarray]:
    """Selector probabilities ``(N, C)`` and every model's masks ``(K+1, N, L, H, W)`` (0 = global)."""
    probs = predictor.predict(images).probabilities
    weights = [bundle.global_weights, *[bundle.personal_weights[s] for s in bundle.metadata.site_names]]
    masks = np.stack([segment_with(task, w, images, device) for w in weights])
    return probs, masks


def gamma_sweep(task: TaskSpec, bundle: Any, sites: Sequence[tuple[str, Any]], gammas: Sequence[float],
                device: str, own_model: dict[str, int] | None = None) -> dict[str, Any]:
    """Dice and routing frequencies of FedSM routing (Algorithm 2) for each gamma.

    Parameters
    ----------
    sites
        ``(name, split)`` pairs to evaluate on (test splits of participating sites, or an unseen site).
    own_model
        For participating sites, the routed index (1..K) of the site's own personalized model;
        used for the share of images routed to it and the oracle Dice.

    Returns
    -------
    dict
        ``models`` (routing targets), ``per_model`` (Dice of each model alone per site),
        ``gammas`` (per gamma: client-average and per-site Dice, routing frequencies per site),
        ``confidence`` (mean and quantiles of max probability per site).
    """
    names = ["global", *bundle.metadata.site_names]
    out: dict[str, Any] = {"models": names, "per_model": {}, "gammas": [], "confidence": {}, "argmax": {}}

    predictor = SuperModelPredictor(bundle, device)
    cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, split in sites:
        probs, masks = model_outputs(task, bundle, predictor, split.images, device)
        cache[name] = (probs, masks)
        out["per_model"][name] = {m: _mean_dice(masks[i], split) for i, m in enumerate(names)}
        conf = probs.max(1)
        out["confidence"][name] = {"mean": float(conf.mean()), "q10": float(np.quantile(conf, 0.1)),
                                   "q50": float(np.quantile(conf, 0.5)), "q90": float(np.quantile(conf, 0.9))}
        counts = np.bincount(probs.argmax(1), minlength=probs.shape[1]) / max(len(probs), 1)
        out["argmax"][name] = {names[i + 1]: float(c) for i, c in enumerate(counts)}
        if own_model is not None and name in own_model:
            out["per_model"][name]["own"] = out["per_model"][name][names[own_model[name]]]
    for gamma in gammas:
        row: dict[str, Any] = {"gamma": float(gamma), "dice": {}, "routing": {}}
        for name, split in sites:
            probs, masks = cache[name]
            routed = route_fedsm(probs, float(gamma))
            chosen = masks[routed, np.arange(len(routed))]
            row["dice"][name] = _mean_dice(chosen, split)
            freq = np.bincount(routed, minlength=len(names)) / max(len(routed), 1)
            row["routing"][name] = {m: float(f) for m, f in zip(names, freq, strict=True)}
        row["client_average"] = float(np.mean(list(row["dice"].values())))
        out["gammas"].append(row)
    return out
