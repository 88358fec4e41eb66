"""Leave-one-site-out study of the site-style gate's threshold rules, on the data alone.

The gate (``engine.fl.style_gate``) depends only on the sites' images, not on training, so its
leave-one-site-out routing can be measured without training anything: for each data seed this
script writes (or reuses) the synthetic federation ``fedsm simulate`` would write, fits the gate
from the participating sites' training images, sets each rule's threshold from their validation
images, and routes the participating sites' test images (seen) and all of the left-out site's
images (unseen) by style. A run meets the issue-15 targets when at least 80% of seen images go to
their own site's model and at least 80% of unseen images go to the global model.

Rules compared (distances are squared Mahalanobis distances to the nearest site mean):

``median``
    The engine's rule until the leave-one-case-out change: ``SITE_MARGIN`` x the median over sites
    of each site's own 95% quantile of its validation distances.
``predictive``
    The same rule on distances divided by ``1 + 1/m_k``, where ``m_k`` is the number of training
    cases (volumes or photos) of the nearest site: a new case's distance to a mean estimated from
    ``m_k`` cases is inflated by about that factor, so small sites are no longer cut by the median
    of the large ones.
``spread``
    Distances divided by the nearest site's own spread (its training scatter against the pooled
    precision, ``trace(P S_k) / d``): noisy sites get a wider boundary.
``predictive+spread``
    Both.
``conformal``
    The engine's server rule since that change (``threshold_from_histograms``: the median over
    sites of each site's conformal bound, ``SITE_MARGIN`` x its largest distance where it has too
    few) on the validation distances alone.
``loo``
    The engine's rule on what a site sent from that change until 891cb49: its validation images'
    distances and each training image's distance under the gate refitted without its case, times
    ``(m^2 - 1) / m^2``; images judged one by one.
``loo+nearest``
    ``loo``, and an image also counts as unlike every site when it lies beyond its nearest site's own
    conformal bound (the threshold at each image is the smaller of the two). Measured, not adopted:
    docs/results.md, "The gate at 32 px and the nearest site's own bound".
``loo/case``
    The engine's rule since 891cb49 (``calibration_distances``): ``loo`` on whole cases, a volume's
    distance being the mean of its slices' distances, at calibration (validation cases,
    leave-one-case-out training cases) and at routing (every slice of a volume goes where the
    volume's mean puts it). For photos (one image per case) it is ``loo``.

Example::

    python benchmarks/gate_study.py --task prostate --seeds 0-40 --data-root /tmp/gate-data
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from engine.data.site_data import load_site
from engine.data.synth import existing_federation, generate_federation
from engine.fl.cases import case_mean_rows
from engine.fl.style_gate import (
    DEFAULT_QUANTILE,
    SITE_MARGIN,
    calibration_distances,
    distance_histogram,
    fit_style_gate,
    histogram_quantile,
    leave_one_case_out_distances,
    site_threshold,
    style_descriptors,
    style_distances,
    style_statistics,
    threshold_from_histograms,
)
from engine.tasks import get_task

TARGET = 0.80


def parse_seeds(text: str) -> list[int]:
    """``"0-4,9"`` -> ``[0, 1, 2, 3, 4, 9]``."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


def federation(task: str, seed: int, root: Path, sites: int, size: int, slices: int) -> list[Path]:
    """The datalists of seed ``seed``'s synthetic federation, written under ``root`` when missing."""
    out = root / f"{task}{seed}"
    found = existing_federation(out, task, sites, size, seed, slices=slices)
    return found if found is not None else generate_federation(task, sites, out, image_size=size,
                                                               seed=seed, slices=slices)


def site_spread(stats: dict, precision: np.ndarray) -> float:
    """``trace(P S_k) / d``: the site's own scatter measured in the pooled metric (1 = average site)."""
    n = float(stats["count"][0])
    mean = stats["sum"].double().numpy() / n
    scatter = stats["outer"].double().numpy() - n * np.outer(mean, mean)
    return float(np.trace(precision @ scatter) / max(n - 1.0, 1.0) / len(mean))


def threshold(val_scores: list[np.ndarray]) -> float:
    """The engine's previous threshold rule on (possibly rescaled) validation distances, through the sites'
    histograms: ``SITE_MARGIN`` x the median over sites of each site's 95% quantile."""
    edges = [histogram_quantile(distance_histogram(s)["counts"].numpy(), DEFAULT_QUANTILE) for s in val_scores
             if len(s)]
    return float(SITE_MARGIN * np.median(edges)) if edges else float("inf")


