"""The whole ``fedsm bench`` run: plan the jobs, run what is not cached, write the report.

Order of work (so an interrupted run has the most useful part done): the performance figures
(minutes), the main comparison seed by seed over both tasks, then the personalization
alternatives, the unseen site and the lam sweep. Every finished job is cached
(:mod:`engine.bench.cache`); a rerun skips it unless ``fresh``. The report is regenerated from
whatever the cache holds, so a partial run still yields tables that say what is missing.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from engine.bench.bench_simulation import JobContext
from engine.bench.cache import JobKey, ResultCache
from engine.bench.jobs import job_settings, load_task_sites, run_job
from engine.bench.perf import measure_all, perf_settings
from engine.bench.plan import ALL_TASKS, plan_jobs
from engine.bench.presets import get_preset, restrict_preset
from engine.bench.report import write_report
from engine.bench.tuning import TUNE, chosen_lrs
from engine.errors import CancelledError
from engine.fl.local_training import Device
from engine.io.atomic import write_text_atomic

log = logging.getLogger(__name__)

ProgressFn = Callable[[dict[str, Any]], None]
def _load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_info(device: str, threads: int) -> dict[str, Any]:
    """Where the benchmark ran (recorded in the report and in every job's cache entry)."""
    dev = Device.resolve(device)
    load = _load_average()
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": threads, "device": str(dev.torch_device), "mixed_precision": dev.amp,
            "gpu": torch.cuda.get_device_name(0) if dev.torch_device.type == "cuda" else None,
            "load_average_at_start": load}


def run_benchmark(preset_name: str, out_dir: Path, *, fresh: bool = False, device: str = "auto",
                  threads: int = 1, docs_dir: Path | None = None, command: str | None = None,
                  progress: ProgressFn | None = None, cancel: Callable[[], bool] | None = None,
                  tasks: tuple[str, ...] | None = None, seeds: tuple[int, ...] | None = None,
                  main_only: bool = False, methods: tuple[str, ...] | None = None,
                  no_analyses: bool = False, rules_only: bool = False) -> dict[str, Any]:
    """Run (or resume) a benchmark and write its report.

    Parameters
    ----------
    preset_name
        ``tiny``, ``cpu-small`` or ``paper`` (:mod:`engine.bench.presets`).
    out_dir
        Folder for data, cached results (``results/``), events and the report (``report/``).
    fresh
        Ignore and overwrite cached results.
    threads
        Torch intra-op threads (recorded in the report).
    docs_dir
        Also write ``results.md`` and ``img/results/*.png`` there (the repository's ``docs``).
    command
        The command line recorded in the report.
    tasks, seeds, main_only, methods, no_analyses, rules_only
        Run a reduced version (:func:`engine.bench.presets.restrict_preset`).

    Returns
    -------
    dict
        Summary: jobs run, skipped and failed, wall time, report paths.
    """
    preset = restrict_preset(get_preset(preset_name), tasks, seeds, main_only, methods, no_analyses, rules_only)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(int(threads), 1))
    cache = ResultCache(out_dir / "results")
    jobs = plan_jobs(preset)
    machine = machine_info(device, threads)
    started = time.perf_counter()
    summary: dict[str, Any] = {"preset": preset.name, "ran": [], "cached": [], "failed": {}}
    contexts: dict[tuple[str, int], JobContext] = {}  # per task and data seed

    def emit(event: dict[str, Any]) -> None:
        if progress:
            progress(event)

    def settings_for(key: JobKey) -> dict[str, Any]:
        if key.task == ALL_TASKS:
            return perf_settings(preset, device)
        return job_settings(preset, preset.task(key.task), key, device, lr_for=chosen_lrs_cached(key.task))

    def chosen_lrs_cached(task: str) -> dict[str, float]:
        """Learning rates chosen on validation so far (read from the cached tuning jobs)."""
        if not preset.lr_grid:
            return {}
        tp = preset.task(task)
        found = {}
        for k in jobs:
            if k.task == task and k.analysis == TUNE:
                doc = cache.load(k, job_settings(preset, tp, k, device))
                if doc is not None:
                    found[k] = doc["result"]
        return chosen_lrs(found, task, preset)

    for i, key in enumerate(jobs, start=1):
        if cancel is not None and cancel():
            raise CancelledError(f"benchmark cancelled before job {key.label}")
        tp = preset.task(key.task) if key.task != ALL_TASKS else None
        settings = settings_for(key)
        if not fresh and cache.load(key, settings) is not None:
            summary["cached"].append(key.label)
            continue
        emit({"event": "status", "message": f"[{i}/{len(jobs)}] {key.label}"})
        t0 = time.perf_counter()
        try:
            if tp is None:
                result = measure_all(preset, device)
            else:
                where = (tp.task, preset.data_seed_for(key.seed))
                if where not in contexts:
                    contexts[where] = JobContext(preset, tp, load_task_sites(preset, tp, out_dir, progress,
                                                                             data_seed=where[1]),
                                                 out_dir / "work", device, progress, cancel)
                contexts[where].lr_for = chosen_lrs_cached(tp.task)
                result = run_job(contexts[where], key)
        except CancelledError:
            raise
        except Exception as exc:  # one failed job must not cost the rest of an hour-long run
            log.exception("benchmark job %s failed", key.label)
            summary["failed"][key.label] = f"{type(exc).__name__}: {exc}"
            emit({"event": "error", "method": key.method, "message": f"{key.label} failed: {exc}"})
            continue
        result["job_wall_s"] = round(time.perf_counter() - t0, 2)
        cache.save(key, settings, result, provenance={
            "machine": machine, "finished": datetime.now(UTC).isoformat(timespec="seconds"),
            "load_average_at_finish": _load_average(), "command": command})
        summary["ran"].append(key.label)
        avg = result.get("client_average", {})
        if isinstance(avg, dict) and "mean" in avg:
            emit({"event": "method_end", "method": f"{key.task} {key.analysis} {key.method} seed {key.seed}",
                  "client_average": avg, "wall_s": result["job_wall_s"]})
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    meta = {"preset": preset.to_json(), "machine": machine, "command": command,
            "finished": datetime.now(UTC).isoformat(timespec="seconds"), "run": summary,
            "planned": [k.label for k in jobs]}
    report_paths, figures = write_report(cache, preset, meta, out_dir / "report", img_prefix="img",
                                         settings_for=settings_for)
    if docs_dir is not None:  # the same results: the run's report's plots are copied, not drawn again
        write_report(cache, preset, meta, Path(docs_dir), img_prefix="img/results", img_dir=Path(docs_dir) / "img"
                     / "results", settings_for=settings_for, preserve_reading=True, figures_of=figures)
        summary["docs"] = str(Path(docs_dir) / preset.docs_file)
    summary["report"] = str(report_paths)
    write_text_atomic(out_dir / "summary.json", json.dumps(meta, indent=1) + "\n")
    return summary
