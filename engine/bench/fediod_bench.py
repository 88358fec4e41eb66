"""FedIOD in ``fedsm bench``: the paper's Table 2 shape and Dice against epsilon.

Jobs of the ``fediod`` analysis (one per task, method and seed) train with the same
:class:`engine.bench.bench_simulation.BenchSimulation` as every other job and evaluate on every site's test
split with Dice *and* HD95 (MONAI's ``compute_hausdorff_distance``, 95th percentile, in pixels;
a volume is one 3D case):

- ``fediod`` (no DP) and ``fediod-eps<e>`` (every site targets epsilon ``e`` for the run): the
  distilled student; the no-DP job also evaluates each site's teacher ("Standalone");
- ``centralized``, ``fedavg``, ``fedsm``: the baselines of the table, same data, seed and rounds.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from monai.metrics import compute_hausdorff_distance

from engine.bench.bench_simulation import BenchSimulation, method_result
from engine.bench.cache import JobKey
from engine.fl.evaluation import dice_per_case, segment_with
from engine.fl.registry import build_exchange_method
from engine.inference.predictor import SuperModelPredictor

if TYPE_CHECKING:
    from engine.bench.bench_simulation import JobContext
    from engine.bench.presets import BenchPreset

ANALYSIS = "fediod"
#: Baselines of the paper's Table 2 trained inside the analysis (Dice and HD95 of the same runs).
BASELINES = ("centralized", "fedavg", "fedsm")


def eps_label(epsilon: float) -> str:
    """Method name of a DP job, e.g. ``fediod-eps8``."""
    return f"fediod-eps{epsilon:g}"


def eps_of(method: str) -> float | None:
    """Epsilon target of a job's method name (``None`` for the no-DP run)."""
    return float(method.removeprefix("fediod-eps")) if method.startswith("fediod-eps") else None


def plan_fediod_jobs(preset: BenchPreset) -> list[JobKey]:
    """The analysis' jobs: per seed and task, FedIOD without DP, the baselines, then one run per epsilon."""
    jobs: list[JobKey] = []
    for seed in preset.fediod_seeds:
        for tp in preset.tasks:
            jobs += [JobKey(tp.task, ANALYSIS, m, seed) for m in ("fediod", *BASELINES)]
            jobs += [JobKey(tp.task, ANALYSIS, eps_label(e), seed) for e in preset.fediod_epsilons]
    return jobs


def fediod_settings(preset: BenchPreset, key: JobKey) -> dict[str, Any]:
    """What, besides the common settings, determines a FedIOD-analysis job's result."""
    out: dict[str, Any] = {"fediod_steps": preset.fediod_steps, "teacher_epochs": preset.fediod_teacher_epochs,
                           "hd_percentile": 95}
    if key.method.startswith("fediod"):
        out["dp_epsilon"] = eps_of(key.method)
    return out


def hd95_per_case(pred: np.ndarray, truth: np.ndarray, case_ids: np.ndarray) -> np.ndarray:
    """95th-percentile Hausdorff distance (pixels) per case and structure, ``(cases, L)``.

    A structure absent from both prediction and truth scores 0; absent from exactly one of them
    it has no distance (NaN, counted separately by :func:`summarise`).
    """
    pred, truth = pred.astype(bool), truth.astype(bool)
    cases = np.unique(case_ids)
    out = np.full((len(cases), pred.shape[1]), np.nan)
    for i, case in enumerate(cases):
        sel = case_ids == case
        p, t = pred[sel], truth[sel]  # (Z, L, H, W): slices of one case
        for label in range(pred.shape[1]):
            pl, tl = p[:, label], t[:, label]
            if not pl.any() and not tl.any():
                out[i, label] = 0.0
                continue
            if not pl.any() or not tl.any():
                continue
            volume_p = pl[0] if len(pl) == 1 else pl
            volume_t = tl[0] if len(tl) == 1 else tl
            with warnings.catch_warnings():  # MONAI 1.5 warns about its own internal argument
                warnings.simplefilter("ignore", FutureWarning)
                value = compute_hausdorff_distance(torch.from_numpy(volume_p)[None, None].float(),
                                                   torch.from_numpy(volume_t)[None, None].float(),
                                                   include_background=True, percentile=95)
            out[i, label] = float(value.reshape(-1)[0])
    return out


def summarise(predict: Callable[[int, np.ndarray], np.ndarray], sites: list[Any]) -> dict[str, Any]:
    """Client-average Dice and HD95 of ``predict(site_index, images)`` over every site's test split."""
    dice, hd, missing, cases = [], [], 0, 0
    for k, site in enumerate(sites):
        masks = predict(k, site.test.images)
        dice.append(float(dice_per_case(masks, site.test.masks, site.test.case_ids).mean()))
        h = hd95_per_case(masks, site.test.masks, site.test.case_ids)
        missing += int(np.isnan(h).sum())
        cases += h.size
        hd.append(float(np.nanmean(h)) if np.isfinite(h).any() else math.nan)
    return {"dice": float(np.mean(dice)), "hd95": float(np.nanmean(hd)) if np.isfinite(hd).any() else math.nan,
            "hd95_undefined": missing, "hd95_cases": cases, "dice_per_site": dice}


