"""Does the selector's BatchNorm explain its held-out accuracy? Post-hoc, on a leave-one-site-out run.

The reference selector trains with each site's own batch statistics (``--selector-bn batch``) and
is evaluated with the federation-averaged running statistics. This script scores the same trained
selector four ways, on the participating sites' test images (seen) and all held-out site images
(unseen), at gamma 0.6 and at the validation-chosen gamma (``--gamma auto``, 95% pass):

- ``bundle``: eval mode with the bundle's running statistics (what inference does);
- ``re-estimated mean`` / ``re-estimated pooled``: running statistics recomputed per site with a
  train-mode pass over the site's training images (cumulative average), then combined as the
  sample-weighted mean of means and variances, or as the pooled mixture variance
  ``sum_k w_k (var_k + mu_k^2) - mu^2`` (both computable from per-site aggregates);
- ``per-case batch statistics``: each case's images normalised by their own statistics (a
  volume's slices, or a single photo), as in training.

A temperature folded into the bundle's last layer (``--selector-calibration temperature``) is
undone first, so every line is the trained selector at T = 1. It also prints, per site,
eval-mode and train-mode accuracy on every split.

    python benchmarks/selector_bn.py --run RUN_DIR --data DATA_DIR [--holdout site6]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.bundle import load_bundle
from engine.data.preprocess import resize_images
from engine.data.site_data import load_site
from engine.fl.selector_gamma import gamma_from_histogram, own_site_histogram
from engine.fl.selector_training import expected_calibration_error
from engine.inference.predictor import SuperModelPredictor
from engine.tasks import get_task

SPLITS = ("train", "validation", "test")


def _bns(net: torch.nn.Module) -> list[torch.nn.modules.batchnorm._BatchNorm]:
    return [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def _probs(net: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return torch.softmax(net(x), 1).numpy()


def _per_case_net(base: torch.nn.Module) -> torch.nn.Module:
    net = copy.deepcopy(base).eval()
    for m in _bns(net):  # normalise with the batch's own statistics, keep nothing
        m.train()
        m.track_running_stats = False
        m.running_mean = None
        m.running_var = None
    return net


def _site_statistics(base: torch.nn.Module, x: torch.Tensor, batch: int = 8) -> tuple[list, list]:
    net = copy.deepcopy(base)
    for m in _bns(net):
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the pass
    net.train()
    with torch.no_grad():
        for start in range(0, len(x), batch):
            if len(x[start:start + batch]) > 1:
                net(x[start:start + batch])
    return [m.running_mean.clone() for m in _bns(net)], [m.running_var.clone() for m in _bns(net)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="output folder of fedsm simulate --holdout-site")
    parser.add_argument("--data", type=Path, required=True, help="its data folder")
    parser.add_argument("--holdout", default=None, help="held-out site (default: the run's)")
    parser.add_argument("--pass-fraction", type=float, default=0.95)
    args = parser.parse_args()
    torch.set_num_threads(1)

    report = json.loads((args.run / "report.json").read_text())
    holdout = args.holdout or report["config"]["holdout_site"]
    bundle = load_bundle(args.run / "supermodel.safetensors")
    meta = bundle.metadata
    base = SuperModelPredictor(bundle, "cpu").selector.eval()
    folded = float(meta.extra.get("selector_temperature", 1.0))
    if folded != 1.0:  # --selector-calibration temperature divided the last layer by T: undo it (T = 1 below)
        last = base.classifier[-1]
        with torch.no_grad():
            last.weight.mul_(folded)
            last.bias.mul_(folded)
    task = get_task(meta.task)
    names = list(meta.site_names)
    sites = {n: load_site(args.data / n / "datalist.json", task, report["config"]["image_size"])
             for n in [*names, holdout]}

    def x_of(images: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(resize_images(images, meta.selector_size))

    for mode in ("eval", "train"):
        print(f"{mode}-mode accuracy per site (" + ("running statistics" if mode == "eval" else
                                                    "each split's own batch statistics") + ")")
        for k, n in enumerate(names):
            net = base if mode == "eval" else _per_case_net(base)
            cells = []
            for split in SPLITS:
                pred = _probs(net, x_of(getattr(sites[n], split).images)).argmax(1)
                cells.append(f"{split} {np.mean(pred == k):.2f} {np.bincount(pred, minlength=len(names)).tolist()}")
            print(f"  {n}: " + "; ".join(cells))

    def score(label: str, net: torch.nn.Module, per_case: bool = False) -> None:
        def probs(split: Any) -> np.ndarray:
            if not per_case:
                return _probs(net, x_of(split.images))
            return np.concatenate([_probs(net, x_of(split.images[split.case_ids == c]))
                                   for c in np.unique(split.case_ids)])

        def stack(split: str) -> tuple[np.ndarray, np.ndarray]:
            p = [probs(getattr(sites[n], split)) for n in names]
            return np.concatenate(p), np.concatenate([np.full(len(q), k) for k, q in enumerate(p)])

        pt, yt = stack("test")
        pv, yv = stack("validation")
        pu = np.concatenate([probs(getattr(sites[holdout], s)) for s in SPLITS])
        gamma = gamma_from_histogram(own_site_histogram(pv, yv)[0], args.pass_fraction, len(names))
        line = (f"{label}: accuracy {np.mean(pt.argmax(1) == yt):.3f} (validation {np.mean(pv.argmax(1) == yv):.3f}), "
                f"ECE {expected_calibration_error(pt, yt):.3f}, median confidence seen {np.median(pt.max(1)):.3f} "
                f"unseen {np.median(pu.max(1)):.3f}")
        for g in (0.6, gamma):
            sure = pt.max(1) > g
            line += (f"; gamma {g:.2f}: seen to own {np.mean(sure & (pt.argmax(1) == yt)):.2f}, "
                     f"unseen to global {np.mean(pu.max(1) <= g):.2f}")
        print(line)

    print(f"run {args.run} ({meta.task}, held out {holdout})"
          + (f"; the bundle's temperature {folded:g} undone (T = 1)" if folded != 1.0 else ""))
    score("bundle", base)
    stats = [_site_statistics(base, x_of(sites[n].train.images)) for n in names]
    w = np.array([len(sites[n].train.images) for n in names], dtype=np.float64)
    w /= w.sum()
    for kind in ("mean", "pooled"):
        net = copy.deepcopy(base)
        for i, m in enumerate(_bns(net)):
            mu = sum(wk * s[0][i] for wk, s in zip(w, stats, strict=True))
            if kind == "mean":
                var = sum(wk * s[1][i] for wk, s in zip(w, stats, strict=True))
            else:
                var = sum(wk * (s[1][i] + s[0][i] ** 2) for wk, s in zip(w, stats, strict=True)) - mu ** 2
            m.running_mean.copy_(mu)
            m.running_var.copy_(var)
        score(f"re-estimated {kind}", net.eval())
    score("per-case batch statistics", _per_case_net(base), per_case=True)


if __name__ == "__main__":
    main()
