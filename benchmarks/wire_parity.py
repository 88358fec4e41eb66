"""Does 16-bit on the wire change what a federation learns? Dice and routing, float32 against bfloat16.

Runs ``fedsm simulate`` (in-process, the product's defaults otherwise) once per seed and wire
precision with the same data, and reports per seed the client-average test Dice of FedAvg and of
FedSM's super model and its global model, the share of test images FedSM routes to their own
site's personalized model, and the bfloat16 - float32 differences. The rounding perturbs training
a little (the masters stay float32 at both ends, engine/fl/wire_precision.py); the question is
whether the perturbation is within the run-to-run spread of the seeds.

    python benchmarks/wire_parity.py --out runs/wire-parity [--seeds 0,1,2] [--rounds 10] [--sites 3]
        [--image-size 64] [--task fundus]

Writes ``OUT/wire_parity.json`` and ``OUT/wire_parity.md``; runs already in ``OUT`` are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

PRECISIONS = ("float32", "bfloat16")


def own_share(routing: dict[str, dict[str, float]]) -> float:
    """Mean over sites of the share of a site's test images routed to its own personalized model."""
    return statistics.fmean(freq.get(site, 0.0) for site, freq in routing.items())


def run_one(args: argparse.Namespace, seed: int, precision: str) -> dict[str, float]:
    from engine import api

    out = args.out / f"s{seed}-{precision}"
    report = out / "report.json"
    if not report.exists():
        api.simulate(out, task=args.task, sites=args.sites, rounds=args.rounds, methods=("fedavg", "fedsm"),
                     image_size=args.image_size, seed=seed, device="cpu", wire_precision=precision)
    methods = json.loads(report.read_text())["methods"]
    fedsm = methods["fedsm"]
    return {"fedavg": methods["fedavg"]["client_average"]["mean"],
            "fedsm": fedsm["client_average"]["mean"],
            "fedsm_global": fedsm["extra"]["components"]["global_only"]["client_average"]["mean"],
            "fedsm_own": own_share(fedsm["extra"]["routing"]),
            "fedsm_mib_down": statistics.fmean(s["received_mean"] for s in fedsm["bytes_per_round"].values()) / 2**20}


def table(results: dict[str, dict[str, float]], seeds: list[int]) -> str:
    keys = (("fedavg", "FedAvg Dice"), ("fedsm", "FedSM Dice"), ("fedsm_global", "FedSM global Dice"),
            ("fedsm_own", "FedSM routed to own"), ("fedsm_mib_down", "FedSM MiB down"))
    lines = ["| seed | " + " | ".join(f"{title}: fp32 / bf16 / diff" for _, title in keys) + " |",
             "|---|" + "---|" * len(keys)]
    diffs: dict[str, list[float]] = {k: [] for k, _ in keys}
    for seed in seeds:
        a, b = results[f"s{seed}-float32"], results[f"s{seed}-bfloat16"]
        cells = []
        for key, _ in keys:
            diffs[key].append(b[key] - a[key])
            cells.append(f"{a[key]:.4f} / {b[key]:.4f} / {b[key] - a[key]:+.4f}")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    lines.append("| mean diff | " + " | ".join(f"{statistics.fmean(diffs[k]):+.4f}" for k, _ in keys) + " |")
    spread = {k: statistics.pstdev(results[f"s{s}-float32"][k] for s in seeds) for k, _ in keys}
    lines.append("| fp32 spread over seeds (std) | " + " | ".join(f"{spread[k]:.4f}" for k, _ in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--task", default="fundus")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {f"s{s}-{p}": run_one(args, s, p) for s in seeds for p in PRECISIONS}
    (args.out / "wire_parity.json").write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                                           "runs": results}, indent=1))
    text = (f"Wire precision parity: `fedsm simulate --task {args.task} --sites {args.sites} --rounds {args.rounds} "
            f"--image-size {args.image_size} --methods fedavg,fedsm`, seeds {args.seeds}, client-average test Dice\n\n"
            + table(results, seeds))
    (args.out / "wire_parity.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