def run_fediod_job(ctx: JobContext, key: JobKey) -> dict[str, Any]:
    """Train ``key.method`` and evaluate it (and, for the no-DP FedIOD run, every teacher) with Dice and HD95."""
    preset = ctx.preset
    cfg = ctx.config(key.seed, len(ctx.sites))
    cfg = replace(cfg, fediod_steps=max(1, preset.fediod_steps // max(cfg.rounds, 1)),
                  teacher_epochs=preset.fediod_teacher_epochs, dp_epsilon=eps_of(key.method))
    method = "fediod" if key.method.startswith("fediod") else key.method

    runtimes: list[Any] = []

    class Recording(BenchSimulation):
        def _runtimes(self) -> list[Any]:
            runtimes[:] = super()._runtimes()
            return runtimes

    sim = Recording(cfg, ctx.out_dir, ctx.sites, ctx.progress, ctx.cancel)
    states: list[dict[str, Any]] = []
    sim.round_hook = lambda m, rnd, state, rts: states.append(state)
    result = sim.run_method(method)
    out = method_result(result)
    task = sim.task
    if method == "fediod":
        student = states[-1]["student"]
        out["table"] = summarise(lambda k, x: segment_with(task, student, x, ctx.device), ctx.sites)
        if key.method == "fediod":
            fediod = build_exchange_method("fediod", task, [s.name for s in ctx.sites], vars(cfg))
            teachers = fediod.site_segmenters(runtimes, ctx.device)  # type: ignore[attr-defined]
            out["standalone"] = {name: summarise(lambda k, x, p=predict: p(x), ctx.sites)
                                 for name, predict in teachers.items()}
    elif method == "fedsm":
        bundle = result.extra.get("bundle")
        predictor = SuperModelPredictor(bundle, ctx.device)
        out["table"] = summarise(lambda k, x: predictor.predict(x).masks, ctx.sites)
    else:
        weights = states[-1]["global"]
        out["table"] = summarise(lambda k, x: segment_with(task, weights, x, ctx.device), ctx.sites)
    return out


def _fmt(values: list[float], digits: int = 4) -> str:
    finite = [v for v in values if v == v]
    if not finite:
        return "–"
    mean = float(np.mean(finite))
    return f"{mean:.{digits}f}" if len(finite) == 1 else f"{mean:.{digits}f} ± {float(np.std(finite)):.{digits}f}"


def fediod_section(results: Mapping[JobKey, dict[str, Any]], preset: BenchPreset, task_name: str) -> list[str]:
    """Markdown: the Table 2 shape (mean ± std over seeds; Standalone over teachers) and Dice vs epsilon."""
    rows = {k: v for k, v in results.items() if k.task == task_name and k.analysis == ANALYSIS}
    if not rows:
        return []

    def of(method: str, field: str) -> list[float]:
        return [float(v["table"][field]) for k, v in rows.items() if k.method == method and "table" in v]

    lines = ["", f"### {task_name}: FedIOD against the baselines (the FedIOD paper's Table 2 shape)", "",
             "Client-average test Dice and HD95 (pixels, 95th percentile; cases where exactly one of prediction "
             "and truth is empty have no distance and are left out of HD95). Mean ± std over seeds; "
             "Standalone: mean ± std over the sites' teachers, each evaluated on every site's test split.", "",
             "| method | Dice | HD95 |", "|---|---|---|"]
    teachers = [t for k, v in rows.items() if k.method == "fediod" for t in v.get("standalone", {}).values()]
    lines.append(f"| Standalone (teachers) | {_fmt([t['dice'] for t in teachers])} | "
                 f"{_fmt([t['hd95'] for t in teachers], 2)} |")
    for method, title in (("centralized", "Centralized"), ("fedavg", "FedAvg"), ("fedsm", "FedSM"),
                          ("fediod", "FedIOD (no DP)")):
        lines.append(f"| {title} | {_fmt(of(method, 'dice'))} | {_fmt(of(method, 'hd95'), 2)} |")
    lines += ["", f"### {task_name}: FedIOD student Dice against each site's epsilon", "",
              "| epsilon per site (delta 1e-5) | noise multiplier | Dice | HD95 |", "|---|---|---|---|"]
    for e in preset.fediod_epsilons:
        label = eps_label(e)
        sigmas = [v["extra"]["noise_multiplier"] for k, v in rows.items() if k.method == label and "extra" in v]
        sigma = f"{float(np.mean([next(iter(s.values())) for s in sigmas])):.3g}" if sigmas else "–"
        lines.append(f"| {e:g} | {sigma} | {_fmt(of(label, 'dice'))} | {_fmt(of(label, 'hd95'), 2)} |")
    lines.append(f"| no DP (infinite) | 0 | {_fmt(of('fediod', 'dice'))} | {_fmt(of('fediod', 'hd95'), 2)} |")
    return lines
