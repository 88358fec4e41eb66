"""The site-style gate: descriptors, federated Gaussians, threshold and routing, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import ConfigError
from engine.fl.style_gate import (
    DISTANCE_EDGES,
    check_distance_histogram,
    check_style_statistics,
    distance_histogram,
    fit_style_gate,
    gate_metadata,
    gate_nearest,
    histogram_quantile,
    parse_style_gate,
    style_descriptors,
    style_distances,
    style_statistics,
    threshold_from_histograms,
)
from engine.models.style_gate_format import check_gate_metadata, descriptor_size


def test_descriptor_of_a_hand_made_image() -> None:
    # one 1-channel 2x2 image [[0, 1], [2, 3]]: mean 1.5, std sqrt(1.25), quantiles by linear interpolation,
    # mean |dx| = (1 + 1) / 2 = 1, mean |dy| = (2 + 2) / 2 = 2
    img = np.array([[[[0.0, 1.0], [2.0, 3.0]]]])
    d = style_descriptors(img, "intensity-v1")
    expected = [1.5, np.sqrt(1.25), 0.15, 0.75, 1.5, 2.25, 2.85, 1.0, 2.0]
    assert d.shape == (1, descriptor_size(1, "intensity-v1")) == (1, 9)
    np.testing.assert_allclose(d[0], expected)


def test_v2_descriptor_adds_regions_gradients_and_noise_by_hand() -> None:
    # a 3x3 ramp [[0,1,2],[3,4,5],[6,7,8]]: every grid region is one pixel; forward differences are 1 across
    # and 3 down, so every gradient magnitude is sqrt(10); the centre's Laplacian 4*4 - 1 - 3 - 5 - 7 = 0
    ramp = np.arange(9.0).reshape(1, 1, 3, 3)
    # a single bright centre pixel: Laplacian 4 there, the only interior pixel, so the noise level is 4
    spike = np.zeros((1, 1, 3, 3))
    spike[0, 0, 1, 1] = 1.0
    d = style_descriptors(np.concatenate([ramp, spike]))
    assert d.shape == (2, descriptor_size(1)) == (2, 22)
    v1 = [4.0, np.sqrt(60 / 9), 0.4, 2.0, 4.0, 6.0, 7.6, 1.0, 3.0]
    np.testing.assert_allclose(d[0], [*v1, *range(9), *[np.sqrt(10)] * 3, 0.0])
    np.testing.assert_allclose(d[1, 9:18], spike.reshape(-1))
    assert d[1, -1] == pytest.approx(4.0)
    with pytest.raises(ConfigError, match="at least 3 x 3"):
        style_descriptors(np.zeros((1, 1, 2, 2)))
    with pytest.raises(ConfigError, match="unknown style descriptor"):
        style_descriptors(ramp, "intensity-v9")


def test_descriptor_layout_is_per_channel() -> None:
    rng = np.random.default_rng(0)
    img = rng.random((3, 3, 8, 8))
    d = style_descriptors(img)
    assert d.shape == (3, 66)
    np.testing.assert_allclose(d[:, 22], img[:, 1].reshape(3, -1).mean(1))  # channel 1's mean opens its block


def test_fit_matches_pooled_covariance_and_shrinkage() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.random((5, 1, 4, 4)), rng.random((7, 1, 4, 4)) + 0.5
    gate = fit_style_gate([style_statistics(a), None, style_statistics(b)], shrinkage=0.1)
    fa, fb = style_descriptors(a), style_descriptors(b)
    np.testing.assert_allclose(gate["means"].numpy(), np.stack([fa.mean(0), fb.mean(0)]))
    assert gate["sites"].tolist() == [0, 2]  # the site without statistics is left out
    scatter = (fa - fa.mean(0)).T @ (fa - fa.mean(0)) + (fb - fb.mean(0)).T @ (fb - fb.mean(0))
    cov = scatter / (12 - 2)
    dim = descriptor_size(1)
    shrunk = 0.9 * cov + 0.1 * np.trace(cov) / dim * np.eye(dim)
    np.testing.assert_allclose(gate["precision"].numpy(), np.linalg.inv(shrunk), rtol=1e-6, atol=1e-6)
    assert fit_style_gate([None, None]) == {}


def test_distance_is_squared_mahalanobis_to_the_nearest_mean() -> None:
    gate = {"means": torch.tensor([[0.0, 0.0], [10.0, 0.0]], dtype=torch.float64),
            "precision": torch.tensor([[1.0, 0.0], [0.0, 4.0]], dtype=torch.float64),
            "sites": torch.tensor([0, 3])}
    dist, nearest = style_distances(np.array([[1.0, 1.0], [9.0, 0.5]]), gate)
    np.testing.assert_allclose(dist, [1 + 4, 1 + 1])
    assert nearest.tolist() == [0, 3]


def test_threshold_is_a_margin_times_the_median_of_the_sites_quantiles() -> None:
    # site 1: ten images at distance 1; site 2: nine at 1 and one at 100, so its 95% quantile is the 100 bin
    h1 = distance_histogram(np.ones(10))
    h2 = distance_histogram(np.r_[np.ones(9), 100.0])
    assert float(h1["counts"].sum()) == 10
    edge_1 = DISTANCE_EDGES[np.searchsorted(DISTANCE_EDGES, 1.0)]
    edge_100 = DISTANCE_EDGES[np.searchsorted(DISTANCE_EDGES, 100.0)]
    assert 1.0 <= edge_1 < 1.03 and 100.0 <= edge_100 < 103.0  # one bin is 2.3% wide
    assert histogram_quantile(h2["counts"].numpy(), 0.9) == pytest.approx(edge_1)
    assert histogram_quantile(h2["counts"].numpy(), 0.95) == pytest.approx(edge_100)
    # two sites: the median is their mean; the default margin is 1.25
    assert threshold_from_histograms([h1, h2], 0.95) == pytest.approx(1.25 * (edge_1 + edge_100) / 2)
    assert threshold_from_histograms([h1, h2], 0.95, margin=1.0) == pytest.approx((edge_1 + edge_100) / 2)
    # one outlying site among three does not move the threshold; a site without validation images is left out
    empty = distance_histogram(np.zeros(0))
    assert threshold_from_histograms([h1, h2, h1, empty], 0.95) == pytest.approx(1.25 * edge_1)
    assert threshold_from_histograms([], 0.95) == float("inf")
    assert threshold_from_histograms([empty], 0.95) == float("inf")
    assert threshold_from_histograms([distance_histogram(np.array([1e9]))], 0.5) == float("inf")  # overflow bin


def test_bad_statistics_and_histograms_are_refused() -> None:
    good = style_statistics(np.random.default_rng(0).random((3, 1, 4, 4)))
    check_style_statistics(good, 1, "s")
    with pytest.raises(ConfigError, match="shape"):
        check_style_statistics(good, 3, "stats from site1")
    with pytest.raises(ConfigError, match="NaN"):
        check_style_statistics({**good, "sum": torch.full((descriptor_size(1),), float("nan"),
                                                          dtype=torch.float64)}, 1, "s")
    with pytest.raises(ConfigError, match="whole number"):
        check_style_statistics({**good, "count": torch.tensor([0.5], dtype=torch.float64)}, 1, "s")
    # an outer sum smaller than sum sum^T / n allows
    forged = {**good, "outer": torch.zeros((descriptor_size(1),) * 2, dtype=torch.float64)}
    with pytest.raises(ConfigError, match="negative eigenvalue"):
        check_style_statistics(forged, 1, "s")
    hist = distance_histogram(np.ones(3))
    check_distance_histogram(hist, "h")
    with pytest.raises(ConfigError, match="whole numbers"):
        check_distance_histogram({"counts": hist["counts"] - 2}, "h")
    with pytest.raises(ConfigError, match="shape"):
        check_distance_histogram({"counts": hist["counts"][:5]}, "h")


def test_parse_setting() -> None:
    assert parse_style_gate("off") is None and parse_style_gate(None) is None and parse_style_gate(False) is None
    assert parse_style_gate("0.9") == 0.9 and parse_style_gate(1) == 1.0
    for bad in ("often", 0, 1.5, True):
        with pytest.raises(ConfigError):
            parse_style_gate(bad)


def test_bundle_metadata_round_trip_and_routing() -> None:
    rng = np.random.default_rng(2)
    dark, bright = rng.random((6, 1, 8, 8)) * 0.2, 0.8 + rng.random((6, 1, 8, 8)) * 0.2
    gate = fit_style_gate([style_statistics(dark), style_statistics(bright)])
    d_val, _ = style_distances(style_descriptors(np.concatenate([dark, bright])), gate)
    threshold = float(d_val.max()) * 1.01
    state = {**gate, "threshold": torch.tensor([threshold], dtype=torch.float64),
             "quantile": torch.tensor([1.0], dtype=torch.float64)}
    meta = gate_metadata(state, ["a", "b"])
    check_gate_metadata(meta, ["a", "b"], 1)
    mid_grey = np.full((2, 1, 8, 8), 0.5)  # neither site's style
    out = gate_nearest(np.concatenate([dark[:2], mid_grey]), meta, ["a", "b"])[2]
    assert out.tolist() == [False, False, True, True]
    with pytest.raises(ConfigError, match="site_names"):
        check_gate_metadata({**meta, "sites": ["a", "c"]}, ["a", "b"], 1)
    with pytest.raises(ConfigError, match="means must be"):
        check_gate_metadata(meta, ["a", "b"], 3)
    assert gate_metadata({k: v for k, v in state.items() if k != "threshold"}, ["a", "b"]) == {}
    unlimited = gate_metadata({**state, "threshold": torch.tensor([float("inf")], dtype=torch.float64)}, ["a", "b"])
    assert unlimited["threshold"] is None
    assert not gate_nearest(mid_grey, unlimited, ["a", "b"])[2].any()
    # a case is judged whole, by its images' mean distance (a new bundle's gate says unit "case")
    assert meta["unit"] == "case"
    with pytest.raises(ConfigError, match="unit"):
        check_gate_metadata({**meta, "unit": "slice"}, ["a", "b"], 1)
    volume = np.concatenate([dark[:3], mid_grey[:1]])  # three slices like site a, one unlike every site
    per_image = gate_nearest(volume, meta, ["a", "b"])[2]
    assert per_image.tolist() == [False, False, False, True]
    distance, _, whole = gate_nearest(volume, meta, ["a", "b"], cases=np.zeros(4))
    mean = float(style_distances(style_descriptors(volume), gate)[0].mean())
    np.testing.assert_allclose(distance, mean)
    assert whole.tolist() == [mean > threshold] * 4  # all four slices go the same way
    two = gate_nearest(np.concatenate([dark[:2], mid_grey]), meta, ["a", "b"], cases=np.array([0, 0, 1, 1]))[2]
    assert two.tolist() == [False, False, True, True]  # a like case and an unlike one
    # a bundle from before the unit (no "unit": it judged images) keeps judging images
    old = {k: v for k, v in meta.items() if k != "unit"}
    check_gate_metadata(old, ["a", "b"], 1)
    assert gate_nearest(volume, old, ["a", "b"], cases=np.zeros(4))[2].tolist() == per_image.tolist()
