"""The style gate's calibration with few cases: leave-one-case-out distances at the site, by hand and on real photos."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import ConfigError
from engine.fl.style_gate import (
    DISTANCE_EDGES,
    SITE_GATE_KEYS,
    calibration_distances,
    distance_histogram,
    fit_style_gate,
    leave_one_case_out_distances,
    site_threshold,
    style_descriptors,
    style_distances,
    style_statistics,
    threshold_from_histograms,
)

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _sums(descriptors: np.ndarray) -> dict[str, torch.Tensor]:
    """A site's descriptor sums from descriptors given by hand (what style_statistics computes from images)."""
    f = np.asarray(descriptors, dtype=np.float64).reshape(len(descriptors), -1)
    return {"count": torch.tensor([float(len(f))], dtype=torch.float64), "sum": torch.from_numpy(f.sum(0)),
            "outer": torch.from_numpy(f.T @ f)}


def test_leave_one_case_out_by_hand() -> None:
    # one descriptor value per image. Site A: 0 and 2 (two cases); site B: 10 and 14.
    # Gate: means 1 and 12; pooled scatter 2 + 8 = 10 over 4 - 2 = 2 dof -> variance 5 (in one dimension the
    # shrinkage towards trace / d is the variance itself), precision 1/5.
    a = np.array([[0.0], [2.0]])
    gate = fit_style_gate([_sums(a), _sums([[10.0], [14.0]])])
    assert set(SITE_GATE_KEYS) <= set(gate)
    assert gate["means"].tolist() == [[1.0], [12.0]] and float(gate["precision"][0, 0]) == pytest.approx(0.2)
    assert float(gate["dof"][0]) == 2.0 and float(gate["shrinkage"][0]) == pytest.approx(0.1)
    # leave out 0: A's mean is 2, the pooled scatter 0 + 8 over 1 dof -> precision 1/8, distance (0 - 2)^2 / 8 =
    # 0.5; two cases -> the predictive factor (4 - 1) / 4 = 0.75 -> 0.375. Leaving out 2 is the mirror image.
    np.testing.assert_allclose(leave_one_case_out_distances(a, np.array([0, 1]), gate, 0), [0.375, 0.375])
    # a gate without dof and shrinkage (an older coordinator): only the mean is refitted, precision stays 1/5
    # -> 4 / 5 * 0.75 = 0.6
    old = {k: gate[k] for k in ("means", "precision", "sites")}
    np.testing.assert_allclose(leave_one_case_out_distances(a, np.array([0, 1]), old, 0), [0.6, 0.6])


def test_leave_one_case_out_equals_the_gate_refitted_without_the_case() -> None:
    # three sites in 5 dimensions (the shrinkage matters); site 0's cases hold 1-3 images each (slices of volumes)
    rng = np.random.default_rng(3)
    a, b, c = rng.normal(size=(9, 5)), rng.normal(size=(7, 5)) + 1.0, rng.normal(size=(4, 5)) * 2.0 - 1.0
    cases = np.array([4, 4, 1, 1, 1, 2, 7, 7, 9])
    gate = fit_style_gate([_sums(a), _sums(b), _sums(c)])
    got = leave_one_case_out_distances(a, cases, gate, 0)
    m = 5
    expected = np.empty(len(a))  # in the images' order
    for case in np.unique(cases):
        expected[cases == case] = style_distances(
            a[cases == case], fit_style_gate([_sums(a[cases != case]), _sums(b), _sums(c)]))[0] * (m * m - 1) / (m * m)
    np.testing.assert_allclose(got, expected, rtol=1e-8)
    # the same for the site in the middle of the routing order, whose mean is the gate's second row
    cases_b = np.arange(7)
    got_b = leave_one_case_out_distances(b, cases_b, gate, 1)
    expected_b = [style_distances(b[[i]], fit_style_gate([_sums(a), _sums(np.delete(b, i, 0)), _sums(c)]))[0]
                  * 48 / 49 for i in range(7)]
    np.testing.assert_allclose(got_b, np.concatenate(expected_b), rtol=1e-8)


