"""Which selector width should FedSM default to? Routing, unseen-site detection, calibration and bytes per width.

FedSM's model selector alone, trained as FedSM trains it by default (the reference scheme: one pass
and one Adam step per site and round, weights and Adam moments averaged, 16-bit on the wire through
the in-process transport), on synthetic sites with the last site held out (leave-one-site-out), for
each task, seed (own data per seed) and VGG-11 width (64 is the paper's). Reported:

- **routing accuracy**: the share of the participating sites' test images assigned to their own
  site (argmax);
- **ECE** of the top-1 confidence on those images;
- **seen to own model**: the share of those images routed to their own site's model at gamma
  (confidence above gamma and the right site);
- **unseen to global**: the share of the held-out site's images whose confidence is at most gamma;
- the same two shares **through the product's routing path** (``gated``): the site-style gate fitted
  from the participating sites' training images and its threshold from their calibration
  histograms (quantile 0.95), then ``site_routing = "auto"``'s choice between the selector and the
  gate's nearest site on the participating sites' validation images
  (:mod:`engine.fl.routing_choice`), the way a FedSM bundle routes; and which rule ``auto`` chose;
- **MiB each way** per site and round (the selector and its two Adam moments as they travel);
- wall seconds of the training.

    python benchmarks/selector_width.py --out runs/selector-width [--tasks fundus,prostate] [--seeds 0,1,2]
        [--widths 8,16,32,64] [--rounds 60] [--sites 5] [--gamma 0.6] [--selector-lr LR]

Writes ``OUT/selector_width.json`` and ``OUT/selector_width.md`` (mean, then per seed); runs already
in ``OUT`` are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.bench.tables import mean_and_per_seed


def selector_only_method(task: Any, site_names: list[str], training: Any, seed: int, rounds: int) -> Any:
    """FedSM's selector training alone, as a :class:`engine.fl.methods.FederatedMethod` (its server and site
    halves are FedSM's: the same initial weights, rounds and aggregation)."""
    import numpy as np

    from engine.fl.aggregation import fedavg
    from engine.fl.methods import OPTIM_PART, FederatedMethod, SiteUpdate, derived_seed
    from engine.fl.methods.contract import SiteInstructions
    from engine.fl.selector_training import initial_optimizer_state, reference_selector_round
    from engine.models import build_selector

    class SelectorOnly(FederatedMethod):
        name = "fedsm-selector"

        def initial_state(self) -> dict[str, Any]:
            return {"selector": self._initial_selector(len(self.site_names)),
                    OPTIM_PART: initial_optimizer_state(build_selector(
                        self.task.in_channels, len(self.site_names), self.training.selector_head,
                        self.training.selector_width))}

        def site_instructions(self, state: Mapping[str, Any], rnd: int, site: str) -> Any:
            return SiteInstructions(rnd, {"selector": state["selector"], OPTIM_PART: state[OPTIM_PART]})

        def expected_update_shapes(self, state: Mapping[str, Any], site: str) -> dict[str, Any]:
            return {"selector": state["selector"], OPTIM_PART: state[OPTIM_PART]}

        def aggregate(self, state: Mapping[str, Any], rnd: int, updates: Mapping[str, Any]) -> dict[str, Any]:
            return {part: fedavg([(u.weights[part], u.num_samples) for u in updates.values()])
                    for part in ("selector", OPTIM_PART)}

        def train_at_site(self, instructions: Any, site: Any, progress: Any = None, cancel: Any = None) -> Any:
            w = instructions.weights
            seed_ = derived_seed(self._site_seed(instructions.round, site), "selector")
            sel, optim, metrics = reference_selector_round(
                self.task, w["selector"], w[OPTIM_PART], np.full(len(site.train.images), site.index),
                len(self.site_names), site.train.images, self.training, seed_,
                self._context(instructions.round, site, progress, cancel))
            return SiteUpdate({"selector": sel, OPTIM_PART: optim}, len(site.train.images), metrics)

    return SelectorOnly(task, site_names, training, seed, rounds)


