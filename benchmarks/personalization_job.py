"""Run one of a preset's personalization-inside-FedSM jobs with the current code, outside the cache.

The benchmark cache keys every job by the engine's source, so after an engine change the runner
redoes the learning-rate tuning before anything else. This script runs one personalization job
(the paper's Table 6) with exactly the settings the preset gives it and FedSM's learning rate as
tuned earlier (pass it), on the benchmark's own synthetic data, and prints routed / oracle /
global Dice. Used for the pFedMe fix in docs/results.md ("The analyses").

Example::

    OMP_NUM_THREADS=1 python benchmarks/personalization_job.py --task fundus --kind pfedme --lr 3e-3 \\
        --bench-dir runs/bench-cpu-converged --out /tmp/pfedme-fundus.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine.bench.bench_simulation import JobContext
from engine.bench.cache import JobKey
from engine.bench.jobs import load_task_sites, run_job
from engine.bench.presets import PRESETS
from engine.fl.personalization import PERSONALIZATIONS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-converged", choices=sorted(PRESETS))
    ap.add_argument("--task", choices=("fundus", "prostate"), required=True)
    ap.add_argument("--kind", choices=PERSONALIZATIONS, required=True)
    ap.add_argument("--lr", type=float, required=True, help="FedSM's tuned learning rate for this task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bench-dir", type=Path, required=True, help="the benchmark's --out (its data/ is reused)")
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the job's result")
    a = ap.parse_args()
    torch.set_num_threads(1)
    preset = PRESETS[a.preset]
    tp = preset.task(a.task)
    sites = load_task_sites(preset, tp, a.bench_dir)
    ctx = JobContext(preset, tp, sites, a.out.parent / "work", device="cpu", lr_for={"fedsm": a.lr})
    result = run_job(ctx, JobKey(a.task, "personalization", f"fedsm-{a.kind}", a.seed))
    a.out.write_text(json.dumps(result, default=str), encoding="utf-8")
    comp = result["extra"]["components"]
    print(f"{a.task} {a.kind} seed {a.seed}: routed {result['client_average']['mean']:.4f}, "
          f"oracle {comp['personal_oracle']['client_average']['mean']:.4f}, "
          f"global alone {comp['global_only']['client_average']['mean']:.4f}")


if __name__ == "__main__":
    main()
