"""Keep each method's best round by validation Dice, as the FedSM paper and its reference code do.

After every training round the :class:`BestRoundKeeper` scores the models the method has at that
point on each site's *validation* split (never the test split): the global model on every site
(client average over sites), and each site's own model (FedSM's personalized model, a Local
site's model) on that site. It keeps a copy of the best weights seen so far:

- the global model of the round with the highest client-average validation Dice;
- per site, the personalized / local model of the round with the highest validation Dice on
  that site (the reference keeps each site's best personalized model by its own validation).

At the end of the last training round the kept weights replace the trained ones
(:meth:`BestRoundKeeper.substitute`), *before* any later phase: FedSM's calibration round and
FedSM-extra's selector rounds then work with the best models, not the last ones. Ties keep the
earlier round. Rounds that leave the U-Nets unchanged (selector and calibration rounds) are not
scored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.fl.evaluation import dice_per_case, segment_with
from engine.fl.weights import Weights, clone_weights
from engine.tasks import TaskSpec


@dataclass
class ValidationSite:
    """A site's name and validation split (images, masks, case ids)."""

    name: str
    validation: Any


@dataclass
class _Best:
    round: int = 0
    dice: float = float("-inf")
    weights: Weights | None = None


@dataclass
class BestRoundKeeper:
    """Round hook ``keeper(method, rnd, state, runtimes)`` that tracks the best round by validation Dice.

    Parameters
    ----------
    task
        The segmentation task.
    sites
        Sites in index order, each with a ``name`` and a ``validation`` split.
    device
        Device for the validation forward passes.
    segment
        ``segment(task, weights, images, device) -> masks``; defaults to
        :func:`engine.fl.evaluation.segment_with` (tests pass a cheap stand-in).
    """

    task: TaskSpec
    sites: Sequence[Any]
    device: str = "auto"
    segment: Callable[..., np.ndarray] | None = None
    points: list[dict[str, Any]] = field(default_factory=list)
    #: Seconds spent on validation forward passes (the cost of keeping the best round).
    eval_s: float = 0.0
    #: The method's state after the last aggregation seen (with the best weights swapped in).
    final_state: dict[str, Any] = field(default_factory=dict)
    _global: _Best = field(default_factory=_Best)
    _personal: dict[str, _Best] = field(default_factory=dict)

    # --- scoring ---------------------------------------------------------------------------
    def site_dice(self, weights: Mapping[str, Any], k: int) -> float | None:
        """Mean validation Dice (over cases and structures) of ``weights`` on site ``k``; ``None`` without data."""
        val = self.sites[k].validation
        if not len(val.images):
            return None
        segment = self.segment or segment_with
        masks = segment(self.task, weights, val.images, self.device)
        return float(dice_per_case(masks, val.masks, val.case_ids).mean())

    def client_average(self, weights: Mapping[str, Any]) -> float:
        """Mean over sites (with validation data) of :meth:`site_dice`; NaN when no site has any."""
        values = [d for d in (self.site_dice(weights, k) for k in range(len(self.sites))) if d is not None]
        return float(np.mean(values)) if values else float("nan")

    @staticmethod
    def own_models(method: Any, state: Mapping[str, Any], runtimes: Sequence[Any],
                   names: Sequence[str]) -> dict[str, Any]:
        """Each site's own model at this point: FedSM's ``personal/<site>`` or Local's site model.

        FedSM with a personalization rule other than SoftPull builds its personalized models at the
        sites, from private state, only in the last round: nothing to score during training.
        """
        if getattr(method, "personalization", "softpull") != "softpull":
            return {}
        if getattr(method, "name", "") == "local":
            return {rt.name: rt.state["local_model"] for rt in runtimes if "local_model" in rt.state}
        return {n: state[f"personal/{n}"] for n in names if f"personal/{n}" in state}

    def __call__(self, method: Any, rnd: int, state: Mapping[str, Any], runtimes: Sequence[Any]) -> None:
        if not is_training_round(method, rnd):
            return  # selector / calibration rounds leave the U-Nets unchanged
        started = time.perf_counter()
        self._score(method, rnd, state, runtimes)
        self.eval_s += time.perf_counter() - started

    def _score(self, method: Any, rnd: int, state: Mapping[str, Any], runtimes: Sequence[Any]) -> None:
        point: dict[str, Any] = {"round": rnd}
        if "global" in state:
            sites = {s.name: self.site_dice(state["global"], k) for k, s in enumerate(self.sites)}
            scored = [d for d in sites.values() if d is not None]
            avg = float(np.mean(scored)) if scored else float("nan")
            point["global"] = avg
            point["global_sites"] = {n: d for n, d in sites.items() if d is not None}
            if np.isfinite(avg) and avg > self._global.dice:
                self._global = _Best(rnd, avg, clone_weights(state["global"]))
        names = [s.name for s in self.sites]
        own = self.own_models(method, state, runtimes, names)
        if own:
            per_site: dict[str, float] = {}
            for k, name in enumerate(names):
                if name not in own:
                    continue
                d = self.site_dice(own[name], k)
                if d is None:
                    continue
                per_site[name] = d
                best = self._personal.setdefault(name, _Best())
                if d > best.dice:
                    self._personal[name] = _Best(rnd, d, clone_weights(own[name]))
            if per_site:
                point["personal"] = float(np.mean(list(per_site.values())))
                point["personal_sites"] = per_site
        self.points.append(point)

    # --- result ----------------------------------------------------------------------------
    def substitute(self, method: Any, state: dict[str, Any], runtimes: Sequence[Any]) -> dict[str, Any]:
        """``state`` with the kept best weights in place of the last round's (Local: in the runtimes)."""
        new = dict(state)
        if self._global.weights is not None and "global" in new:
            new["global"] = self._global.weights
        if getattr(method, "name", "") == "local":
            for rt in runtimes:
                best = self._personal.get(rt.name)
                if best is not None and best.weights is not None:
                    rt.state["local_model"] = best.weights
            return new
        for name, best in self._personal.items():
            key = f"personal/{name}"
            if key in new and best.weights is not None:
                new[key] = best.weights
        return new

    def summary(self) -> dict[str, Any]:
        """JSON-ready: best round and its validation Dice (global and per site), the validation curve."""
        out: dict[str, Any] = {"criterion": "validation Dice (client average for the global model, own site "
                                            "for personalized / local models)",
                               "curve": self.points}
        if self._global.weights is not None:
            out["best_round"] = self._global.round
            out["best_val_dice"] = self._global.dice
        if self._personal:
            out["best_round_personal"] = {n: b.round for n, b in self._personal.items()}
            out["best_val_dice_personal"] = {n: b.dice for n, b in self._personal.items()}
            if "best_round" not in out:  # Local: the rounds differ per site; report the latest
                out["best_round"] = max(b.round for b in self._personal.values())
        return out


def last_training_round(method: Any) -> int:
    """The round after which the kept weights replace the trained ones (FedSM's warm-up rounds come first)."""
    return int(getattr(method, "last_training_round", getattr(method, "rounds", 0)))


def is_training_round(method: Any, rnd: int) -> bool:
    """Whether round ``rnd`` trains the U-Nets (not a selector warm-up, selector or calibration round)."""
    phase = getattr(method, "phase", None)
    if phase is not None:
        return bool(phase(rnd) == "train")
    return rnd <= last_training_round(method)


def attach_best_round(method: Any, runtimes: Sequence[Any], keeper: BestRoundKeeper) -> None:
    """Wrap ``method.aggregate``: score every training round, swap in the best weights after the last one."""
    aggregate = method.aggregate

    def aggregate_and_keep(state: dict[str, Any], rnd: int, updates: Any) -> dict[str, Any]:
        new = aggregate(state, rnd, updates)
        keeper(method, rnd, new, runtimes)
        if rnd == last_training_round(method):
            new = keeper.substitute(method, new, runtimes)
        keeper.final_state = new
        return new

    method.aggregate = aggregate_and_keep
