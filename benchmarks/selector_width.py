"""Which selector width should FedSM default to? Routing, unseen-site detection, calibration and bytes per width.

For each task, seed and VGG-11 width (64 is the paper's), one ``fedsm simulate`` FedSM run with the
last site held out (leave-one-site-out): the selector trains on the other sites and the report gives

- **routing accuracy**: the share of the participating sites' test images the selector assigns to
  their own site (argmax; ``extra.selector_accuracy.overall``);
- **ECE** of its confidence on those images (``extra.selector.ece.participating``);
- **unseen to global**: the share of the held-out site's images routed to the global model at the
  run's gamma, by the selector alone and with the style gate (``routing_per_gamma``);
- **seen to own model** at that gamma (selector alone);
- FedSM's routed Dice on the participating sites, and the bytes a site receives and sends per
  round (mean over the run's rounds, the last one, in float32, included).

Each seed has its own synthetic data (data seed = training seed), shared by the widths.

    python benchmarks/selector_width.py --out runs/selector-width [--tasks fundus,prostate] [--seeds 0,1,2]
        [--widths 8,16,32,64] [--rounds 10] [--sites 5]

Writes ``OUT/selector_width.json`` (every run's figures) and ``OUT/selector_width.md`` (the table,
mean and per-seed values); runs already in ``OUT`` are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def _at_gamma(rows: list[dict[str, Any]], gamma: float) -> dict[str, Any]:
    return min(rows, key=lambda r: abs(float(r["gamma"]) - gamma))


def figures(report: dict[str, Any]) -> dict[str, float]:
    """The table's figures from one run's report.json."""
    fedsm = report["methods"]["fedsm"]
    extra = fedsm["extra"]
    sel = extra["selector"]
    row = _at_gamma(sel["routing_per_gamma"], float(sel["gamma"]))
    traffic = fedsm["bytes_per_round"].values()
    down = [t["received_mean"] for t in traffic]
    up = [t["sent_mean"] for t in traffic]
    return {
        "routing_accuracy": float(extra["selector_accuracy"]["overall"]),
        "ece": float(sel["ece"]["participating"]),
        "seen_own": float(row["seen"]["own_site"]),
        "unseen_global": float(row["unseen"]["global"]),
        "unseen_global_gated": float(row.get("unseen_gated", row["unseen"])["global"]),
        "dice": float(fedsm["client_average"]["mean"]),
        "mib_down": statistics.fmean(down) / 2**20,
        "mib_up": statistics.fmean(up) / 2**20,
        "wall_s": float(fedsm["wall_s"]),
    }


def run_one(task: str, seed: int, width: int, args: argparse.Namespace) -> dict[str, float]:
    from engine import api

    out = args.out / f"{task}-s{seed}-w{width}"
    report_path = out / "report.json"
    if not report_path.exists():
        started = time.perf_counter()
        api.simulate(out, task=task, sites=args.sites, rounds=args.rounds, methods=("fedsm",),
                     image_size=args.image_size, seed=seed, selector_width=width,
                     holdout_site=f"site{args.sites}", device="cpu", data_dir=str(args.out / f"data-{task}-s{seed}"))
        print(f"{task} seed {seed} width {width}: {time.perf_counter() - started:.0f} s", flush=True)
    return figures(json.loads(report_path.read_text()))


COLUMNS = (("routing_accuracy", "routing acc.", 3), ("ece", "ECE", 3), ("seen_own", "seen to own model", 3),
           ("unseen_global", "unseen to global (selector)", 3), ("unseen_global_gated", "unseen to global (gate)", 3),
           ("dice", "FedSM Dice", 4), ("mib_down", "MiB down", 2), ("mib_up", "MiB up", 2))


def table(results: dict[str, dict[str, float]], tasks: list[str], seeds: list[int], widths: list[int]) -> str:
    lines = ["| task | width | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for task in tasks:
        for width in widths:
            cells = []
            for key, _, digits in COLUMNS:
                values = [results[f"{task}-s{s}-w{width}"][key] for s in seeds]
                per_seed = " / ".join(f"{v:.{digits}f}" for v in values)
                cells.append(f"**{statistics.fmean(values):.{digits}f}** ({per_seed})" if len(values) > 1
                             else per_seed)
            lines.append(f"| {task} | {width} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", default="fundus,prostate")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--widths", default="8,16,32,64")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sites", type=int, default=5, help="sites generated; the last is held out")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    tasks = args.tasks.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {f"{t}-s{s}-w{w}": run_one(t, s, w, args) for t in tasks for s in seeds for w in widths}
    (args.out / "selector_width.json").write_text(json.dumps({"settings": {
        "rounds": args.rounds, "sites": args.sites, "image_size": args.image_size, "holdout": f"site{args.sites}"},
        "runs": results}, indent=1))
    text = (f"Selector width, leave-one-site-out (site{args.sites} held out), {args.rounds} rounds, "
            f"{args.image_size} px, seeds {args.seeds} (mean, then per seed)\n\n"
            + table(results, tasks, seeds, widths))
    (args.out / "selector_width.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
