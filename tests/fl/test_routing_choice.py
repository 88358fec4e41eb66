"""``site_routing="auto"``: the federation keeps whichever rule names more validation images' own site."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.errors import ConfigError, WeightsError
from engine.federation.inprocess import run_rounds
from engine.fl.methods import GAMMA_PART, FedSM, SiteRuntime, SiteUpdate
from engine.fl.routing_choice import (
    CHOICE_PART,
    ROUTING_PART,
    check_routing_statistics,
    choice_summary,
    choose_site_routing,
    chosen_rule,
    selector_own_share,
    style_routing_statistics,
)
from engine.fl.style_gate import bundle_site_routing
from engine.tasks import FUNDUS


def histogram(bins: dict[int, int], missed: int, rows: int = 1, n_bins: int = 100) -> dict[str, torch.Tensor]:
    counts = torch.zeros(rows, n_bins, dtype=torch.float64)
    for b, c in bins.items():
        counts[rows - 1, b] = c
    return {"counts": counts, "missed": torch.full((rows, 1), float(missed), dtype=torch.float64)}


def style(own: int, count: int) -> dict[str, torch.Tensor]:
    return {"style_own": torch.tensor([float(own)], dtype=torch.float64),
            "count": torch.tensor([float(count)], dtype=torch.float64)}


def test_selector_share_counts_bins_at_or_above_gamma_over_all_scored_images():
    # site A: recognised images at 0.55, 0.60, 0.61, 0.95 (bins 55, 60, 61, 95), one missed;
    # site B: recognised at 0.65 (bin 65) and 0.30 (bin 30), three missed. 10 images in all.
    a = histogram({55: 1, 60: 1, 61: 1, 95: 1}, missed=1)
    b = histogram({65: 1, 30: 1}, missed=3)
    # gamma 0.6: bins 60, 61, 65, 95 -> 4 of 10
    assert selector_own_share([a, b], 0.6) == pytest.approx(0.4)
    # gamma 0.605 cuts bin 60 ([0.60, 0.61)): that bin is left out -> bins 61, 65, 95 -> 3 of 10
    assert selector_own_share([a, b], 0.605) == pytest.approx(0.3)
    # gamma 0: every recognised image -> 6 of 10; gamma 0.99: none
    assert selector_own_share([a, b], 0.0) == pytest.approx(0.6)
    assert selector_own_share([a, b], 0.99) == pytest.approx(0.0)
    assert math.isnan(selector_own_share([histogram({}, missed=0)], 0.6))
    with pytest.raises(WeightsError, match="no confidence histograms"):
        selector_own_share([], 0.6)


def test_selector_share_reads_the_chosen_temperatures_row():
    two_rows = histogram({90: 3}, missed=1, rows=2)  # row 1 holds the counts, row 0 is empty
    assert selector_own_share([two_rows], 0.6, row=1) == pytest.approx(0.75)
    assert selector_own_share([two_rows], 0.6, row=0) == pytest.approx(0.0)  # row 0: one missed image


@pytest.mark.parametrize(("style_own", "expected"), [(7, "style"), (6, "selector"), (5, "selector")])
def test_style_wins_only_when_it_names_strictly_more_images(style_own, expected):
    # selector share 0.6; style 7/10 above, 6/10 equal (the paper's selector is kept), 5/10 below
    choice = choose_site_routing(0.6, [style(style_own - 2, 5), style(2, 5)])
    assert choice["selector_own"] == pytest.approx(0.6)
    assert choice["style_own"] == pytest.approx(style_own / 10)
    assert choice["images"] == 10
    state = {k: torch.tensor([v], dtype=torch.float64) for k, v in choice.items()}
    assert chosen_rule("auto", state) == expected
    assert choice_summary(state) == pytest.approx(choice)


def test_an_unmeasurable_rule_loses_and_explicit_settings_are_kept():
    assert choose_site_routing(float("nan"), [style(1, 2)])["style"] == 1.0
    assert choose_site_routing(0.2, [style(0, 0)])["style"] == 0.0  # no style counts: the selector
    assert chosen_rule("auto", None) == "selector"
    wins = {"style": torch.tensor([1.0])}
    assert chosen_rule("selector", wins) == "selector" and chosen_rule("style", None) == "style"
    # a bundle: auto resolves to the choice, but style routing still needs a fitted gate
    assert bundle_site_routing("auto", {"threshold": 1.0}, wins) == "style"
    assert bundle_site_routing("auto", {}, wins) == "selector"
    assert choice_summary(None) == {}


def test_site_counts_and_their_checks():
    stats = style_routing_statistics(np.array([2, 2, 0, 2]), own_index=2)
    assert float(stats["style_own"][0]) == 3 and float(stats["count"][0]) == 4
    check_routing_statistics(stats, "counts")
    with pytest.raises(WeightsError, match="expected"):
        check_routing_statistics({"style_own": stats["style_own"]}, "counts")
    with pytest.raises(WeightsError, match="whole number"):
        check_routing_statistics(style(1, 4) | {"style_own": torch.tensor([0.5], dtype=torch.float64)}, "counts")
    with pytest.raises(WeightsError, match="scored only"):
        check_routing_statistics(style(5, 4), "counts")
    with pytest.raises(WeightsError, match="shape"):
        check_routing_statistics(style(1, 4) | {"count": torch.zeros(2, dtype=torch.float64)}, "counts")


def sites(n: int = 3) -> list[SiteRuntime]:
    return [SiteRuntime(f"site{k + 1}", k, random_split(4 + 2 * k, seed=k, shift=0.25 * k),
                        validation=random_split(3, seed=10 + k, shift=0.25 * k)) for k in range(n)]


def test_the_federation_measures_both_rules_on_validation_images_and_records_its_choice(tiny_training):
    rts = sites()
    method = FedSM(FUNDUS, [s.name for s in rts], tiny_training, seed=0, rounds=1, lam=0.7, style_gate=0.95)
    assert method.site_routing == "auto" and method.compares_routings
    state, _ = run_rounds(method, rts, method.total_rounds)
    choice = choice_summary(state[CHOICE_PART])
    assert choice["images"] == 9  # three sites' three validation images
    assert 0.0 <= choice["selector_own"] <= 1.0 and 0.0 <= choice["style_own"] <= 1.0
    assert choice["style"] == (1.0 if choice["style_own"] > choice["selector_own"] else 0.0)
    # the server keeps no gamma choice: the histograms only fed the comparison
    assert GAMMA_PART not in state


def test_explicit_rules_gate_off_and_lda_send_no_comparison(tiny_training):
    rts = sites(2)
    names = [s.name for s in rts]
    for kwargs in ({"site_routing": "selector", "style_gate": 0.95}, {"site_routing": "auto"},
                   {"site_routing": "auto", "style_gate": 0.95, "selector_calibration": "lda"}):
        method = FedSM(FUNDUS, names, tiny_training, seed=0, rounds=1, lam=0.5, **kwargs)
        assert not method.compares_routings
        state, _ = run_rounds(method, rts, method.total_rounds)
        assert CHOICE_PART not in state


def test_unasked_counts_are_refused(tiny_training):
    rts = sites(2)
    method = FedSM(FUNDUS, [s.name for s in rts], tiny_training, seed=0, rounds=1, lam=0.5, site_routing="selector")
    state = method.initial_state()
    last = SiteUpdate({ROUTING_PART: style(1, 3)}, 4, {"val_dice_global": 0.5, "val_dice_personal": 0.5})
    with pytest.raises(ConfigError, match="does not compare routing rules"):
        method.validate_update(state, "site1", last)
    comparing = FedSM(FUNDUS, [s.name for s in rts], tiny_training, seed=0, rounds=1, lam=0.5, style_gate=0.95)
    with pytest.raises(ConfigError, match="without the selector's confidence histogram"):
        comparing.validate_update(comparing.initial_state(), "site1", last)
    with pytest.raises(ConfigError, match="site_routing must be"):
        FedSM(FUNDUS, [s.name for s in rts], tiny_training, seed=0, rounds=1, lam=0.5, site_routing="nearest")
