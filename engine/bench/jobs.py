"""One benchmark job: train one method (or analysis variant) with one seed and evaluate it.

Jobs reuse :class:`engine.simulate.Simulation` (the code behind ``fedsm simulate``), so the
benchmark measures exactly what users run: same methods, same in-process transport, same
evaluation. The sites are loaded once per task and handed to every job; data is generated once
with the preset's ``data_seed`` and the job's seed varies initialisation and batch order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from engine.bench.bench_simulation import (
    BenchSimulation,
    CurveRecorder,
    JobContext,
    lam_of,
    method_result,
    sweep_lam,
)
from engine.bench.cache import JobKey, code_version
from engine.bench.fediod_bench import fediod_settings, run_fediod_job
from engine.bench.presets import BenchPreset, TaskPreset
from engine.bench.routing_analysis import gamma_sweep
from engine.bench.split_table import split_compute
from engine.bench.tuning import TUNE, parse_tune_label, tuned_method
from engine.data.site_data import load_site
from engine.data.synth import existing_federation, generate_federation
from engine.device import resolve_device
from engine.errors import ConfigError
from engine.fl.blackfed import BlackFedConfig
from engine.fl.evaluation import dice_per_case, segment_with
from engine.fl.personalization import PersonalizationConfig
from engine.tasks import get_task

log = logging.getLogger(__name__)

ProgressFn = Callable[[dict[str, Any]], None]

#: Analyses, in the order the runner does them (``tune``: :mod:`engine.bench.tuning`; ``fediod``:
#: :mod:`engine.bench.fediod_bench`).
ANALYSES = ("tune", "main", "lam", "unseen", "personalization", "blackfed", "fediod")


def load_task_sites(preset: BenchPreset, tp: TaskPreset, out_dir: Path,
                    progress: ProgressFn | None = None, data_seed: int | None = None) -> list[Any]:
    """Reuse or generate the task's synthetic federation and load it.

    ``data_seed`` (default: the preset's fixed one) picks the draw: ``OUT/data/<task>`` for the
    preset's fixed data seed, ``OUT/data/<task>-data<seed>`` where each seed has its own data.
    """
    seed = preset.data_seed_for(0) if data_seed is None else int(data_seed)
    folder = tp.task if preset.data_seed is not None else f"{tp.task}-data{seed}"
    data_dir = Path(out_dir) / "data" / folder
    paths = existing_federation(data_dir, tp.task, tp.sites, tp.image_size, seed, slices=tp.slices)
    if paths is None:
        if progress:
            progress({"event": "status", "message": f"generating synthetic {tp.task} data ({tp.sites} sites, "
                                                    f"{tp.image_size} px, data seed {seed}) in {data_dir}"})
        paths = generate_federation(tp.task, tp.sites, data_dir, image_size=tp.image_size, seed=seed,
                                    slices=tp.slices)
    task = get_task(tp.task)
    return [load_site(p, task, tp.image_size) for p in paths]


def resolved_device(device: str) -> str:
    """The device a job really runs on (``"cpu"``, ``"cuda"``, ``"cuda:1"``), never ``"auto"``."""
    dev, _ = resolve_device(device)
    return str(dev)


def job_settings(preset: BenchPreset, tp: TaskPreset, key: JobKey, device: str,
                 lr_for: dict[str, float] | None = None) -> dict[str, Any]:
    """The settings that determine a job's result (a cached result must match them).

    ``device`` is recorded resolved (``"auto"`` becomes ``"cpu"`` or ``"cuda"``), and the code
    version (:func:`engine.bench.cache.code_version`) is part of the settings, so a result made
    by other code, other torch/MONAI/numpy versions or on another kind of device is not reused.
    """
    settings: dict[str, Any] = {
        "task": asdict(tp), "data_seed": preset.data_seed_for(key.seed), "device": resolved_device(device),
        "training": {"epochs": preset.epochs, "batch_size": preset.batch_size, "lr": preset.lr,
                     "selector_lr": preset.selector_lr, "selector_size": preset.selector_size,
                     "gamma": preset.gamma, "prox_mu": preset.prox_mu, "lr_schedule": preset.lr_schedule,
                     "lr_min_ratio": preset.lr_min_ratio, "loss": preset.loss, "keep_best": preset.keep_best},
        "code": code_version(),
    }

    if key.analysis == TUNE:
        settings["training"]["lr"] = parse_tune_label(key.method)[1]
        settings["tune_rounds"] = preset.tune_rounds or tp.rounds
    elif lr_for and tuned_method(key) in lr_for:
        settings["training"]["lr"] = lr_for[tuned_method(key)]
    if key.method.startswith("fedsm") or key.analysis != "main":
        settings["gammas"] = list(preset.gammas)
    if key.analysis == "lam":
        settings["softpull_lam"] = sweep_lam(lam_of(key.method))
    if key.analysis == "unseen":
        settings["unseen_site"] = preset.unseen_site
    if key.analysis == "blackfed":
        settings["blackfed"] = asdict(BlackFedConfig())
        settings["keep_best"] = False
    if key.analysis == "fediod":
        settings["fediod"] = fediod_settings(preset, key)
    if key.analysis == "personalization":
        settings["personalization"] = asdict(PersonalizationConfig())
    return settings


# --------------------------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------------------------
def _train(ctx: JobContext, sites: list[Any], method: str, seed: int, lam: float | None = None,
           curves: bool = True, lr: float | None = None,
           rounds: int | None = None) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Train and evaluate ``method``; return its result, its super model (FedSM) and final state.

    With the preset's ``keep_best`` the curves are the best-round keeper's validation scores
    (computed anyway); otherwise a :class:`CurveRecorder` computes them.
    """
    sim = BenchSimulation(ctx.config(seed, len(sites), lam, lr, rounds), ctx.out_dir, sites, ctx.progress,
                          ctx.cancel, softpull_lam=lam)
    keep = ctx.preset.keep_best
    recorder = CurveRecorder(sim.task, sites, ctx.device, enabled=curves and not keep)
    sim.round_hook = recorder
    start = time.perf_counter()
    result = sim.run_method(method)
    out = method_result(result)
    out["wall_s"] = time.perf_counter() - start
    out["lr"] = sim.cfg.lr
    keeper = sim.last_keeper
    if keeper is not None:
        out["validation_s"] = keeper.eval_s
    if curves:
        out["curves"] = keeper.points if keep and keeper is not None else recorder.points
    state = keeper.final_state if keep and keeper is not None and keeper.final_state else recorder.last_state
    return out, result.extra.get("bundle"), state


def run_job(ctx: JobContext, key: JobKey) -> dict[str, Any]:
    """Run one job and return its JSON-ready result."""
    task = get_task(ctx.tp.task)
    names = [s.name for s in ctx.sites]
    if key.analysis == TUNE:
        method, lr = parse_tune_label(key.method)
        out, _, _ = _train(ctx, ctx.sites, method, key.seed, lr=lr, rounds=ctx.preset.tune_rounds or ctx.tp.rounds)
        return out
    lr = ctx.lr_for.get(tuned_method(key))
    if key.analysis == "main":
        out, bundle, _ = _train(ctx, ctx.sites, key.method, key.seed, lr=lr)
        if key.method == "fedsm" and bundle is not None:
            out["gamma_sweep"] = gamma_sweep(task, bundle, [(s.name, s.test) for s in ctx.sites], ctx.preset.gammas,
                                             ctx.device, own_model={n: i + 1 for i, n in enumerate(names)})
        return out
    if key.analysis == "lam":
        lam = sweep_lam(lam_of(key.method))
        out, _, _ = _train(ctx, ctx.sites, "fedsm", key.seed, lam=lam, curves=False, lr=lr)
        out["lam"] = lam
        out["lam_used"] = float(out["extra"]["lam"])  # what SoftPull used, as the simulation recorded it
        return out
    if key.analysis == "unseen":
        held = ctx.preset.unseen_site - 1
        if not 0 <= held < len(ctx.sites):
            raise ConfigError(f"unseen_site={ctx.preset.unseen_site} is not one of the {len(ctx.sites)} sites")
        train_sites = [s for i, s in enumerate(ctx.sites) if i != held]
        unseen = ctx.sites[held]
        out, bundle, state = _train(ctx, train_sites, key.method, key.seed, curves=False, lr=lr)
        out["unseen_site"] = unseen.name
        if key.method == "fedsm" and bundle is not None:
            own = {s.name: i + 1 for i, s in enumerate(train_sites)}
            out["unseen"] = gamma_sweep(task, bundle, [(unseen.name, unseen.test)], ctx.preset.gammas, ctx.device)
            out["participating"] = gamma_sweep(task, bundle, [(s.name, s.test) for s in train_sites],
                                               ctx.preset.gammas, ctx.device, own_model=own)
        else:
            masks = segment_with(task, state["global"], unseen.test.images, ctx.device)
            out["unseen_dice"] = float(dice_per_case(masks, unseen.test.masks, unseen.test.case_ids).mean())
        return out
    if key.analysis == "personalization":
        out, _, _ = _train(ctx, ctx.sites, key.method, key.seed, curves=False, lr=lr)
        return out
    if key.analysis == "blackfed":
        # every method at its last round: BlackFed has no best-round selection
        fair = replace(ctx, preset=replace(ctx.preset, keep_best=False))
        out, _, _ = _train(fair, ctx.sites, key.method, key.seed, curves=False)
        out["compute"] = split_compute(task, ctx.tp.image_size)
        return out
    if key.analysis == "fediod":
        return run_fediod_job(ctx, key)

    raise ConfigError(f"unknown benchmark analysis {key.analysis!r}; choose from {', '.join(ANALYSES)}")
