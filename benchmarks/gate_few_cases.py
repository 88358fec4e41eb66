"""The site-style gate with few cases per site: seen pass rate and unseen-outside rate, before and after.

The gate (``engine.fl.style_gate``) depends only on the sites' images, so this script measures it
without training anything. Three ways to set the threshold:

``before``
    The engine until the leave-one-case-out change: each site's histogram holds its validation
    images' distances, or its training images' (to a mean and covariance fitted to them) when it
    has none; the threshold is ``SITE_MARGIN`` x the median over sites of their 95% quantiles.
``server``
    The same histograms under the engine's threshold rule since then (``threshold_from_histograms``:
    the median over sites of each site's conformal bound, ``SITE_MARGIN`` x its largest distance
    where it has too few): what the engine does until the last round sends the new histograms.
``after``
    The engine's rule on ``calibration_distances``: the validation images' distances and each
    training case's distance under the gate refitted without that case, times ``(m^2 - 1) / m^2``
    (``m`` training cases).

Reported per run: each participating site's *seen pass rate* (share of its own held-out test images
inside the gate, whichever site is nearest) and the *unseen-outside rate* (share of a
non-participating site's images outside the gate). Targets: seen >= 0.8 (pooled over the sites'
test images) and unseen >= 0.8.

Two tables, one command each::

    # real photos: ORIGA and Drishti-GS1 as two sites, prepared as docs/io.md "Your own data, step by
    # step" does (fedsm datalist --split 0.5,0.17,0.33 / 0.5,0,0.5 with --seed S, 128 px, --fundus-crop
    # auto); unseen: the RIM-ONE-r3 and two REFUGE photos of FedDG_demo_images_no_masks
    python benchmarks/gate_few_cases.py real --data ../shared/data --split-seeds 0-19

    # synthetic sites 1-5 with M training cases each (validation max(1, M // 2) cases, testing up to
    # 10 more), site 6 unseen; data written under DIR (fundus cases x2, prostate cases x4 so that
    # every site holds enough cases)
    python benchmarks/gate_few_cases.py synth --task fundus --cases 2,3,5,10 --seeds 0-9 --data-root DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gate_study import parse_seeds

from engine.data.datalist import outside_paths_allowed
from engine.data.datalist_builder import build_datalist
from engine.data.disc_crop import disc_box
from engine.data.preprocess import normalise_rgb, resize_images
from engine.data.site_data import SiteData, load_site
from engine.data.synth import existing_federation, generate_federation
from engine.fl.style_gate import (
    DEFAULT_QUANTILE,
    SITE_MARGIN,
    calibration_distances,
    distance_histogram,
    fit_style_gate,
    histogram_quantile,
    style_descriptors,
    style_distances,
    style_statistics,
    threshold_from_histograms,
)
from engine.io.readers import open_study
from engine.tasks import get_task

TARGET = 0.80
RULES = ("before", "server", "after")

#: The real-photo sites as docs/io.md builds them: folder, datalist split (training, validation, testing).
REAL_SITES = {"origa": ("fundus/ORIGA", (0.5, 0.17, 0.33)), "drishti": ("fundus/DrishtiGS1", (0.5, 0.0, 0.5))}
#: FedDG's demo photos, one per site of its benchmark (SOURCES.md); fundus_client1 (2050 x 1845) is
#: the Drishti-GS one: a new photo of a participating source, not an unseen site.
FEDDG = "fundus/FedDG_demo_images_no_masks"
FEDDG_DRISHTI = "fundus_client1.png"
REAL_SIZE = 128
#: Synthetic data: cases per site are the profile's times this, so site 1 holds at least 16.
CASES_SCALE = {"fundus": 2, "prostate": 4}
SYNTH_SIZE, SYNTH_SLICES, SYNTH_SITES, TEST_CASES = 64, 6, 6, 10


@dataclass
class Site:
    """A participating site's images: training (with case ids), validation and testing."""

    train: np.ndarray
    cases: np.ndarray
    validation: np.ndarray
    test: np.ndarray


def thresholds(sites: list[Site], gate: dict) -> dict[str, float]:
    """Each rule's threshold from the sites' histograms, as the federation's last round computes it."""
    before = []
    for s in sites:
        scored = s.validation if len(s.validation) else s.train
        before.append(distance_histogram(style_distances(style_descriptors(scored), gate)[0]))
    edges = [histogram_quantile(h["counts"].numpy(), DEFAULT_QUANTILE) for h in before]
    after = [distance_histogram(calibration_distances(gate, k, s.train, s.cases, s.validation))
             for k, s in enumerate(sites)]
    return {"before": float(SITE_MARGIN * np.median(edges)),
            "server": threshold_from_histograms(before, DEFAULT_QUANTILE),
            "after": threshold_from_histograms(after, DEFAULT_QUANTILE)}


