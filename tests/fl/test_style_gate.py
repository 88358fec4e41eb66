"""The site-style gate: descriptors, federated Gaussians, threshold and routing, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import ConfigError
from engine.fl.style_gate import (
    DISTANCE_EDGES,
    check_distance_histogram,
    check_gate_metadata,
    check_style_statistics,
    descriptor_size,
    distance_histogram,
    fit_style_gate,
    gate_metadata,
    outside_gate,
    parse_style_gate,
    style_descriptors,
    style_distances,
    style_statistics,
    threshold_from_histograms,
)


def test_descriptor_of_a_hand_made_image() -> None:
    # one 1-channel 2x2 image [[0, 1], [2, 3]]: mean 1.5, std sqrt(1.25), quantiles by linear interpolation,
    # mean |dx| = (1 + 1) / 2 = 1, mean |dy| = (2 + 2) / 2 = 2
    img = np.array([[[[0.0, 1.0], [2.0, 3.0]]]])
    d = style_descriptors(img)
    expected = [1.5, np.sqrt(1.25), 0.15, 0.75, 1.5, 2.25, 2.85, 1.0, 2.0]
    assert d.shape == (1, descriptor_size(1)) == (1, 9)
    np.testing.assert_allclose(d[0], expected)


def test_descriptor_layout_is_per_channel() -> None:
    rng = np.random.default_rng(0)
    img = rng.random((3, 3, 8, 8))
    d = style_descriptors(img)
    assert d.shape == (3, 27)
    np.testing.assert_allclose(d[:, 9], img[:, 1].reshape(3, -1).mean(1))  # channel 1's mean opens its block


def test_fit_matches_pooled_covariance_and_shrinkage() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.random((5, 1, 4, 4)), rng.random((7, 1, 4, 4)) + 0.5
    gate = fit_style_gate([style_statistics(a), None, style_statistics(b)], shrinkage=0.1)
    fa, fb = style_descriptors(a), style_descriptors(b)
    np.testing.assert_allclose(gate["means"].numpy(), np.stack([fa.mean(0), fb.mean(0)]))
    assert gate["sites"].tolist() == [0, 2]  # the site without statistics is left out
    scatter = (fa - fa.mean(0)).T @ (fa - fa.mean(0)) + (fb - fb.mean(0)).T @ (fb - fb.mean(0))
    cov = scatter / (12 - 2)
    shrunk = 0.9 * cov + 0.1 * np.trace(cov) / 9 * np.eye(9)
    np.testing.assert_allclose(gate["precision"].numpy(), np.linalg.inv(shrunk), rtol=1e-6, atol=1e-6)
    assert fit_style_gate([None, None]) == {}


def test_distance_is_squared_mahalanobis_to_the_nearest_mean() -> None:
    gate = {"means": torch.tensor([[0.0, 0.0], [10.0, 0.0]], dtype=torch.float64),
            "precision": torch.tensor([[1.0, 0.0], [0.0, 4.0]], dtype=torch.float64),
            "sites": torch.tensor([0, 3])}
    dist, nearest = style_distances(np.array([[1.0, 1.0], [9.0, 0.5]]), gate)
    np.testing.assert_allclose(dist, [1 + 4, 1 + 1])
    assert nearest.tolist() == [0, 3]


def test_threshold_is_the_quantile_bin_edge_of_the_summed_histograms() -> None:
    # 19 images at distance 1 and one at 100 over two sites: 95% -> the bin holding 1, 100% -> the one holding 100
    h1 = distance_histogram(np.ones(10))
    h2 = distance_histogram(np.r_[np.ones(9), 100.0])
    assert float(h1["counts"].sum()) == 10
    t95 = threshold_from_histograms([h1, h2], 0.95)
    t100 = threshold_from_histograms([h1, h2], 1.0)
    assert t95 == pytest.approx(DISTANCE_EDGES[np.searchsorted(DISTANCE_EDGES, 1.0)])
    assert 1.0 <= t95 < 1.03  # one bin is 2.3% wide
    assert 100.0 <= t100 < 103.0
    assert threshold_from_histograms([], 0.95) == float("inf")
    assert threshold_from_histograms([distance_histogram(np.array([1e9]))], 0.5) == float("inf")  # overflow bin


def test_bad_statistics_and_histograms_are_refused() -> None:
    good = style_statistics(np.random.default_rng(0).random((3, 1, 4, 4)))
    check_style_statistics(good, 1, "s")
    with pytest.raises(ConfigError, match="shape"):
        check_style_statistics(good, 3, "stats from site1")
    with pytest.raises(ConfigError, match="NaN"):
        check_style_statistics({**good, "sum": torch.full((9,), float("nan"), dtype=torch.float64)}, 1, "s")
    with pytest.raises(ConfigError, match="whole number"):
        check_style_statistics({**good, "count": torch.tensor([0.5], dtype=torch.float64)}, 1, "s")
    forged = {**good, "outer": torch.zeros((9, 9), dtype=torch.float64)}  # smaller than sum sum^T / n allows
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
    out = outside_gate(np.concatenate([dark[:2], mid_grey]), meta, ["a", "b"])
    assert out.tolist() == [False, False, True, True]
    with pytest.raises(ConfigError, match="site_names"):
        check_gate_metadata({**meta, "sites": ["a", "c"]}, ["a", "b"], 1)
    with pytest.raises(ConfigError, match="means must be"):
        check_gate_metadata(meta, ["a", "b"], 3)
    assert gate_metadata({k: v for k, v in state.items() if k != "threshold"}, ["a", "b"]) == {}
    unlimited = gate_metadata({**state, "threshold": torch.tensor([float("inf")], dtype=torch.float64)}, ["a", "b"])
    assert unlimited["threshold"] is None
    assert not outside_gate(mid_grey, unlimited, ["a", "b"]).any()
