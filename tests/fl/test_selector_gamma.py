"""``--gamma auto``: sites' validation confidence histograms -> the federation's routing threshold."""

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.errors import ConfigError, WeightsError
from engine.fl.methods import GAMMA_PART, FedSM, SiteRuntime
from engine.fl.selector_gamma import (
    GAMMA_BINS,
    check_histogram_statistics,
    choose_gamma,
    gamma_from_histogram,
    histogram_statistics,
    own_site_histogram,
    parse_gamma,
)
from engine.tasks import FUNDUS


def test_histogram_counts_only_recognised_images_by_their_top_probability():
    probs = np.array([[0.7, 0.3], [0.2, 0.8], [0.55, 0.45], [1.0, 0.0]])
    counts, missed = own_site_histogram(probs, np.zeros(4, dtype=int), bins=10)
    # rows 0, 2, 3 are assigned to site 0: 0.7 -> bin 7, 0.55 -> bin 5, 1.0 -> the closed last bin 9
    expected = np.zeros(10)
    expected[[5, 7, 9]] = 1
    assert np.array_equal(counts, expected) and missed == 1
    with pytest.raises(ConfigError):
        own_site_histogram(probs, np.zeros(3, dtype=int))


def test_gamma_is_the_largest_edge_that_keeps_the_pass_fraction():
    counts = np.array([0, 0, 0, 1, 0, 2, 0, 3, 0, 4], dtype=float)  # 10 images; at or above edge j:
    # j=9: 4, j=7: 7, j=5: 9, j=3: 10
    assert gamma_from_histogram(counts, 0.4, 5) == pytest.approx(0.9)
    assert gamma_from_histogram(counts, 0.41, 5) == pytest.approx(0.7)
    assert gamma_from_histogram(counts, 0.9, 5) == pytest.approx(0.5)
    assert gamma_from_histogram(counts, 0.95, 5) == pytest.approx(0.3)
    assert gamma_from_histogram(counts, 1.0, 5) == pytest.approx(0.3)
    # never below 1/K: with two sites the top probability is always >= 0.5
    assert gamma_from_histogram(counts, 0.95, 2) == pytest.approx(0.5)
    assert gamma_from_histogram(np.zeros(10), 0.95, 4) == pytest.approx(0.25)
    for bad in (0.0, 1.5, True, "0.9"):
        with pytest.raises(ConfigError):
            gamma_from_histogram(counts, bad, 5)


def test_sites_histograms_add_up_and_temperature_rows_differ():
    # site A: logits -> probabilities 0.73 / 0.27 (recognised), site B: one recognised at 0.88, one missed
    a = histogram_statistics(torch.tensor([[1.0, 0.0]]), np.array([0]))
    b = histogram_statistics(torch.tensor([[0.0, 2.0], [2.0, 0.0]]), np.array([1, 1]))
    check_histogram_statistics(a, 1, "a")
    assert a["counts"].shape == (1, GAMMA_BINS) and a["missed"].shape == (1, 1)
    assert int(a["counts"][0, 73]) == 1 and int(b["counts"][0, 88]) == 1 and float(b["missed"][0, 0]) == 1.0
    chosen = choose_gamma([a, b], 1.0, 2)
    assert chosen == {"gamma": pytest.approx(0.73), "pass_fraction": 1.0, "images": 3.0,
                      "accuracy": pytest.approx(2 / 3)}
    assert choose_gamma([a, b], 0.5, 2)["gamma"] == pytest.approx(0.88)
    # one row per temperature: at T = 0.5 the same logits give 0.88 -> bin 88
    rows = histogram_statistics(torch.tensor([[1.0, 0.0]]), np.array([0]), temperatures=(1.0, 0.5))
    assert int(rows["counts"][0, 73]) == 1 and int(rows["counts"][1, 88]) == 1
    assert choose_gamma([rows], 1.0, 2, row=1)["gamma"] == pytest.approx(0.88)


def test_malformed_histograms_are_refused():
    good = histogram_statistics(torch.tensor([[1.0, 0.0]]), np.array([0]))
    for bad in ({"counts": good["counts"]},
                {**good, "counts": good["counts"] * 0.5},
                {**good, "missed": -good["missed"] - 1},
                {**good, "counts": good["counts"][:, :10]}):
        with pytest.raises(WeightsError):
            check_histogram_statistics(bad, 1, "site x")
    with pytest.raises(WeightsError, match="no confidence histograms"):
        choose_gamma([], 0.9, 2)


def test_parse_gamma():
    assert parse_gamma("auto") == "auto" and parse_gamma(" AUTO ") == "auto"
    assert parse_gamma("0.4") == 0.4 and parse_gamma(1) == 1.0
    for bad in ("high", "1.2", -0.1, True):
        with pytest.raises(ConfigError):
            parse_gamma(bad)


def test_fedsm_last_round_chooses_gamma_from_site_histograms(tiny_training):
    rts = [SiteRuntime(f"site{k + 1}", k, random_split(4, seed=k), validation=random_split(3, seed=10 + k))
           for k in range(2)]
    method = FedSM(FUNDUS, [s.name for s in rts], tiny_training, rounds=1, lam=0.5, gamma_pass=0.95)
    state = method.initial_state()
    last = method.total_rounds
    updates = {}
    for site in rts:
        update = method.train_at_site(method.site_instructions(state, last, site.name), site)
        method.validate_update(state, site.name, update)
        assert set(update.weights) == {GAMMA_PART}
        assert float(update.weights[GAMMA_PART]["counts"].sum() + update.weights[GAMMA_PART]["missed"].sum()) == 3
        updates[site.name] = update
    new = method.aggregate(state, last, updates)
    expected = choose_gamma([u.weights[GAMMA_PART] for u in updates.values()], 0.95, 2)
    assert float(new[GAMMA_PART]["gamma"][0]) == pytest.approx(expected["gamma"])
    assert float(new[GAMMA_PART]["images"][0]) == 6.0
    assert method.routing_gamma(new) == pytest.approx(expected["gamma"]) and 0.5 <= method.routing_gamma(new) < 1.0
    assert FedSM(FUNDUS, ["a", "b"], tiny_training, gamma=0.4).routing_gamma(new) == 0.4  # fixed gamma ignores it
    with pytest.raises(ConfigError, match="reference selector"):
        FedSM(FUNDUS, ["a", "b"], tiny_training, selector_calibration="lda", gamma_pass=0.9)


def test_federation_spec_takes_gamma_auto():
    from engine.federation.spec import MethodSpec, build_method

    spec = MethodSpec(method="fedsm", task="fundus", site_names=("a", "b"), gamma="auto", gamma_pass=0.9)
    method = build_method(spec, "cpu")
    assert method.gamma_pass == 0.9 and method.routing_gamma({}) == 0.6  # before the last round: the fallback
    assert build_method(MethodSpec(method="fedsm", task="fundus", site_names=("a", "b")), "cpu").gamma_pass is None
    with pytest.raises(ConfigError, match="auto"):
        MethodSpec(method="fedsm", task="fundus", site_names=("a", "b"), gamma="often")
    with pytest.raises(ConfigError, match="pass fraction"):
        MethodSpec(method="fedsm", task="fundus", site_names=("a", "b"), gamma="auto", gamma_pass=0.0)