def measure(sites: list[Site], unseen: np.ndarray, extra: dict[str, np.ndarray] | None = None) -> dict:
    """Seen pass rate per site (and pooled), unseen-outside rate, per rule."""
    gate = fit_style_gate([style_statistics(s.train) for s in sites])
    seen = [style_distances(style_descriptors(s.test), gate)[0] for s in sites]
    out_d = style_distances(style_descriptors(unseen), gate)[0]
    extra_d = {k: style_distances(style_descriptors(v), gate)[0] for k, v in (extra or {}).items()}
    # the best any threshold could do, chosen on these very test images: is the target reachable at all?
    pooled, candidates = np.concatenate(seen), np.r_[np.concatenate(seen), out_d, 0.0]
    rows: dict = {"oracle": {"pooled": max(min((pooled <= t).mean(), (out_d > t).mean()) for t in candidates),
                             "every_site": max(min(min((d <= t).mean() for d in seen), (out_d > t).mean())
                                               for t in candidates)}}
    for rule, thr in thresholds(sites, gate).items():
        rows[rule] = {"threshold": thr, "seen": [float((d <= thr).mean()) for d in seen],
                      "seen_pooled": float((np.concatenate(seen) <= thr).mean()),
                      "unseen_out": float((out_d > thr).mean()),
                      **{f"{k}_inside": float((d <= thr).mean()) for k, d in extra_d.items()}}
    return rows


def _photo(path: Path, size: int) -> np.ndarray:
    """A photo as training prepares it with ``--fundus-crop auto``: disc crop, rgb/255, resized."""
    rgb = np.asarray(open_study(path).array)
    box = disc_box(rgb.astype(np.uint8), "auto")
    if box is not None:
        rows, cols = box.slices()
        rgb = rgb[rows, cols]
    return resize_images(normalise_rgb(rgb)[None], size)


def _site(data: SiteData) -> Site:
    return Site(data.train.images, data.train.case_ids, data.validation.images, data.test.images)


def real_run(data: Path, split_seed: int, size: int = REAL_SIZE) -> dict:
    """One split of the real photos: ORIGA and Drishti as sites, FedDG's other photos unseen."""
    task = get_task("fundus")
    with tempfile.TemporaryDirectory() as tmp, outside_paths_allowed():
        sites = []
        for name, (folder, split) in REAL_SITES.items():
            out = Path(tmp) / name / "datalist.json"
            build_datalist(data / folder / "images", data / folder / "masks", out, split=split, seed=split_seed,
                           allow_outside=True)
            sites.append(_site(load_site(out, task, size, fundus_crop="auto")))
    photos = {p.name: _photo(p, size) for p in sorted((data / FEDDG).iterdir())}
    unseen = np.concatenate([v for k, v in photos.items() if k != FEDDG_DRISHTI])
    return measure(sites, unseen, {"feddg_drishti": photos[FEDDG_DRISHTI]})


def synth_sites(task: str, seed: int, root: Path) -> list[SiteData]:
    """The seed's synthetic federation (written under ``root`` when missing), loaded."""
    out = root / f"{task}{seed}x{CASES_SCALE[task]}"
    lists = existing_federation(out, task, SYNTH_SITES, SYNTH_SIZE, seed, slices=SYNTH_SLICES,
                                cases_scale=CASES_SCALE[task])
    if lists is None:
        lists = generate_federation(task, SYNTH_SITES, out, image_size=SYNTH_SIZE, seed=seed, slices=SYNTH_SLICES,
                                    cases_scale=CASES_SCALE[task])
    return [load_site(p, get_task(task), SYNTH_SIZE) for p in lists]


def _cases(data: SiteData) -> list[np.ndarray]:
    """Every case of a site (all three splits), each as its images."""
    return [split.images[split.case_ids == c] for split in (data.train, data.validation, data.test)
            for c in np.unique(split.case_ids)]


