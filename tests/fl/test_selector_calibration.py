"""Closed-form calibration of the selector's last layer."""

import numpy as np
import pytest
import torch

from engine.errors import WeightsError
from engine.fl.selector_calibration import add_statistics, class_statistics, fit_lda


def test_lda_separates_gaussian_classes_split_across_sites():
    rng = np.random.default_rng(0)
    centres = np.array([[0, 0, 0], [3, 0, 0], [0, 3, 0]], dtype=float)
    # each "site" holds one class only, as in FedSM
    site_stats, test_x, test_y = [], [], []
    for c in range(3):
        feats = centres[c] + rng.normal(size=(200, 3))
        site_stats.append(class_statistics(torch.from_numpy(feats[:150]), np.full(150, c), 3))
        test_x.append(feats[150:])
        test_y += [c] * 50
    weight, bias = fit_lda(add_statistics(site_stats), shrinkage=0.0)
    scores = torch.from_numpy(np.concatenate(test_x)) @ weight.T + bias
    accuracy = (scores.argmax(1).numpy() == np.array(test_y)).mean()
    assert accuracy > 0.9


def test_statistics_of_sites_add_up_to_pooled_statistics():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(10, 4)), rng.normal(size=(7, 4))
    la, lb = rng.integers(0, 2, 10), rng.integers(0, 2, 7)
    pooled = class_statistics(torch.from_numpy(np.concatenate([a, b])), np.concatenate([la, lb]), 2)
    summed = add_statistics([class_statistics(torch.from_numpy(a), la, 2),
                             class_statistics(torch.from_numpy(b), lb, 2)])
    for key in pooled:
        assert torch.allclose(pooled[key], summed[key])


def test_class_without_samples_is_never_chosen():
    feats = torch.randn(20, 3, dtype=torch.float64)
    stats = class_statistics(feats, np.array([0] * 10 + [2] * 10), 3)
    weight, bias = fit_lda(stats)
    scores = feats @ weight.T + bias
    assert not bool((scores.argmax(1) == 1).any())


def test_no_statistics_is_an_error():
    with pytest.raises(WeightsError):
        add_statistics([])
