"""Which jobs a benchmark preset expands into, and how the report names them and the machine.

Read by the runner (what to run), the report and its tables (what to show), below all three.
"""

from __future__ import annotations

from typing import Any

from engine.bench.bench_simulation import effective_lam, sweep_lam
from engine.bench.cache import JobKey
from engine.bench.fediod_bench import plan_fediod_jobs
from engine.bench.presets import BenchPreset
from engine.bench.tuning import tune_jobs

#: Pseudo-task of jobs that cover no single task.
ALL_TASKS = "all"


def lam_label(lam: float) -> str:
    """Method name of a lam-sweep job, e.g. ``lam0.30``."""
    return f"lam{lam:.2f}"


def plan_jobs(preset: BenchPreset) -> list[JobKey]:
    """Every job of ``preset`` in the order they run."""
    jobs: list[JobKey] = []
    if preset.perf:
        jobs.append(JobKey(ALL_TASKS, "perf", "perf", 0))
    jobs += tune_jobs(preset)  # before everything that trains with the chosen learning rates
    for seed in preset.seeds:
        for tp in preset.tasks:
            jobs += [JobKey(tp.task, "main", m, seed) for m in preset.methods]
    for seed in preset.rule_seeds:
        for tp in preset.tasks:
            jobs += [JobKey(tp.task, "personalization", f"fedsm-{k}", seed) for k in preset.personalizations]
    for seed in preset.analysis_seeds if preset.unseen_analysis else ():
        for tp in preset.tasks:
            jobs += [JobKey(tp.task, "unseen", m, seed) for m in ("fedsm", "fedavg")]
    for seed in preset.analysis_seeds:
        for tp in preset.tasks:
            main_lam = effective_lam(tp.lam, tp.sites)
            for lam in preset.lam_values:
                # the main run already trained FedSM with this lam and seed (sweep values below 1/K
                # are trained as given, the main runs' lam is raised to 1/K: see jobs.sweep_lam)
                if abs(sweep_lam(lam) - main_lam) < 1e-9 and seed in preset.seeds:
                    continue
                jobs.append(JobKey(tp.task, "lam", lam_label(lam), seed))
    for seed in preset.split_seeds:
        for tp in preset.tasks:
            if tp.task in preset.split_tasks:
                jobs += [JobKey(tp.task, "blackfed", m, seed) for m in preset.split_methods]

    return jobs + plan_fediod_jobs(preset)


def machine_label(machine: dict[str, Any] | None) -> str:
    """One-line description of a :func:`machine_info` dict (without the load, which changes by the minute)."""
    if not machine:
        return "machine not recorded"
    gpu = f" ({machine['gpu']})" if machine.get("gpu") else ""
    return (f"{machine.get('platform')}, {machine.get('processor')}, {machine.get('cpu_count')} CPU cores visible, "
            f"torch {machine.get('torch')} with {machine.get('torch_threads')} thread(s), "
            f"device {machine.get('device')}{gpu}")