def synth_run(loaded: list[SiteData], seed: int, train_cases: int) -> dict:
    """Sites 1..K-1 re-split to ``train_cases`` training cases each (seeded); site K unseen."""
    sites = []
    for k, data in enumerate(loaded[:-1]):
        cases = _cases(data)
        order = np.random.default_rng([seed, k, train_cases]).permutation(len(cases))
        n_val = max(1, train_cases // 2)
        if len(cases) < train_cases + n_val + 1:
            raise SystemExit(f"site{k + 1} holds {len(cases)} cases, too few for {train_cases} training cases")
        train = [cases[i] for i in order[:train_cases]]
        sites.append(Site(np.concatenate(train), np.concatenate([np.full(len(c), i) for i, c in enumerate(train)]),
                          np.concatenate([cases[i] for i in order[train_cases:train_cases + n_val]]),
                          np.concatenate([cases[i] for i in order[train_cases + n_val:][:TEST_CASES]])))
    u = loaded[-1]
    unseen = np.concatenate([x.images for x in (u.train, u.validation, u.test) if len(x.images)])
    return measure(sites, unseen)


def summary(rows: list[dict], label: str) -> None:
    """Runs meeting both targets, mean / worst seen pass (pooled and worst site) and unseen-outside, per rule."""
    print(f"\n{label}: runs meeting both targets (seen pass >= {TARGET}, unseen outside >= {TARGET}); "
          "seen pass mean (worst run); worst site's seen pass, mean over runs; unseen outside mean (worst run)")
    for rule in RULES:
        seen = np.array([r[rule]["seen_pooled"] for r in rows])
        worst_site = np.array([min(r[rule]["seen"]) for r in rows])
        unseen = np.array([r[rule]["unseen_out"] for r in rows])
        met = int(((seen >= TARGET) & (unseen >= TARGET)).sum())
        print(f"  {rule:7s} {met:3d} / {len(rows)}   seen {seen.mean():.2f} ({seen.min():.2f})   worst site "
              f"{worst_site.mean():.2f}   unseen outside {unseen.mean():.2f} ({unseen.min():.2f})")
    pooled = np.array([r["oracle"]["pooled"] for r in rows])
    every = np.array([r["oracle"]["every_site"] for r in rows])
    print(f"  oracle  (one threshold chosen on the test images themselves) reaches both targets in "
          f"{int((pooled >= TARGET).sum())} / {len(rows)} runs, for every site separately in "
          f"{int((every >= TARGET).sum())} / {len(rows)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="table", required=True)
    real = sub.add_parser("real", help="ORIGA and Drishti-GS1 as two sites, FedDG's other photos unseen")
    real.add_argument("--data", type=Path, required=True, help="the shared data folder (holds fundus/)")
    real.add_argument("--split-seeds", default="0", help="datalist split seeds, e.g. 0-19 (default 0, docs/io.md)")
    synth = sub.add_parser("synth", help="synthetic sites with few training cases")
    synth.add_argument("--task", choices=("fundus", "prostate"), required=True)
    synth.add_argument("--cases", default="2,3,5,10", help="training cases per site (default 2,3,5,10)")
    synth.add_argument("--seeds", default="0-9", help="data seeds (default 0-9)")
    synth.add_argument("--data-root", type=Path, required=True, help="folder for the seeds' synthetic data")
    for p in (real, synth):
        p.add_argument("--json", type=Path, help="also write every run's figures here")
    args = ap.parse_args(argv)
    out: dict[str, dict] = {}
    if args.table == "real":
        runs = []
        for seed in parse_seeds(args.split_seeds):
            r = real_run(args.data, seed)
            runs.append(r)
            out[str(seed)] = r
            print(f"split seed {seed}: " + "  ".join(
                f"{rule} thr {r[rule]['threshold']:.0f} seen origa/drishti {r[rule]['seen'][0]:.2f}/"
                f"{r[rule]['seen'][1]:.2f} FedDG Drishti photo inside {r[rule]['feddg_drishti_inside']:.0f} "
                f"unseen outside {r[rule]['unseen_out']:.2f}" for rule in RULES), flush=True)
        summary(runs, f"real photos, split seeds {args.split_seeds}")
        for rule in RULES:
            per_site = np.array([r[rule]["seen"] for r in runs]).mean(0)
            drishti = np.mean([r[rule]["feddg_drishti_inside"] for r in runs])
            print(f"  {rule:7s} seen pass per site: origa {per_site[0]:.2f}, drishti {per_site[1]:.2f}; "
                  f"FedDG's Drishti-GS photo inside {drishti:.2f}")
    else:
        seeds = parse_seeds(args.seeds)
        loaded = {seed: synth_sites(args.task, seed, args.data_root) for seed in seeds}
        for m in (int(c) for c in args.cases.split(",")):
            runs = []
            for seed in seeds:
                r = synth_run(loaded[seed], seed, m)
                runs.append(r)
                out[f"{m}/{seed}"] = r
                print(f"{args.task} {m} cases, seed {seed}: " + "  ".join(
                    f"{rule} {r[rule]['seen_pooled']:.2f}/{r[rule]['unseen_out']:.2f}" for rule in RULES), flush=True)
            summary(runs, f"{args.task}, {m} training cases per site, seeds {args.seeds}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
