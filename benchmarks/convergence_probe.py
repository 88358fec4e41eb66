"""Convergence probe: validation Dice per round of FedAvg / centralized under one training recipe.

Used to find and document the convergence recipe (docs/results.md, "Convergence recipe").
Example::

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/convergence_probe.py --method fedavg --rounds 60 \
        --lr 1e-3 --schedule cosine --out /tmp/conv/fedavg.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def label_dice(task, weights, sites) -> dict:
    """Client-average validation Dice per structure."""
    import numpy as np

    from engine.fl.evaluation import dice_per_case, segment_with

    per = [dice_per_case(segment_with(task, weights, s.validation.images, "cpu"), s.validation.masks,
                         s.validation.case_ids).mean(0) for s in sites]
    return {f"val_{n}": float(np.mean([d[i] for d in per])) for i, n in enumerate(task.label_names)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--task", default="fundus")
    p.add_argument("--sites", type=int, default=6)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--slices", type=int, default=12)
    p.add_argument("--method", default="fedavg")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", default="constant")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--loss", default=None, help="segmentation loss (dice, dicece); default: the engine's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="/tmp/conv/data")
    p.add_argument("--every", type=int, default=1, help="evaluate every N rounds")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)

    from engine.bench.bench_simulation import BenchSimulation, CurveRecorder
    from engine.bench.jobs import load_task_sites
    from engine.bench.presets import BenchPreset, TaskPreset
    from engine.simulate import SimulationConfig

    tp = TaskPreset(a.task, sites=a.sites, image_size=a.image_size, rounds=a.rounds, slices=a.slices)
    preset = BenchPreset(name="probe", tasks=(tp,))
    sites = load_task_sites(preset, tp, Path(a.data))
    extra = {"lr_schedule": a.schedule} if a.schedule != "constant" else {}
    if a.loss:
        extra["loss"] = a.loss
    cfg = SimulationConfig(task=a.task, sites=a.sites, rounds=a.rounds, methods=(a.method,),
                           image_size=a.image_size, seed=a.seed, epochs=a.epochs, batch_size=a.batch_size,
                           lr=a.lr, device="cpu", **extra)
    sim = BenchSimulation(cfg, Path(a.data) / "work", sites)
    rec = CurveRecorder(sim.task, sites, "cpu")
    every = a.every

    def hook(method, rnd, state, runtimes):
        if rnd % every == 0 or rnd == a.rounds:
            rec(method, rnd, state, runtimes)
            pt = rec.points[-1]
            if "global" in state:
                pt |= label_dice(sim.task, state["global"], sites)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in pt.items()}
                             | {"t": round(time.perf_counter() - t0, 1)}), flush=True)

    sim.round_hook = hook
    t0 = time.perf_counter()
    result = sim.run_method(a.method)
    out = {"args": vars(a), "curve": rec.points, "test_client_average": result.client_average,
           "wall_s": time.perf_counter() - t0}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("test", result.client_average, "wall", round(out["wall_s"], 1))


if __name__ == "__main__":
    main()
