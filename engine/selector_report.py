"""What ``report.json`` says about a FedSM super model's selector and routing.

Computed once per run from the trained super model: every image of the participating sites'
held-out splits (and of the held-out site, ``--holdout-site``) goes through the selector once
and through each of the K + 1 U-Nets once, so any routing (any gamma, guard on or off) is an
index into those predictions. Reported:

- ``confidence``: the selector's top-1 confidence on seen (participating sites' test images)
  and unseen (the held-out site's images) images: quantiles and a histogram;
- ``ece``: expected calibration error of the selector on the participating sites' test images
  (label = the image's site), and its accuracy there;
- ``routing_per_gamma``: per gamma, the fraction of seen images routed to the global model, to
  their own site's model and to another site's model, and the fraction of unseen images
  routed to the global model (guard off: the selector alone; a volume decided whole by its
  slices' mean probabilities where the gate judges cases, as the super model routes); with a site-style gate
  (:mod:`engine.fl.style_gate`) each row also has ``seen_gated`` / ``unseen_gated``, the same
  with the gate applied;
- ``style_gate``: the gate's threshold and quantile and the share of seen and unseen images it
  found unlike every participating site;
- ``style_routing`` (with a gate): the same shares when each image goes to the gate's nearest
  site, or to global outside the gate (a bundle's ``site_routing: "style"``), whatever the
  bundle's own setting, so both rules are measured on every run;
- ``dice``: at the run's gamma, client-average test Dice of the super model with the routing
  guard on and off, of the global model alone and, for the unseen site, the same three (Dice
  per case as everywhere in the report: slices of a volume are scored together). With a gate,
  ``guard_on`` / ``guard_off`` route as the super model does (gate applied) and
  ``gate_off`` is the guarded routing by the selector alone, and ``style`` the guarded style
  routing. ``routing`` names the rule the bundle itself uses (``guard_on`` follows it).
- ``routing_choice`` (``site_routing: auto``): the rule the federation kept and the shares of
  participating validation images each rule sent to their own site's model
  (:mod:`engine.fl.routing_choice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.fl.evaluation import dice_per_case
from engine.fl.selector_training import confidence_summary, expected_calibration_error
from engine.fl.style_gate import route_by_style
from engine.inference.guard import apply_guard, guard_decisions
from engine.inference.routing import case_mean_probabilities, route_fedsm

#: Gammas at which routing is reported (the paper's Table 5 range).
REPORT_GAMMAS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


@dataclass
class SiteImages:
    """Held-out images of one site with their ground truth."""

    name: str
    images: np.ndarray
    masks: np.ndarray
    case_ids: np.ndarray


@dataclass
class _Scored:
    probs: np.ndarray  # (N, K) selector softmax
    decided: np.ndarray  # (N, K) what routing compares with gamma: probs, or each volume's mean rows
    masks: np.ndarray  # (models, N, L, H, W) every model's masks
    unlike: np.ndarray  # (N,) bool: the style gate finds the image unlike every site (False without a gate)
    nearest: np.ndarray  # (N,) int: the gate's nearest site, 1..K (0 without a gate)


def _score(predictor: Any, site: SiteImages) -> _Scored:
    """Selector probabilities and every model's masks for one site's images."""
    masks = []
    first = None
    for model in range(predictor.num_models):
        pred = predictor.predict(site.images, force_model=model, routing_guard=False, cases=site.case_ids)
        first = pred if first is None else first
        masks.append(pred.masks)
    probs = np.asarray(first.probabilities)
    decided = case_mean_probabilities(probs, site.case_ids) if predictor.decides_volumes(site.case_ids) else probs
    return _Scored(probs, decided, np.stack(masks), np.asarray(first.unlike_sites, dtype=bool),
                   np.asarray(first.nearest_site, dtype=np.int64))


def _gated(routed: np.ndarray, unlike: np.ndarray) -> np.ndarray:
    return np.where(unlike, 0, routed).astype(np.int64)


def _routed_dice(scored: _Scored, routed: np.ndarray, site: SiteImages) -> float:
    """Mean per-case Dice (over cases and structures) when each image is segmented by its routed model."""
    masks = scored.masks[np.asarray(routed, dtype=np.int64), np.arange(len(routed))]
    return float(dice_per_case(masks, site.masks, site.case_ids).mean())


def selector_report(predictor: Any, seen: Sequence[SiteImages], unseen: SiteImages | None,
                    gamma: float, gammas: Sequence[float] = REPORT_GAMMAS) -> dict[str, Any]:
    """The selector and routing analysis of a FedSM super model (see the module docstring)."""
    meta = predictor.metadata
    names = list(meta.site_names)
    seen_scored = [_score(predictor, s) for s in seen]
    labels = np.concatenate([np.full(len(s.images), names.index(s.name)) for s in seen])
    probs = np.concatenate([sc.probs for sc in seen_scored])
    decided = np.concatenate([sc.decided for sc in seen_scored])
    unseen_scored = _score(predictor, unseen) if unseen is not None and len(unseen.images) else None
    out: dict[str, Any] = {
        "calibration": meta.extra.get("selector_calibration", "none"),
        "gamma": float(gamma),
        **({"gamma_choice": meta.extra["gamma_choice"]} if "gamma_choice" in meta.extra else {}),
        **({"routing_choice": meta.extra["routing_choice"]} if "routing_choice" in meta.extra else {}),
        "confidence": {"seen": confidence_summary(probs.max(1) if len(probs) else probs)},
        "ece": {"participating": expected_calibration_error(probs, labels),
                "accuracy": float((probs.argmax(1) == labels).mean()) if len(labels) else float("nan")},
    }
    if unseen_scored is not None:
        out["confidence"]["unseen"] = confidence_summary(unseen_scored.probs.max(1))
    gate = bool(meta.style_gate)
    unlike = np.concatenate([sc.unlike for sc in seen_scored]) if seen_scored else np.zeros(0, dtype=bool)
    if gate:
        out["style_gate"] = {"threshold": meta.style_gate["threshold"], "quantile": meta.style_gate["quantile"],
                             "sites": list(meta.style_gate["sites"]),
                             "seen_unlike": float(unlike.mean()) if len(unlike) else float("nan"),
                             **({"unseen_unlike": float(unseen_scored.unlike.mean())}
                                if unseen_scored is not None else {})}

    def shares(routed: np.ndarray) -> dict[str, float]:
        return {"global": float((routed == 0).mean()), "own_site": float((routed == labels + 1).mean()),
                "other_site": float(((routed != 0) & (routed != labels + 1)).mean())}

    per_gamma = []
    for g in sorted({float(x) for x in gammas} | {float(gamma)}):  # the run's gamma has its row too
        routed = route_fedsm(decided, g)
        row: dict[str, Any] = {"gamma": float(g), "seen": shares(routed)}
        if gate:
            row["seen_gated"] = shares(_gated(routed, unlike))
        if unseen_scored is not None:
            r_u = route_fedsm(unseen_scored.decided, g)
            row["unseen"] = {"global": float((r_u == 0).mean()), "site": float((r_u != 0).mean())}
            if gate:
                r_g = _gated(r_u, unseen_scored.unlike)
                row["unseen_gated"] = {"global": float((r_g == 0).mean()), "site": float((r_g != 0).mean())}
        per_gamma.append(row)
    out["routing_per_gamma"] = per_gamma
    nearest = np.concatenate([sc.nearest for sc in seen_scored]) if seen_scored else np.zeros(0, dtype=np.int64)
    if gate:
        style: dict[str, Any] = {"seen": shares(route_by_style(nearest, unlike))}
        if unseen_scored is not None:
            r_s = route_by_style(unseen_scored.nearest, unseen_scored.unlike)
            style["unseen"] = {"global": float((r_s == 0).mean()), "site": float((r_s != 0).mean())}
        out["style_routing"] = style

    decisions = guard_decisions(names, meta.site_validation)

    by_style = gate and meta.site_routing == "style"

    def dice_for(scored: _Scored, site: SiteImages) -> dict[str, float]:
        selector_alone = route_fedsm(scored.decided, gamma)
        style_routed = route_by_style(scored.nearest, scored.unlike) if gate else selector_alone
        chosen = style_routed if by_style else _gated(selector_alone, scored.unlike) if gate else selector_alone
        guarded, _ = apply_guard(chosen, decisions)
        out = {"guard_on": _routed_dice(scored, guarded, site), "guard_off": _routed_dice(scored, chosen, site),
               "global_only": _routed_dice(scored, np.zeros(len(chosen), dtype=np.int64), site)}
        if gate:
            out["gate_off"] = _routed_dice(scored, apply_guard(selector_alone, decisions)[0], site)
            out["style"] = _routed_dice(scored, apply_guard(style_routed, decisions)[0], site)
        return out

    per_site = {s.name: dice_for(sc, s) for s, sc in zip(seen, seen_scored, strict=True)}
    out["dice"] = {
        "gamma": float(gamma),
        "routing": "style" if by_style else "selector",
        "participating": {k: float(np.mean([d[k] for d in per_site.values()])) for k in
                          next(iter(per_site.values()))} if per_site else {},
        "per_site": per_site,
    }
    if unseen_scored is not None and unseen is not None:
        out["dice"]["unseen"] = dice_for(unseen_scored, unseen)
        out["unseen_site"] = unseen.name
    out["guard"] = {d.site: {"personal_allowed": d.allowed, "why": d.why} for d in decisions}
    return out
