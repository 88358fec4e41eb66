"""Per-case reductions (engine.fl.cases) and the routing statistics sites count by volume."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.errors import ConfigError
from engine.federation.inprocess import run_rounds
from engine.fl.cases import case_mean_rows, case_means, case_sizes
from engine.fl.methods import FedSM, SiteRuntime
from engine.fl.routing_choice import CHOICE_PART, choice_summary
from engine.fl.selector_gamma import histogram_statistics
from engine.fl.style_gate import nearest_sites
from engine.tasks import FUNDUS


def test_each_row_gets_its_cases_mean_whatever_the_order_of_the_ids():
    values = np.array([[1.0, 0.0], [4.0, 2.0], [3.0, 2.0], [5.0, 4.0]])
    cases = np.array([9, 3, 9, 3])
    np.testing.assert_allclose(case_mean_rows(values, cases), [[2, 1], [4.5, 3], [2, 1], [4.5, 3]])
    np.testing.assert_allclose(case_means(values, cases), [[4.5, 3], [2, 1]])  # case 3 first: np.unique's order
    np.testing.assert_allclose(case_mean_rows(np.array([1.0, 2.0, 6.0]), np.array([0, 1, 1])), [1, 4, 4])
    assert case_sizes(cases).tolist() == [2, 2, 2, 2]
    assert case_sizes(np.array([5, 5, 5, 1])).tolist() == [3, 3, 3, 1]
    assert case_mean_rows(np.zeros((0, 2)), np.zeros(0)).shape == (0, 2)
    with pytest.raises(ConfigError, match="3 rows but 2 case ids"):
        case_mean_rows(np.zeros((3, 2)), np.array([0, 1]))
    with pytest.raises(ConfigError, match="1-D"):
        case_sizes(np.zeros((2, 2)))


def test_a_volume_has_one_nearest_site_by_its_mean_distance():
    # slice 0 is nearest site 4 (column 0), slices 1-2 nearest site 7 (column 1); sums 13 against 8
    matrix = np.array([[1.0, 6.0], [6.0, 1.0], [6.0, 1.0]])
    sites = np.array([4, 7])
    distance, nearest = nearest_sites(matrix, sites)
    assert nearest.tolist() == [4, 7, 7] and distance.tolist() == [1.0, 1.0, 1.0]
    distance, nearest = nearest_sites(matrix, sites, np.zeros(3))
    assert nearest.tolist() == [7, 7, 7] and distance.tolist() == [1.0, 1.0, 1.0]  # distances stay each image's
    assert nearest_sites(matrix, sites, np.array([0, 1, 1]))[1].tolist() == [4, 7, 7]
    empty = nearest_sites(np.zeros((2, 0)), np.zeros(0))
    assert empty[1].tolist() == [-1, -1] and np.isinf(empty[0]).all()


def test_the_selector_histogram_counts_each_slice_with_its_volumes_decision():
    # own site 0: slice probabilities 0.9, 0.3, 0.3 for site 0; volume mean 0.5 (ties to site 0 by argmax order)
    p = torch.tensor([[0.9, 0.1], [0.3, 0.7], [0.3, 0.7]], dtype=torch.float64)
    logits = p.log()
    labels = np.zeros(3, dtype=np.int64)
    per_image = histogram_statistics(logits, labels, bins=10)
    assert per_image["missed"].item() == 2 and per_image["counts"][0, 9].item() == 1  # 0.9 in the top bin
    by_volume = histogram_statistics(logits, labels, bins=10, cases=np.zeros(3))
    assert by_volume["missed"].item() == 0 and by_volume["counts"][0, 5].item() == 3  # 0.5 for all three
    two = histogram_statistics(logits, labels, bins=10, cases=np.array([0, 1, 1]))
    assert two["missed"].item() == 2 and two["counts"][0, 9].item() == 1


def test_a_gated_sites_last_round_measures_both_rules_on_its_volumes(tiny_training, monkeypatch):
    import engine.fl.methods.fedsm as fedsm_module

    seen: dict[str, list] = {"histogram": [], "nearest": []}
    histogram, nearest = fedsm_module.histogram_statistics, fedsm_module.nearest_sites

    def spy_histogram(*args, **kwargs):
        seen["histogram"].append(kwargs.get("cases"))
        return histogram(*args, **kwargs)

    def spy_nearest(matrix, sites, cases=None):
        seen["nearest"].append(cases)
        return nearest(matrix, sites, cases)

    monkeypatch.setattr(fedsm_module, "histogram_statistics", spy_histogram)
    monkeypatch.setattr(fedsm_module, "nearest_sites", spy_nearest)

    def volumes(split):  # two volumes of two slices
        return dataclasses.replace(split, case_ids=np.array([0, 0, 1, 1]))

    rts = [SiteRuntime(f"site{k + 1}", k, random_split(4, seed=k, shift=0.25 * k),
                       validation=volumes(random_split(4, seed=10 + k, shift=0.25 * k))) for k in range(2)]
    method = FedSM(FUNDUS, [s.name for s in rts], tiny_training, seed=0, rounds=1, lam=0.5, style_gate=0.95)
    state, _ = run_rounds(method, rts, method.total_rounds)
    assert [c.tolist() for c in seen["histogram"]] == [[0, 0, 1, 1]] * 2
    assert [c.tolist() for c in seen["nearest"]] == [[0, 0, 1, 1]] * 2
    assert choice_summary(state[CHOICE_PART])["images"] == 8  # still counted in images
    # without the gate the super model routes image by image, and so do the statistics
    seen["histogram"].clear()
    ungated = FedSM(FUNDUS, [s.name for s in rts], tiny_training, seed=0, rounds=1, lam=0.5, gamma_pass=0.9)
    run_rounds(ungated, rts, ungated.total_rounds)
    assert seen["histogram"] == [None, None]