def study(task_name: str, datalists: list[Path], size: int, holdout: int) -> dict[str, tuple[float, float]]:
    """Seen-own and unseen-to-global share per rule for one federation (site ``holdout`` left out)."""
    task = get_task(task_name)
    sites = [load_site(str(p), task, size) for p in datalists]
    part = [s for k, s in enumerate(sites) if k != holdout]
    stats = [style_statistics(s.train.images) for s in part]
    gate = fit_style_gate(stats)
    precision = gate["precision"].numpy()
    cases = np.array([len(set(s.train.case_ids.tolist())) for s in part], dtype=np.float64)
    spread = np.array([site_spread(st, precision) for st in stats])
    scalers = {"median": np.ones(len(part)), "predictive": 1.0 + 1.0 / cases, "spread": spread,
               "predictive+spread": spread * (1.0 + 1.0 / cases)}
    # every participating site sent statistics, so the gate's routing indices are positions in `part`
    val = [style_distances(style_descriptors(s.validation.images), gate) for s in part]
    test = [style_distances(style_descriptors(s.test.images), gate) for s in part]
    u = sites[holdout]
    unseen_images = np.concatenate([x.images for x in (u.train, u.validation, u.test) if len(x.images)])
    ud, uk = style_distances(style_descriptors(unseen_images), gate)
    out = {}
    for rule, scale in scalers.items():
        thr = threshold([d / scale[k] for d, k in val])
        own = np.concatenate([(k == j) & (d / scale[k] <= thr) for j, (d, k) in enumerate(test)])
        out[rule] = (float(own.mean()), float((ud / scale[uk] > thr).mean()))
    # loo: the engine's rule before it judged cases, per image (validation images, then each training image
    # under the gate refitted without its case)
    hists = {"conformal": [distance_histogram(d) for d, _ in val],
             "loo": [distance_histogram(np.concatenate([
                 d, leave_one_case_out_distances(style_descriptors(s.train.images), s.train.case_ids, gate, k)]))
                 for k, ((d, _), s) in enumerate(zip(val, part, strict=True))]}
    for rule, h in hists.items():
        thr = threshold_from_histograms(h, DEFAULT_QUANTILE)
        own = np.concatenate([(k == j) & (d <= thr) for j, (d, k) in enumerate(test)])
        out[rule] = (float(own.mean()), float((ud > thr).mean()))
    # loo, and no image beyond its nearest site's own bound either (the bound each site's histogram gives)
    thr = threshold_from_histograms(hists["loo"], DEFAULT_QUANTILE)
    bounds = np.minimum(thr, [site_threshold(h["counts"].numpy(), DEFAULT_QUANTILE) for h in hists["loo"]])
    own = np.concatenate([(k == j) & (d <= bounds[k]) for j, (d, k) in enumerate(test)])
    out["loo+nearest"] = (float(own.mean()), float((ud > bounds[uk]).mean()))
    # loo/case: the engine's rule since 891cb49, a volume judged whole by its slices' mean distance
    case_hists = [distance_histogram(calibration_distances(gate, k, s.train.images, s.train.case_ids,
                                                           s.validation.images, s.validation.case_ids))
                  for k, s in enumerate(part)]
    thr = threshold_from_histograms(case_hists, DEFAULT_QUANTILE)
    own = np.concatenate([(k == j) & (case_mean_rows(d, s.test.case_ids) <= thr)
                          for j, ((d, k), s) in enumerate(zip(test, part, strict=True))])
    unseen_cases = np.concatenate([x.case_ids + 100_000 * i for i, x in enumerate((u.train, u.validation, u.test))
                                   if len(x.images)])
    out["loo/case"] = (float(own.mean()), float((case_mean_rows(ud, unseen_cases) > thr).mean()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("fundus", "prostate"), required=True)
    ap.add_argument("--seeds", default="0-40", help="data seeds, e.g. 0-14,21 (default 0-40)")
    ap.add_argument("--data-root", type=Path, required=True, help="folder for the seeds' synthetic data")
    ap.add_argument("--sites", type=int, default=6)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--slices", type=int, default=6, help="prostate slices per volume (default 6)")
    ap.add_argument("--json", type=Path, help="also write every seed's figures here")
    args = ap.parse_args(argv)
    rows = {}
    for seed in parse_seeds(args.seeds):
        lists = federation(args.task, seed, args.data_root, args.sites, args.image_size, args.slices)
        rows[seed] = study(args.task, lists, args.image_size, holdout=args.sites - 1)
        cells = "  ".join(f"{r} {s:.2f}/{u:.2f}" for r, (s, u) in rows[seed].items())
        print(f"{args.task} seed {seed}: {cells}", flush=True)
    print(f"\n{args.task}, seeds {args.seeds}: runs meeting both targets (seen own >= {TARGET}, unseen global "
          f">= {TARGET}); worst seen / worst unseen; mean seen / mean unseen")
    for rule in next(iter(rows.values())):
        seen = np.array([r[rule][0] for r in rows.values()])
        unseen = np.array([r[rule][1] for r in rows.values()])
        met = int(((seen >= TARGET) & (unseen >= TARGET)).sum())
        print(f"  {rule:18s} {met:3d} / {len(rows)}   worst {seen.min():.2f} / {unseen.min():.2f}   "
              f"mean {seen.mean():.2f} / {unseen.mean():.2f}")
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in rows.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