def product_routing(seen: list[Any], unseen: Any, seen_test_p: Any, unseen_p: Any, probs: Any,
                    gamma: float) -> dict[str, float]:
    """Seen-to-own and unseen-to-global through the gate and ``auto``'s rule, as a FedSM bundle routes.

    ``seen_test_p`` / ``unseen_p`` are the selector's probabilities on the participating sites' test
    images (in site order) and on every image of the held-out site; ``probs`` maps images to them.
    """
    import numpy as np

    from engine.fl.routing_choice import choose_site_routing, style_routing_statistics
    from engine.fl.style_gate import (
        calibration_distances,
        distance_histogram,
        fit_style_gate,
        route_by_style,
        style_descriptors,
        style_distances,
        style_statistics,
        threshold_from_histograms,
    )
    from engine.inference.routing import route_fedsm

    gate = fit_style_gate([style_statistics(s.train.images) for s in seen])
    threshold = threshold_from_histograms([distance_histogram(calibration_distances(
        gate, k, s.train.images, s.train.case_ids, s.validation.images)) for k, s in enumerate(seen)], 0.95)

    def nearest_outside(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each image's nearest site (1..K) under the gate, and whether it lies beyond the threshold."""
        distance, nearest = style_distances(style_descriptors(images), gate)
        return nearest + 1, distance > threshold

    # auto: the share of validation images each rule routes to their own site's model (the gate in front of both)
    own_selector, scored = 0.0, 0.0
    style_counts = []
    for k, s in enumerate(seen):
        val = s.validation.images if len(s.validation.images) else s.train.images
        own_selector += float((route_fedsm(probs(val), gamma) == k + 1).sum())
        nearest, _ = nearest_outside(val)
        style_counts.append(style_routing_statistics(nearest - 1, k))
        scored += len(val)
    style = choose_site_routing(own_selector / scored, style_counts)["style"] > 0.5

    def routed(p: np.ndarray, images: np.ndarray) -> np.ndarray:
        """Each image's routed model as a bundle picks it: 1..K a site's, 0 the global one."""
        nearest, outside = nearest_outside(images)
        return np.where(outside, 0, route_by_style(nearest, outside) if style else route_fedsm(p, gamma))

    test_images = np.concatenate([s.test.images for s in seen])
    labels = np.concatenate([np.full(len(s.test.images), k + 1) for k, s in enumerate(seen)])
    unseen_images = np.concatenate([unseen.train.images, unseen.validation.images, unseen.test.images])
    return {"gated_seen_own": float((routed(seen_test_p, test_images) == labels).mean()),
            "gated_unseen_global": float((routed(unseen_p, unseen_images) == 0).mean()),
            "auto_style": float(style)}


def run_one(task_name: str, seed: int, width: int, args: argparse.Namespace) -> dict[str, float]:
    import numpy as np

    from engine.data.site_data import load_site
    from engine.data.synth import existing_federation, generate_federation
    from engine.federation.inprocess import run_rounds
    from engine.fl.local_training import LocalTrainingConfig
    from engine.fl.methods import SiteRuntime
    from engine.fl.selector_schemes import default_selector_lr
    from engine.fl.selector_training import expected_calibration_error, selector_logits
    from engine.tasks import get_task

    out = args.out / f"{task_name}-s{seed}-w{width}.json"
    if out.exists():
        return json.loads(out.read_text())
    task = get_task(task_name)
    data_dir = args.out / f"data-{task_name}-s{seed}"
    size = args.image_size
    datalists = (existing_federation(data_dir, task_name, args.sites, size, seed)
                 or generate_federation(task_name, args.sites, data_dir, image_size=size, seed=seed))
    loaded = [load_site(p, task, size) for p in datalists]
    seen, unseen = loaded[:-1], loaded[-1]
    training = LocalTrainingConfig(device="cpu", selector_width=width,
                                   selector_lr=default_selector_lr("none", args.selector_lr, width))
    names = [s.name for s in seen]
    method = selector_only_method(task, names, training, seed, args.rounds)
    runtimes = [SiteRuntime(s.name, k, s.train) for k, s in enumerate(seen)]
    started = time.perf_counter()
    state, records = run_rounds(method, runtimes, args.rounds)
    wall = time.perf_counter() - started

    def probs(images: np.ndarray) -> np.ndarray:
        logits = selector_logits(task, state["selector"], len(names), images, training).numpy()
        e = np.exp(logits - logits.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    seen_p = [probs(s.test.images) for s in seen]
    labels = np.concatenate([np.full(len(p), k) for k, p in enumerate(seen_p)])
    p = np.concatenate(seen_p)
    unseen_p = probs(np.concatenate([unseen.train.images, unseen.validation.images, unseen.test.images]))
    per_round = [statistics.fmean(r.bytes_to_site.values()) for r in records]
    gated = product_routing(seen, unseen, p, unseen_p, probs, args.gamma)
    figures = {
        "routing_accuracy": float((p.argmax(1) == labels).mean()),
        "ece": float(expected_calibration_error(p, labels)),
        "seen_own": float(((p.argmax(1) == labels) & (p.max(1) > args.gamma)).mean()),
        "unseen_global": float((unseen_p.max(1) <= args.gamma).mean()),
        **gated,
        "mib_each_way": statistics.fmean(per_round) / 2**20,
        "wall_s": wall,
    }
    out.write_text(json.dumps(figures))
    print(f"{task_name} seed {seed} width {width}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()),
          flush=True)
    return figures


COLUMNS = (("routing_accuracy", "routing acc.", 3), ("ece", "ECE", 3), ("seen_own", "seen to own model", 3),
           ("unseen_global", "unseen to global", 3), ("gated_seen_own", "gated: seen to own", 3),
           ("gated_unseen_global", "gated: unseen to global", 3), ("auto_style", "auto chose style", 2),
           ("mib_each_way", "MiB each way", 2), ("wall_s", "train s", 0))


def table(results: dict[str, dict[str, float]], tasks: list[str], seeds: list[int], widths: list[int]) -> str:
    lines = ["| task | width | " + " | ".join(c[1] for c in COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for task in tasks:
        for width in widths:
            cells = []
            for key, _, digits in COLUMNS:
                cells.append(mean_and_per_seed([results[f"{task}-s{s}-w{width}"][key] for s in seeds], digits))
            lines.append(f"| {task} | {width} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", default="fundus,prostate")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--widths", default="8,16,32,64")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--sites", type=int, default=5, help="sites generated; the last is held out")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--gamma", type=float, default=0.6)
    parser.add_argument("--selector-lr", type=float, default=None,
                        help="default: the reference scheme's for the width (1e-3 at 64, 3e-3 narrower)")
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
        k: str(v) for k, v in vars(args).items()}, "runs": results}, indent=1))
    text = (f"Selector width, FedSM's selector alone (reference scheme), leave-one-site-out (site{args.sites} held "
            f"out), {args.rounds} rounds, {args.image_size} px sites, gamma {args.gamma}, seeds {args.seeds} "
            "(mean, then per seed)\n\n" + table(results, tasks, seeds, widths))
    (args.out / "selector_width.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
