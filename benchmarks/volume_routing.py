"""Routing a volume whole against routing its slices one by one, on trained `fedsm simulate` runs.

The super model's gate judges a prostate volume whole (its slices' mean style distance); until the
volume-level routing change the site a volume went to *inside* the gate was still picked per slice
(selector probability above gamma, or the nearest site), so one volume's slices could be segmented by
two models. This script reads finished runs (their `supermodel.safetensors` and `data/`) and, with
the engine it is run under, routes every site's test volumes and reports:

- the client-average test Dice (mean over sites of the mean per-case Dice, as `report.json`'s
  `client_average`, at the bundle's round: each run's best round by validation);
- per site, the shares of test slices routed to global, to the site's own model and to another
  site's model;
- the share of test volumes whose slices went to more than one model.

Run it once under the engine before the change and once after (the bundles and data are the same,
so only routing differs)::

    PYTHONPATH=OLD_CHECKOUT python benchmarks/volume_routing.py runs/pr1_apfl runs/pr2_apfl ...
    python benchmarks/volume_routing.py runs/pr1_apfl runs/pr2_apfl ...

``--no-guard`` turns the routing guard off, so the choice inside the gate is seen on every site;
``--site-routing selector|style`` replaces the rule the bundle chose (``auto``) inside the gate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from engine.bundle import load_bundle
from engine.data.site_data import load_site
from engine.fl.evaluation import dice_per_case
from engine.inference.predictor import SuperModelPredictor
from engine.tasks import get_task


def evaluate_run(run: Path, guard: bool = True, site_routing: str | None = None) -> dict[str, object]:
    """Routing and Dice of one run's super model on its sites' test splits.

    ``guard``: the routing guard on; ``site_routing``: the rule inside the gate (``None``: the bundle's).
    """
    federation = json.loads((run / "data" / "federation.json").read_text())
    task = get_task(federation["task"])
    bundle = load_bundle(run / "supermodel.safetensors")
    if site_routing is not None:
        bundle = dataclasses.replace(bundle, metadata=dataclasses.replace(bundle.metadata, site_routing=site_routing))
    predictor = SuperModelPredictor(bundle, device="cpu")
    names = list(bundle.metadata.site_names)
    size = bundle.metadata.image_size
    per_site: dict[str, dict[str, float]] = {}
    split = total = 0
    for k, datalist in enumerate(federation["datalists"]):
        site = load_site(run / "data" / datalist, task, size)
        test = site.test
        pred = predictor.predict(test.images, cases=test.case_ids, routing_guard=guard)
        routed = np.asarray(pred.routed)
        cases = np.unique(test.case_ids)
        split += sum(len(np.unique(routed[test.case_ids == c])) > 1 for c in cases)
        total += len(cases)
        per_site[names[k]] = {
            "dice": float(dice_per_case(pred.masks, test.masks, test.case_ids).mean()),
            "global": float((routed == 0).mean()),
            "own": float((routed == k + 1).mean()),
            "other": float(((routed != 0) & (routed != k + 1)).mean()),
        }
    return {"run": str(run), "client_avg": float(np.mean([s["dice"] for s in per_site.values()])),
            "split_volumes": f"{split}/{total}", "per_site": per_site}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished `fedsm simulate` output folders")
    parser.add_argument("--no-guard", action="store_true",
                        help="routing guard off: every personalized model may be chosen, so the rule inside "
                             "the gate shows (with the guard on, most prostate runs let one site through)")
    parser.add_argument("--site-routing", choices=("selector", "style"),
                        help="the rule inside the gate instead of the bundle's (its `auto` choice)")
    args = parser.parse_args()
    for run in args.runs:
        result = evaluate_run(run, guard=not args.no_guard, site_routing=args.site_routing)
        print(json.dumps(result))
        routed = ", ".join(f"{n} own {s['own']:.2f} global {s['global']:.2f} other {s['other']:.2f}"
                           for n, s in result["per_site"].items())  # type: ignore[union-attr]
        print(f"{run}: client-average Dice {result['client_avg']:.4f}, volumes split across models "
              f"{result['split_volumes']}; {routed}")


if __name__ == "__main__":
    main()
