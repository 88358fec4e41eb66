"""Does the direction check leave honest sites alone over a whole run, and keep a flipping site out of every round?

``cpu-converged``'s settings (6 sites of unequal size; fundus 64 px for 60 rounds, prostate 32 px for 150;
Dice + cross-entropy, cosine learning-rate decay to 1 %, best round by validation, the learning rate
FedAvg's tuning picked: 3e-3 fundus, 1e-3 prostate), the coordinator's ``[robust]`` defaults applied
through the simulation (the same code as ``fedsm server``), and one site (``--attacker``, default site6,
the largest) that is honest (``none``), sends its change reversed on every model part every round
(``flip``), or never answers (``absent``). Reported per run: client-average test Dice at the best round,
the honest site-rounds left out by direction, the rounds the attacker's answer was used in, and the last
round whose cosines counted as direction evidence (``engine.fl.robust.DirectionMemory``).

    python benchmarks/robust_long_runs.py --out runs/robust-long [--tasks fundus,prostate]
        [--methods fedavg,fedprox,fedsm] [--seeds 0,1,2] [--attacks none,flip,absent] [--rounds N]

Writes ``OUT/robust_long.json`` and ``OUT/robust_long.md``; runs already in ``OUT`` are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from robust_aggregation import attacked_simulation  # the same attacker as the cpu-small study

#: ``cpu-converged``'s tasks: image size, rounds, slices per volume, FedAvg's tuned learning rate
TASKS = {"fundus": (64, 60, None, 3e-3), "prostate": (32, 150, 6, 1e-3)}


def run_one(task: str, method: str, seed: int, attack: str, args: argparse.Namespace) -> dict[str, Any]:
    from engine.simulate import SimulationConfig

    size, rounds, slices, lr = TASKS[task]
    rounds = args.rounds or rounds
    out = args.out / f"{task}-{method}-s{seed}-{attack}"
    result_path = out / "result.json"
    if result_path.exists():
        return json.loads(result_path.read_text())
    AttackedSimulation = attacked_simulation(attack, args.attacker)
    cfg = SimulationConfig(task=task, sites=6, rounds=rounds, methods=(method,), image_size=size, seed=seed,
                           device="cpu", data_dir=str(args.out / f"data-{task}-s{seed}"), selector_width=16,
                           slices=slices, lr=lr, lr_schedule="cosine", lr_min_ratio=0.01, loss="dicece",
                           keep_best=True)
    started = time.perf_counter()
    sim = AttackedSimulation(cfg, out)
    sim.load_sites()
    result = sim.run_method(method)
    attacked = attack != "none"
    honest_out = [[r["round"], site] for r in result.rounds for site, why in r["failed"].items()
                  if "points against" in why and not (attacked and site == args.attacker)]
    figures = {"dice": float(result.client_average["mean"]), "wall_s": time.perf_counter() - started,
               "rounds": len(result.rounds), "honest_left_out": honest_out,
               "attacker_used": [r["round"] for r in result.rounds if attacked and args.attacker in r["answered"]],
               "last_counted": max([r["round"] for r in result.rounds
                                    if any((r.get("direction_judged") or {}).values())], default=0)}
    out.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(figures))
    print(f"{task} {method} seed {seed} {attack}: Dice {figures['dice']:.4f}, {len(honest_out)} honest site-rounds "
          f"left out, attacker used in {len(figures['attacker_used'])} rounds ({figures['wall_s']:.0f} s)", flush=True)
    return figures


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| task | method | seed | attack | Dice | honest site-rounds left out | rounds the attacker's answer "
             "was used in | last counted round |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        task, method, seed, attack = name.split("|")
        used = "-" if attack == "none" else f"{len(r['attacker_used'])} of {r['rounds']}"
        lines.append(f"| {task} | {method} | {seed} | {attack} | {r['dice']:.4f} | {len(r['honest_left_out'])} | "
                     f"{used} | {r['last_counted']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", default="fundus")
    parser.add_argument("--methods", default="fedavg")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--attacks", default="none,flip,absent")
    parser.add_argument("--attacker", default="site6")
    parser.add_argument("--rounds", type=int, default=0, help="0: cpu-converged's (60 fundus, 150 prostate)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {f"{t}|{m}|{s}|{a}": run_one(t, m, int(s), a, args)
               for t in args.tasks.split(",") for m in args.methods.split(",") for s in args.seeds.split(",")
               for a in args.attacks.split(",")}
    (args.out / "robust_long.json").write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                                           "runs": results}, indent=1))
    text = (f"Direction check over whole runs (cpu-converged settings, attacker {args.attacker}, product "
            "[robust] defaults)\n\n" + table(results))
    (args.out / "robust_long.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
