"""Post-hoc "does the selector know what it has not seen?" analysis of a leave-one-site-out run.

Takes the super model and data of a ``fedsm simulate --holdout-site NAME`` run and measures,
on the same trained selector, what the field's two post-hoc remedies would give, each computed
only from statistics a federation can aggregate (no image or per-image feature leaves a site):

- a validation-chosen gamma (``--gamma auto``, :mod:`engine.fl.selector_gamma`): the largest
  gamma that the given share of the recognised participating validation images pass, without
  and with temperature scaling;
- temperature scaling: the temperature minimising the NLL summed over the participating sites'
  validation images (what ``--selector-calibration temperature`` fits from NLL sums per grid
  point);
- Mahalanobis distance (Lee et al., NeurIPS 2018) on the selector's pooled backbone features
  (512-d) and penultimate features (256-d): class means and a shared, shrunk covariance from the
  sites' training features (the count / sum / outer-product statistics the LDA calibration
  already aggregates); an image is "unseen" when its distance to the nearest class mean exceeds
  the given quantile of the participating sites' validation distances (a histogram of distances
  would carry it); the nearest class is then its site.

Reported per remedy: routing of the participating sites' test images (own site / global) and of
all held-out site images (global), with gamma for the softmax and the quantile for the distance.

    python benchmarks/selector_ood.py --run RUN_DIR --data DATA_DIR [--holdout site6] [--gammas 0.6 0.9]
        [--pass-fractions 0.95]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from engine.bundle import load_bundle
from engine.data.preprocess import resize_images
from engine.data.site_data import load_site
from engine.fl.selector_gamma import gamma_from_histogram, own_site_histogram
from engine.fl.selector_training import TEMPERATURE_GRID, expected_calibration_error
from engine.inference.predictor import SuperModelPredictor
from engine.tasks import get_task


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _features(selector: torch.nn.Module, images: np.ndarray, size: int) -> tuple[np.ndarray, ...]:
    x = torch.from_numpy(resize_images(images, size))
    with torch.inference_mode():
        pooled = selector.pool(selector.features(x))
        penult = selector.classifier[:-1](pooled)
        logits = selector.classifier[-1](penult)
    return pooled.flatten(1).double().numpy(), penult.double().numpy(), logits.double().numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="output folder of fedsm simulate --holdout-site")
    parser.add_argument("--data", type=Path, required=True, help="its data folder")
    parser.add_argument("--holdout", default=None, help="held-out site (default: the run's)")
    parser.add_argument("--gammas", type=float, nargs="+", default=[0.6, 0.9])
    parser.add_argument("--quantiles", type=float, nargs="+", default=[0.95, 0.9])
    parser.add_argument("--shrinkage", type=float, default=0.1)
    parser.add_argument("--pass-fractions", type=float, nargs="+", default=[0.9, 0.95],
                        help="validation-chosen gamma (--gamma auto): share of validation images that must pass")
    args = parser.parse_args()
    torch.set_num_threads(1)

    report = json.loads((args.run / "report.json").read_text())
    holdout = args.holdout or report["config"]["holdout_site"]
    bundle = load_bundle(args.run / "supermodel.safetensors")
    meta = bundle.metadata
    selector = SuperModelPredictor(bundle, "cpu").selector.eval()
    task = get_task(meta.task)
    sites = {s.name: s for s in (load_site(p, task, report["config"]["image_size"])
                                 for p in sorted(args.data.glob("site*/datalist.json")))}
    names = meta.site_names
    feats = {(n, split): _features(selector, getattr(s, split).images, meta.selector_size)
             for n, s in sites.items() for split in ("train", "validation", "test")}

    def stack(split: str, which: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.concatenate([feats[(n, split)][which] for n in names])
        y = np.concatenate([np.full(len(feats[(n, split)][which]), k) for k, n in enumerate(names)])
        return x, y

    unseen = {w: np.concatenate([feats[(holdout, s)][w] for s in ("train", "validation", "test")]) for w in range(3)}
    zv, yv = stack("validation", 2)
    zt, yt = stack("test", 2)
    zu = unseen[2]
    # a run with --selector-calibration temperature folded 1/T into the last layer: undo it, so that
    # "T=1" below is the trained selector and the fitted T is fitted afresh
    folded = float(meta.extra.get("selector_temperature", 1.0))
    zv, zt, zu = zv * folded, zt * folded, zu * folded

    def nll(t: float) -> float:
        p = _softmax(zv / t)
        return float(-np.log(p[np.arange(len(yv)), yv] + 1e-300).sum())

    t_best = min(TEMPERATURE_GRID, key=nll)
    print(f"run {args.run} ({meta.task}, held out {holdout}): {len(zt)} seen test images, {len(zu)} unseen images"
          + (f"; the bundle's temperature {folded:g} undone" if folded != 1.0 else "")
          + (f"; the bundle's gamma {meta.gamma:g} (chosen: {meta.extra['gamma_choice']})"
             if "gamma_choice" in meta.extra else ""))
    for t in (1.0, t_best):
        pt, pu = _softmax(zt / t), _softmax(zu / t)
        fitted = " (fitted on validation NLL)" if t != 1.0 else ""
        print(f"softmax T={t:g}{fitted}: ECE {expected_calibration_error(pt, yt):.3f}, "
              f"median confidence seen {np.median(pt.max(1)):.3f} unseen {np.median(pu.max(1)):.3f}")
        for g in args.gammas:
            sure = pt.max(1) > g
            print(f"  gamma {g:g}: seen to own site {(sure & (pt.argmax(1) == yt)).mean():.2f}, seen to global "
                  f"{(~sure).mean():.2f}; unseen to global {(pu.max(1) <= g).mean():.2f}")
        pv = _softmax(zv / t)
        for q in args.pass_fractions:
            g = gamma_from_histogram(own_site_histogram(pv, yv)[0], q, len(names))
            sure = pt.max(1) > g
            print(f"  gamma auto (pass {q:g} of recognised validation images) = {g:.2f}: seen to own site "
                  f"{(sure & (pt.argmax(1) == yt)).mean():.2f}, seen to global {(~sure).mean():.2f}; "
                  f"unseen to global {(pu.max(1) <= g).mean():.2f}")
    for which, label in ((0, "pooled 512-d"), (1, "penultimate 256-d")):
        x, y = stack("train", which)
        mu = np.stack([x[y == k].mean(0) for k in range(len(names))])
        cov = sum((x[y == k] - mu[k]).T @ (x[y == k] - mu[k]) for k in range(len(names))) / max(len(x) - len(names), 1)
        dim = cov.shape[0]
        prec = np.linalg.inv((1 - args.shrinkage) * cov + args.shrinkage * np.trace(cov) / dim * np.eye(dim))

        def score(f: np.ndarray, mu: np.ndarray = mu, prec: np.ndarray = prec) -> tuple[np.ndarray, np.ndarray]:
            d = np.stack([np.einsum("nd,de,ne->n", f - m, prec, f - m) for m in mu], 1)
            return d.min(1), d.argmin(1)

        sv, _ = score(stack("validation", which)[0])
        st, nearest = score(stack("test", which)[0])
        su, _ = score(unseen[which])
        for q in args.quantiles:
            thr = np.quantile(sv, q)
            print(f"Mahalanobis {label}, threshold = {q:g} quantile of seen validation distances: seen to own site "
                  f"{((st <= thr) & (nearest == yt)).mean():.2f}, seen to global {(st > thr).mean():.2f}; "
                  f"unseen to global {(su > thr).mean():.2f}")


if __name__ == "__main__":
    main()
