"""Which robust aggregation should be the default? Honest Dice and Dice under a persistent in-bound attacker.

One site (``--attacker``, default site1) answers every round with its honest change times ×5 (inside
``max_relative_update = 10``) or times −1 (a sign flip), on every model part it sends (global,
personalized, selector); ``absent``: it answers nothing (the run without its data, which is where
leaving an attacker out ends). The coordinator screens and aggregates with each candidate ``[robust]``
setting (the simulation applies them as a network coordinator does):

- ``mean``: the method's own weighted mean (no clipping);
- ``clip1``, ``clip2``: each part's change clipped to 1× / 2× the round's median change norm, then the mean;
- ``median``: the coordinate-wise median of the global model and the selector;
- ``default``: the product's defaults: clip2, and a site whose change of a shared model points against the
  others' (cosine with their coordinate-wise median below ``min_cosine``) left out of the round.

For each, the client-average test Dice of the method (FedAvg: its global model; FedSM: the routed super
model), on a ``cpu-small`` task (6 sites of unequal size; fundus 48 px, 6 rounds; prostate 32 px, 5
rounds), seeds 0-2, each seed with its own synthetic data.

    python benchmarks/robust_aggregation.py --out runs/robust [--task fundus|prostate] [--methods fedavg,fedsm]
        [--seeds 0,1,2] [--rules mean,clip1,clip2,median,default] [--attacks none,x5,flip,absent]

Writes ``OUT/robust.json`` and ``OUT/robust.md``; runs already in ``OUT`` are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from engine.bench.tables import mean_and_per_seed

#: ``min_cosine = -1`` turns the direction check off, so each norm rule is measured alone; ``default`` is the
#: product's ``[robust]`` defaults (clip 2 and the direction check, engine.fl.robust).
RULES = {"mean": {"clip": 0.0, "min_cosine": -1.0}, "clip1": {"clip": 1.0, "min_cosine": -1.0},
         "clip2": {"clip": 2.0, "min_cosine": -1.0},
         "median": {"aggregation": "median", "clip": 0.0, "min_cosine": -1.0}, "default": {}}
#: ``absent``: the attacker's site answers nothing in any round (the run without its data: the best that leaving
#: an attacker out can reach).
ATTACKS: dict[str, float | None] = {"none": None, "x5": 5.0, "flip": -1.0, "absent": None}
#: cpu-small's tasks: image size, rounds, slices per volume (engine/bench/presets.py)
TASKS = {"fundus": (48, 6, None), "prostate": (32, 5, 6)}
#: Parts a site's answer carries models in (engine.fl.robust.NORM_PARTS without Scaffold's control).
MODEL_PARTS = ("global", "personal", "selector")


class Attacker:
    """Wraps a method: ``site``'s answer is its honest change times ``factor`` on every model part, or, with
    ``factor=None``, no answer at all (the site fails every round and is left out)."""

    def __init__(self, method: Any, site: str, factor: float | None) -> None:
        self._method, self._site, self._factor = method, site, factor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._method, name)

    def train_at_site(self, instructions: Any, site: Any, progress: Any = None, cancel: Any = None) -> Any:
        from engine.fl.methods import SiteUpdate

        if site.name == self._site and self._factor is None:
            from engine.errors import FedSMError

            raise FedSMError(f"{site.name} is absent in this run")
        update = self._method.train_at_site(instructions, site, progress, cancel)
        if site.name != self._site:
            return update
        weights = dict(update.weights)
        for part in MODEL_PARTS:
            if part in weights and part in instructions.weights:
                ref, new = instructions.weights[part], weights[part]
                weights[part] = {k: ref[k] + self._factor * (v - ref[k]) if v.dtype.is_floating_point else v
                                 for k, v in new.items()}
        return SiteUpdate(weights, update.num_samples, update.metrics)


def attacked_simulation(attack: str, attacker: str) -> type:
    """A :class:`~engine.simulate.Simulation` whose ``attacker`` site answers as ``attack`` says (:data:`ATTACKS`;
    ``none``: honestly)."""
    from engine.simulate import Simulation

    class AttackedSimulation(Simulation):
        def _build_method(self, name: str) -> Any:
            built = super()._build_method(name)
            return built if attack == "none" else Attacker(built, attacker, ATTACKS[attack])

    return AttackedSimulation


def run_one(method: str, seed: int, rule: str, attack: str, args: argparse.Namespace) -> dict[str, float]:
    from engine.simulate import SimulationConfig

    out = args.out / f"{method}-s{seed}-{rule}-{attack}"
    result_path = out / "result.json"
    if result_path.exists():
        return json.loads(result_path.read_text())
    AttackedSimulation = attacked_simulation(attack, args.attacker)
    size, rounds, slices = TASKS[args.task]
    cfg = SimulationConfig(task=args.task, sites=6, rounds=args.rounds or rounds, methods=(method,), image_size=size,
                           seed=seed, device="cpu", robust=RULES[rule], data_dir=str(args.out / f"data-s{seed}"),
                           selector_width=args.selector_width, slices=slices)
    started = time.perf_counter()
    sim = AttackedSimulation(cfg, out)
    sim.load_sites()
    result = sim.run_method(method)
    figures = {"dice": float(result.client_average["mean"]), "wall_s": time.perf_counter() - started}
    out.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(figures))
    print(f"{method} seed {seed} {rule} {attack}: Dice {figures['dice']:.4f} ({figures['wall_s']:.0f} s)", flush=True)
    return figures


def table(results: dict[str, dict[str, float]], methods: list[str], seeds: list[int], rules: list[str],
          attacks: list[str]) -> str:
    compared = [a for a in attacks if a != "none"] if "none" in attacks else []
    headers = [f"{a} Dice" for a in attacks] + [f"{a} − honest" for a in compared]
    lines = ["| method | rule | " + " | ".join(headers) + " |", "|---|---|" + "---|" * len(headers)]
    for method in methods:
        for rule in rules:
            def dice(attack: str, method: str = method, rule: str = rule) -> list[float]:
                return [results[f"{method}-s{s}-{rule}-{attack}"]["dice"] for s in seeds]

            cells = [mean_and_per_seed(dice(a)) for a in attacks]
            if "none" in attacks:
                for a in attacks:
                    if a == "none":
                        continue
                    diffs = [x - h for x, h in zip(dice(a), dice("none"), strict=True)]
                    cells.append(mean_and_per_seed(diffs, signed=True).replace("**", ""))
            lines.append(f"| {method} | {rule} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", default="fedavg")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--attacker", default="site1")
    parser.add_argument("--task", choices=sorted(TASKS), default="fundus")
    parser.add_argument("--rounds", type=int, default=0, help="0: cpu-small's (6 fundus, 5 prostate)")
    parser.add_argument("--selector-width", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    methods, rules, attacks = args.methods.split(","), args.rules.split(","), args.attacks.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {f"{m}-s{s}-{r}-{a}": run_one(m, s, r, a, args)
               for m in methods for s in seeds for r in rules for a in attacks}
    (args.out / "robust.json").write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                                      "runs": results}, indent=1))
    size, rounds, _ = TASKS[args.task]
    text = (f"Robust aggregation, {args.task}, 6 sites, {size} px, {args.rounds or rounds} rounds, attacker "
            f"{args.attacker}, seeds "
            f"{args.seeds} (mean, then per seed; client-average test Dice)\n\n"
            + table(results, methods, seeds, rules, attacks))
    (args.out / "robust.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