def test_sites_with_one_case_or_outside_the_gate() -> None:
    a, b = np.array([[0.0], [2.0]]), np.array([[10.0], [14.0]])
    gate = fit_style_gate([_sums(a), _sums(b)])
    # one case (two slices): leaving it out leaves the site no mean, so it gives no distance
    assert leave_one_case_out_distances(b, np.array([3, 3]), gate, 1).size == 0
    # a site the gate does not hold: its images are new to the gate, their plain distances count
    np.testing.assert_allclose(leave_one_case_out_distances(np.array([[4.0]]), np.array([0]), gate, 5),
                               [(4.0 - 1.0) ** 2 / 5])
    with pytest.raises(ConfigError, match="case ids"):
        leave_one_case_out_distances(a, np.array([0]), gate, 0)


def test_calibration_distances_are_validation_then_leave_one_case_out_case_means() -> None:
    rng = np.random.default_rng(5)
    dark, bright = rng.random((4, 1, 8, 8)) * 0.5, rng.random((5, 1, 8, 8)) * 0.5 + 0.5
    gate = fit_style_gate([style_statistics(dark), style_statistics(bright)])
    cases = np.array([0, 0, 1, 2])
    val = rng.random((3, 1, 8, 8)) * 0.5
    # one distance per case (the gate judges a volume by its slices' mean): validation cases, then training
    got = calibration_distances(gate, 0, dark, cases, val, np.array([7, 7, 3]))
    val_d = style_distances(style_descriptors(val), gate)[0]
    np.testing.assert_allclose(got[:2], [val_d[2], val_d[:2].mean()])  # cases 3 and 7, in id order
    loo = leave_one_case_out_distances(style_descriptors(dark), cases, gate, 0)
    np.testing.assert_allclose(got[2:], [loo[:2].mean(), loo[2], loo[3]])
    # validation images without case ids: each its own case
    assert len(calibration_distances(gate, 0, dark, cases, val)) == 3 + 3
    # no validation images: the training cases' honest distances, not their distances to a mean fitted to them
    in_sample = style_distances(style_descriptors(dark), gate)[0]
    honest = calibration_distances(gate, 0, dark, cases, None)
    assert len(honest) == 3 and np.all(honest > [in_sample[:2].mean(), in_sample[2], in_sample[3]])
    # one training image and no validation image: nothing to send, so the server leaves the site out
    lone = fit_style_gate([style_statistics(dark[:1]), style_statistics(bright)])
    assert calibration_distances(lone, 0, dark[:1], np.array([0]), np.zeros((0, 1, 8, 8))).size == 0
    assert style_distances(style_descriptors(dark[:1]), lone)[0].tolist() == [0.0]  # what it used to send


def _edge(distance: float) -> float:
    """Upper edge of the histogram bin holding ``distance``."""
    return float(DISTANCE_EDGES[np.searchsorted(DISTANCE_EDGES, distance)])


def test_site_threshold_is_a_conformal_rank_or_a_margin_times_the_largest() -> None:
    # 40 distances 1..40: ceil(0.95 * 41) = 39 -> the 39th smallest, 39, with no margin
    forty = distance_histogram(np.arange(1.0, 41.0))["counts"].numpy()
    assert site_threshold(forty, 0.95) == pytest.approx(_edge(39.0))
    # ceil(0.5 * 41) = 21 -> 21; at quantile 1 no rank is large enough -> 1.25 x the largest
    assert site_threshold(forty, 0.5) == pytest.approx(_edge(21.0))
    assert site_threshold(forty, 1.0) == pytest.approx(1.25 * _edge(40.0))
    # 18 distances: ceil(0.95 * 19) = 19 > 18 -> the largest times the margin (the old rule's allowance)
    eighteen = distance_histogram(np.arange(1.0, 19.0))["counts"].numpy()
    assert site_threshold(eighteen, 0.95) == pytest.approx(1.25 * _edge(18.0))
    assert site_threshold(eighteen, 0.95, margin=2.0) == pytest.approx(2.0 * _edge(18.0))
    assert site_threshold(np.zeros(len(DISTANCE_EDGES) + 1), 0.95) == float("inf")
    # the threshold is the median over sites of the sites' bounds: (39, 1.25 x 18, 1.25 x 18) -> 1.25 x 18
    hists = [distance_histogram(np.arange(1.0, 41.0))] + [distance_histogram(np.arange(1.0, 19.0))] * 2
    assert threshold_from_histograms(hists, 0.95) == pytest.approx(1.25 * _edge(18.0))
    assert threshold_from_histograms(hists[:2], 0.95) == pytest.approx((_edge(39.0) + 1.25 * _edge(18.0)) / 2)


