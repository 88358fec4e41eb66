"""The simulation a benchmark job trains with, its settings per task, and what a job keeps of its result.

:class:`BenchSimulation` is :class:`engine.simulate.Simulation` (the code behind ``fedsm simulate``) over
sites loaded once per task, plus FedSM's personalization variants and the lam sweep. :mod:`.jobs` runs the
jobs with it; :mod:`.fediod_bench` trains FedIOD's jobs with it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from engine.bench.presets import BenchPreset, TaskPreset
from engine.errors import ConfigError
from engine.fl.evaluation import dice_per_case, segment_with
from engine.fl.methods import FedSM
from engine.fl.personalization import PERSONALIZATIONS, SOFTPULL
from engine.simulate import Simulation, SimulationConfig

ProgressFn = Callable[[dict[str, Any]], None]


def effective_lam(lam: float, sites: int) -> float:
    """``lam`` raised to ``1/K`` where it is smaller: the lam of the *main* FedSM runs.

    The engine's FedSM (and ``fedsm simulate``) accepts only ``lam >= 1/K``, so the main
    comparison uses what a user can run. The lam sweep does not use this (see :func:`sweep_lam`).
    """
    return max(float(lam), 1.0 / sites)


def sweep_lam(lam: float) -> float:
    """The lam a lam-sweep job trains with: exactly the requested value, which must lie in ``[0, 1]``.

    The paper's Table 7 sweeps lam 0.1..0.9 with K = 6 sites, i.e. also below ``1/K``. SoftPull
    ``w_k <- lam w_k + (1 - lam)/(K - 1) sum_{k' != k} w_k'`` is a convex combination for every
    lam in ``[0, 1]``; below ``1/K`` each other site's model weighs more than the site's own
    ((1 - lam)/(K - 1) > lam). Repeated, it still contracts the personalized models towards
    their mean: their deviations from it are multiplied by ``(K lam - 1)/(K - 1)``, which lies in
    ``[-1/(K - 1), 0)`` there (sign flip, small magnitude), is 0 at ``1/K`` (plain averaging) and
    rises to 1 at lam = 1 (local training). So the sweep trains such values as given rather than
    silently raising them to ``1/K``; the report shows the requested and the used value.
    """
    lam = float(lam)
    if not 0.0 <= lam <= 1.0:
        raise ConfigError(f"lam sweep value {lam} must lie in [0, 1]")
    return lam


def lam_of(method: str) -> float:
    """lam of a lam-sweep job's method name, e.g. ``lam0.30`` -> 0.3."""
    return float(method.removeprefix("lam"))


class BenchSimulation(Simulation):
    """A :class:`Simulation` over given sites that also knows FedSM's personalization variants.

    ``softpull_lam`` (lam sweep only) trains FedSM with that SoftPull lam even below ``1/K``,
    which the engine's FedSM constructor rejects: the method is built with a valid lam and its
    :attr:`~engine.fl.methods.FedSM.lam` (the value SoftPull uses each round) is then set, and the
    simulation's recorded ``lam`` is the value used (see :func:`sweep_lam`).
    """

    def __init__(self, cfg: SimulationConfig, out_dir: Path, sites: list[Any], progress: ProgressFn | None = None,
                 cancel: Callable[[], bool] | None = None, softpull_lam: float | None = None) -> None:
        super().__init__(cfg, out_dir, progress, cancel)
        self.sites = list(sites)
        self.softpull_lam = None if softpull_lam is None else sweep_lam(softpull_lam)
        if self.softpull_lam is not None:
            self.lam_used = self.softpull_lam  # recorded in the results and the bundle as used

    def _build_method(self, name: str) -> Any:
        kind = name.removeprefix("fedsm-")
        if kind in PERSONALIZATIONS:
            # the one FedSM path (reference selector, gate, auto routing, guard) with another rule
            self.cfg = replace(self.cfg, personalization=kind)
            return super()._build_method("fedsm")
        if name == "fedsm" and self.softpull_lam is not None:
            names = [s.name for s in self.sites]
            method = FedSM(self.task, names, self.cfg.training(), self.cfg.seed, self.cfg.rounds,
                           lam=effective_lam(self.softpull_lam, len(names)), gamma=self.cfg.gamma,
                           selector_calibration=self.cfg.selector_calibration, style_gate=self.cfg.style_gate)
            method.lam = self.softpull_lam
            return method
        return super()._build_method(name)


@dataclass
class JobContext:
    """What every job of one task needs."""

    preset: BenchPreset
    tp: TaskPreset
    sites: list[Any]
    out_dir: Path
    device: str = "auto"
    progress: ProgressFn | None = None
    cancel: Callable[[], bool] | None = None

    #: Learning rate per method chosen on validation (:mod:`engine.bench.tuning`); others use the preset's.
    lr_for: dict[str, float] = field(default_factory=dict)

    def config(self, seed: int, sites: int, lam: float | None = None, lr: float | None = None,
               rounds: int | None = None) -> SimulationConfig:
        """Simulation settings; a sweep ``lam`` is raised to ``1/K`` here, set exactly by :class:`BenchSimulation`.

        The benchmark's ``fedsm`` is the paper's FedSM (SoftPull), whatever the product's default
        rule: its tables are the paper's shape, and every other rule is a ``fedsm-<rule>`` job.
        """
        p, tp = self.preset, self.tp
        return SimulationConfig(
            task=tp.task, sites=sites, rounds=rounds or tp.rounds, methods=("fedsm",), image_size=tp.image_size,
            seed=seed, lam=effective_lam(tp.lam if lam is None else lam, sites), gamma=p.gamma, epochs=p.epochs,
            batch_size=p.batch_size, lr=p.lr if lr is None else lr, selector_lr=p.selector_lr,
            selector_size=p.selector_size, selector_width=p.selector_width, prox_mu=p.prox_mu, device=self.device,
            lr_schedule=p.lr_schedule,
            lr_min_ratio=p.lr_min_ratio, loss=p.loss, keep_best=p.keep_best, personalization=SOFTPULL)


# --------------------------------------------------------------------------------------------
# Per-round curves (the paper's Figure 2)
# --------------------------------------------------------------------------------------------
class CurveRecorder:
    """Round hook: validation Dice of the global model (and personalized ones) after each round."""

    def __init__(self, task: Any, sites: list[Any], device: str, enabled: bool = True) -> None:
        self.task, self.sites, self.device, self.enabled = task, sites, device, enabled
        self.points: list[dict[str, Any]] = []
        self.last_state: dict[str, Any] = {}

    def _client_average(self, weights_for: Callable[[int], Any]) -> float:
        values = []
        for k, site in enumerate(self.sites):
            val = site.validation
            if not len(val.images):
                continue
            masks = segment_with(self.task, weights_for(k), val.images, self.device)
            values.append(float(dice_per_case(masks, val.masks, val.case_ids).mean()))
        return float(np.mean(values)) if values else float("nan")

    def __call__(self, method: Any, rnd: int, state: dict[str, Any], runtimes: list[Any]) -> None:
        self.last_state = state
        if not self.enabled or rnd > method.rounds:  # selector and calibration rounds leave the U-Nets unchanged
            return
        point: dict[str, Any] = {"round": rnd}
        if "global" in state:
            point["global"] = self._client_average(lambda k: state["global"])
        names = [s.name for s in self.sites]
        if (all(f"personal/{n}" in state for n in names) and method.name in ("fedsm", "fedsm-extra")
                and getattr(method, "personalization", "softpull") == "softpull"):
            point["personal"] = self._client_average(lambda k: state[f"personal/{names[k]}"])
        if method.name == "local":
            models = [rt.state["local_model"] for rt in runtimes]
            point["personal"] = self._client_average(lambda k: models[k])
        self.points.append(point)


def method_result(result: Any) -> dict[str, Any]:
    extra = {k: v for k, v in result.extra.items() if k != "bundle"}
    selection = {k: v for k, v in result.model_selection.items() if k != "curve"}
    return {"dice": result.dice, "client_average": result.client_average, "pooled": result.pooled,
            "wall_s": result.wall_s, "rounds": result.rounds, "bytes_per_round": result.bytes_per_round,
            "extra": extra, "best_round": result.best_round, "model_selection": selection}
