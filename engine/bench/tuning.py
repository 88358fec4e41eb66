"""Learning-rate tuning on validation data, the same budget for every method (issue 15, item 4).

The paper tuned each method's learning rate. With a preset's ``lr_grid``, the benchmark first
trains every main method once per candidate learning rate (analysis ``"tune"``, the first
analysis seed, ``tune_rounds`` rounds, everything else as in the main comparison), scores each
run on the sites' *validation* splits only, and the main comparison and the analyses then train
each method with its best candidate. The test split is never looked at.

Score of a tuning run (:func:`tuning_score`): the best validation Dice over its rounds of the
model the method is evaluated with -- the global model's client average for Centralized,
FedAvg, FedProx and Scaffold; the mean over sites of each site's own model on its own
validation data for Local; for FedSM and FedSM-extra the mean over sites of the better of the
global and the site's personalized model (what routing can reach). Ties go to the candidate
listed first.

FedSM and FedSM-extra are not tuned on their own: their global model *is* FedAvg's, trained on
FedAvg's batches (``engine.fl.methods.contract.FederatedMethod._fedavg_seed``), and stays so only
at FedAvg's learning rate. They, the lam sweep and the personalization variants train with
FedAvg's tuned rate (:data:`TAKES_FEDAVG_RATE`), and FedAvg is tuned whenever one of them is in
the preset; a paired FedSM − FedAvg then differs only by what FedSM adds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from engine.bench.cache import JobKey
from engine.errors import ConfigError

#: Analysis name of tuning jobs.
TUNE = "tune"
#: Methods that train with FedAvg's tuned learning rate: their global model is FedAvg's (module docstring).
TAKES_FEDAVG_RATE = frozenset({"fedsm", "fedsm-extra"})


def tune_label(method: str, lr: float) -> str:
    """Method field of a tuning job, e.g. ``fedavg@lr0.001``."""
    return f"{method}@lr{lr:g}"


def parse_tune_label(label: str) -> tuple[str, float]:
    """``(method, lr)`` of :func:`tune_label` output."""
    method, sep, lr = label.rpartition("@lr")
    if not sep or not method:
        raise ConfigError(f"{label!r} is not a tuning job name (METHOD@lrVALUE)")
    return method, float(lr)


def tune_jobs(preset: Any) -> list[JobKey]:
    """Every tuning job of ``preset`` (none without an ``lr_grid``)."""
    if not preset.lr_grid:
        return []
    seed = preset.analysis_seeds[0]
    return [JobKey(tp.task, TUNE, tune_label(m, lr), seed)
            for tp in preset.tasks for m in tuned_methods(preset.methods) for lr in preset.lr_grid]


def tuned_methods(methods: tuple[str, ...] | list[str]) -> list[str]:
    """The methods a preset tunes: its own, with FedSM's family replaced by FedAvg (order kept, no repeats)."""
    out: list[str] = []
    for method in methods:
        tuned = "fedavg" if method in TAKES_FEDAVG_RATE else method
        if tuned not in out:
            out.append(tuned)
    return out


def tuned_method(key: JobKey) -> str:
    """Which main method's tuned learning rate a job trains with.

    The lam sweep and the personalization variants are FedSM runs, and FedSM's family takes
    FedAvg's rate (:data:`TAKES_FEDAVG_RATE`); the unseen-site jobs use their own method's.
    """
    fedsm_run = key.analysis == "lam" or (key.analysis == "personalization" and key.method.startswith("fedsm"))
    return "fedavg" if fedsm_run or key.method in TAKES_FEDAVG_RATE else key.method


def tuning_score(method: str, result: Mapping[str, Any]) -> float:
    """Validation score of one tuning run (see the module docstring); NaN when nothing was scored."""
    sel = result.get("model_selection") or {}
    personal = sel.get("best_val_dice_personal") or {}
    if method == "local":
        values = list(personal.values())
        return float(sum(values) / len(values)) if values else float("nan")
    glob = sel.get("best_val_dice")
    if method in ("fedsm", "fedsm-extra") and personal:
        # per site, the better of the global model's and the personalized model's validation Dice
        curve = result.get("curves") or []
        per_site_global = _best_global_per_site(curve)
        values = [max(d, per_site_global.get(s, -math.inf)) for s, d in personal.items()]
        return float(sum(values) / len(values))
    return float(glob) if glob is not None else float("nan")


def _best_global_per_site(curve: list[dict[str, Any]]) -> dict[str, float]:
    best: dict[str, float] = {}
    for point in curve:
        for site, d in (point.get("global_sites") or {}).items():
            best[site] = max(best.get(site, -math.inf), float(d))
    return best


def tuning_table(results: Mapping[JobKey, Mapping[str, Any]], task: str) -> dict[str, dict[float, float]]:
    """Per method: candidate learning rate -> validation score, from the tuning jobs that ran."""
    table: dict[str, dict[float, float]] = {}
    for key, result in results.items():
        if key.task != task or key.analysis != TUNE:
            continue
        method, lr = parse_tune_label(key.method)
        table.setdefault(method, {})[lr] = tuning_score(method, result)
    return table


def chosen_lrs(results: Mapping[JobKey, Mapping[str, Any]], task: str, preset: Any) -> dict[str, float]:
    """Per method with every candidate scored: the learning rate with the best validation score."""
    out: dict[str, float] = {}
    for method, scores in tuning_table(results, task).items():
        if any(lr not in scores for lr in preset.lr_grid):
            continue  # tuning incomplete: the method keeps the preset's lr
        finite = [(lr, scores[lr]) for lr in preset.lr_grid if math.isfinite(scores[lr])]
        if finite:
            best = max(s for _, s in finite)
            out[method] = next(lr for lr, s in finite if s == best)
    return out