def _photo_arrays(data: Path) -> dict[str, np.ndarray]:
    """Every ORIGA and Drishti photo loaded once as training loads it (128 px, --fundus-crop auto), by path."""
    from engine.data.datalist import load_datalist, outside_paths_allowed
    from engine.data.datalist_builder import build_datalist
    from engine.data.site_data import load_site
    from engine.tasks import get_task

    out = {}
    with tempfile.TemporaryDirectory() as tmp, outside_paths_allowed():
        for name in ("ORIGA", "DrishtiGS1"):
            listed = Path(tmp) / name / "datalist.json"
            build_datalist(data / "fundus" / name / "images", data / "fundus" / name / "masks", listed,
                           split=(1.0, 0.0, 0.0), allow_outside=True)
            train = load_site(listed, get_task("fundus"), 128, fundus_crop="auto").train
            for i, entry in enumerate(load_datalist(listed)["training"]):
                out[str(entry["image"])] = train.images[train.case_ids == i]
    return out


@pytest.mark.skipif(not (DATA / "fundus" / "ORIGA").is_dir(), reason="shared real data absent")
def test_real_photos_sites_own_new_photos_pass_the_recalibrated_gate() -> None:
    """ORIGA and Drishti-GS1 as the two sites of docs/io.md "Your own data, step by step" (128 px, disc crop).

    Over datalist split seeds 0-19, ORIGA's held-out photos lie inside the gate calibrated on leave-one-case-out
    distances (measured 0.93; 0.28 with the validation-only histogram), and Drishti, with one training photo and
    no validation photo, sends no distance instead of its training photo's 0. Whether photos of other hospitals
    stay outside is not asserted: with 3 + 1 training photos they do not (docs/results.md, "The gate on real
    photos and few cases").
    """
    from engine.data.datalist import load_datalist, outside_paths_allowed
    from engine.data.datalist_builder import build_datalist

    photos = _photo_arrays(DATA)
    splits = {"ORIGA": (0.5, 0.17, 0.33), "DrishtiGS1": (0.5, 0.0, 0.5)}
    inside, before = [], []
    with tempfile.TemporaryDirectory() as tmp, outside_paths_allowed():
        for seed in range(20):
            sites = []
            for name, split in splits.items():
                listed = Path(tmp) / f"{name}{seed}" / "datalist.json"
                build_datalist(DATA / "fundus" / name / "images", DATA / "fundus" / name / "masks", listed,
                               split=split, seed=seed, allow_outside=True)
                sections = load_datalist(listed)
                sites.append({sec: [photos[str(e["image"])] for e in sections.get(sec, [])]
                              for sec in ("training", "validation", "testing")})
            train = [np.concatenate(s["training"]) for s in sites]
            gate = fit_style_gate([style_statistics(t) for t in train])
            val = [np.concatenate(s["validation"]) if s["validation"] else None for s in sites]
            dists = [calibration_distances(gate, k, train[k], np.arange(len(train[k])), val[k]) for k in range(2)]
            assert dists[1].size == 0  # Drishti: one training photo, no validation photo
            threshold = threshold_from_histograms([distance_histogram(d) for d in dists], 0.95)
            old = threshold_from_histograms([distance_histogram(style_distances(style_descriptors(
                v if v is not None else t), gate)[0]) for v, t in zip(val, train, strict=True)], 0.95)
            test = style_distances(style_descriptors(np.concatenate(sites[0]["testing"])), gate)[0]
            inside.append(test <= threshold)
            before.append(test <= old)
    assert np.concatenate(inside).mean() >= 0.8
    assert np.concatenate(before).mean() < 0.5  # the failure the issue reported
