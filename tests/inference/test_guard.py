"""Routing guard: a personalized model is used only where it beat the global model on its site's validation data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from engine.bundle import BundleMetadata, SuperModelBundle, load_bundle, save_bundle
from engine.errors import ConfigError
from engine.inference.guard import apply_guard, guard_decisions, routing_reasons, site_validation_from_state
from engine.inference.predictor import SuperModelPredictor
from engine.models import build_segmentation_net, build_selector

SITES = ["above", "equal", "below", "silent"]
#: personal vs global validation Dice per site: above, equal to and below global, and not reported
VALIDATION = {"above": {"global": 0.70, "personal": 0.75}, "equal": {"global": 0.70, "personal": 0.70},
              "below": {"global": 0.70, "personal": 0.65}, "silent": {"global": None, "personal": None}}


def test_decisions_above_equal_below_and_missing():
    decisions = guard_decisions(SITES, VALIDATION)
    assert [d.allowed for d in decisions] == [True, False, False, False]
    assert "beat global" in decisions[0].why and "0.750 vs 0.700" in decisions[0].why
    assert "tied with" in decisions[1].why
    assert "lost to" in decisions[2].why and "0.650 vs 0.700" in decisions[2].why
    assert "no validation Dice" in decisions[3].why
    # a site absent from the record is treated like one that reported nothing
    assert not guard_decisions(["new"], {})[0].allowed


def test_apply_guard_falls_back_to_global_only_where_personal_did_not_win():
    decisions = guard_decisions(SITES, VALIDATION)
    chosen = np.array([0, 1, 2, 3, 4, 1])
    routed, guarded = apply_guard(chosen, decisions)
    assert routed.tolist() == [0, 1, 0, 0, 0, 1]
    assert guarded.tolist() == [False, False, True, True, True, False]
    probs = np.array([[0.4, 0.3, 0.2, 0.1]] + [[0.97, 0.01, 0.01, 0.01]] * 5)
    probs[2], probs[3], probs[4] = np.roll(probs[1], 1), np.roll(probs[1], 2), np.roll(probs[1], 3)
    reasons = routing_reasons(chosen, routed, probs, 0.6, ["global", *SITES], decisions)
    assert reasons[0].startswith("global: selector confidence 0.40 <= gamma 0.60")
    assert reasons[1].startswith("above: selector confidence 0.97 > gamma 0.60, and above's model beat global")
    assert reasons[2].startswith("global (routing guard)") and "equal's model tied with global" in reasons[2]
    assert "below's model lost to global" in reasons[3]
    off = routing_reasons(chosen, chosen, probs, 0.6, ["global", *SITES], None)
    assert "routing guard off" in off[2]


def test_state_to_metadata():
    state = {"validation_dice": {"a.global": torch.tensor([0.5], dtype=torch.float64),
                                 "a.personal": torch.tensor([0.625], dtype=torch.float64)}}
    assert site_validation_from_state(state, ["a", "b"]) == {"a": {"global": 0.5, "personal": 0.625},
                                                           "b": {"global": None, "personal": None}}


class FixedSelector(nn.Module):
    """Sends image i to site (i mod 4) with confidence ~0.99."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(len(x), 4)
        logits[torch.arange(len(x)), torch.arange(len(x)) % 4] = 6.0
        return logits


def _bundle(guard: bool) -> SuperModelBundle:
    torch.manual_seed(0)
    meta = BundleMetadata(task="fundus", label_names=["disc", "cup"], in_channels=3, image_size=32,
                          selector_size=32, site_names=SITES, gamma=0.6, site_validation=VALIDATION,
                          routing_guard=guard)
    return SuperModelBundle(meta, build_segmentation_net(3, 2).state_dict(),
                            {s: build_segmentation_net(3, 2).state_dict() for s in SITES},
                            build_selector(3, 4).state_dict())


@pytest.mark.parametrize("guard", [True, False])
def test_predictor_applies_the_bundle_guard_and_can_override_it(guard):
    predictor = SuperModelPredictor(_bundle(guard), device="cpu")
    predictor.selector = FixedSelector()
    images = np.random.default_rng(0).random((8, 3, 32, 32), dtype=np.float32)
    pred = predictor.predict(images)
    expected = [1, 0, 0, 0] * 2 if guard else [1, 2, 3, 4] * 2
    assert pred.routed.tolist() == expected
    assert pred.guarded.tolist() == ([False, True, True, True] * 2 if guard else [False] * 8)
    assert len(pred.reasons) == 8 and all(pred.reasons)
    flipped = predictor.predict(images, routing_guard=not guard)
    assert flipped.routed.tolist() == ([1, 2, 3, 4] * 2 if guard else [1, 0, 0, 0] * 2)


def test_bundle_round_trip_and_old_bundles_load_without_guard(tmp_path: Path):
    path = tmp_path / "guarded.safetensors"
    save_bundle(path, _bundle(True))
    loaded = load_bundle(path)
    assert loaded.metadata.routing_guard is True and loaded.metadata.site_validation == VALIDATION
    # a bundle written before the guard: no site_validation, no routing_guard -> routes as before
    meta = json.loads(loaded.metadata.to_json())
    del meta["site_validation"], meta["routing_guard"]
    flat = {f"global.{k}": v for k, v in loaded.global_weights.items()}
    flat |= {f"selector.{k}": v for k, v in loaded.selector_weights.items()}
    for site, weights in loaded.personal_weights.items():
        flat |= {f"personal.{site}.{k}": v for k, v in weights.items()}
    old = tmp_path / "old.safetensors"
    save_file(flat, str(old), metadata={"fedsm": json.dumps(meta)})
    old_meta = load_bundle(old).metadata
    assert old_meta.routing_guard is False and old_meta.site_validation == {}


def test_bad_site_validation_is_refused():
    with pytest.raises(ConfigError, match="site_validation"):
        BundleMetadata(task="fundus", label_names=["disc", "cup"], in_channels=3, image_size=32, selector_size=32,
                       site_names=["a"], site_validation={"a": {"global": 1.5}})
    with pytest.raises(ConfigError, match="site_validation names site"):
        BundleMetadata(task="fundus", label_names=["disc", "cup"], in_channels=3, image_size=32, selector_size=32,
                       site_names=["a"], site_validation={"b": {"global": 0.5}})


def test_paired_test_lets_a_personalized_model_through_only_above_the_noise_of_its_cases():
    # lead 0.05 over 4 cases with per-case spread 0.04: standard error 0.02, needed 1.645 * 0.02 = 0.0329
    clear = {"global": 0.70, "personal": 0.75, "cases": 4.0, "diff_sd": 0.04}
    # the same lead with spread 0.08: needed 0.0658 > 0.05 -> inside the noise
    noisy = {"global": 0.70, "personal": 0.75, "cases": 4.0, "diff_sd": 0.08}
    # just under the bar: lead 0.030 < needed 0.0329
    level = {"global": 0.70, "personal": 0.73, "cases": 4.0, "diff_sd": 0.04}
    single = {"global": 0.70, "personal": 0.90, "cases": 1.0, "diff_sd": 0.0}
    behind = {"global": 0.70, "personal": 0.65, "cases": 9.0, "diff_sd": 0.001}
    sites = ["clear", "noisy", "level", "single", "behind"]
    decisions = guard_decisions(sites, dict(zip(sites, (clear, noisy, level, single, behind), strict=True)))
    assert [d.allowed for d in decisions] == [True, False, False, False, False]
    assert "lead 0.050 > 0.033, 1.645 standard errors over 4 cases" in decisions[0].why
    assert "only by 0.050 (Dice 0.750 vs 0.700), inside the noise of 4 cases (needs > 0.066" in decisions[1].why
    assert "only by 0.030 (Dice 0.730 vs 0.700), inside the noise of 4 cases (needs > 0.033" in decisions[2].why
    assert "on a single case, which cannot show it is better" in decisions[3].why
    assert "lost to global" in decisions[4].why
    # spread 0 over several cases: any lead passes
    assert guard_decisions(["s"], {"s": {"global": 0.7, "personal": 0.701, "cases": 3.0, "diff_sd": 0.0}})[0].allowed


def test_state_to_metadata_keeps_the_paired_statistics():
    t = {"a.global": 0.5, "a.personal": 0.625, "a.cases": 3.0, "a.diff_sd": 0.1}
    state = {"validation_dice": {k: torch.tensor([v], dtype=torch.float64) for k, v in t.items()}}
    assert site_validation_from_state(state, ["a"]) == {"a": {"global": 0.5, "personal": 0.625, "cases": 3.0,
                                                              "diff_sd": 0.1}}


def test_bundle_checks_the_paired_statistics():
    def meta(scores):
        return BundleMetadata(task="fundus", label_names=["disc", "cup"], in_channels=3, image_size=32,
                              selector_size=32, site_names=["a"], site_validation={"a": scores})

    assert meta({"global": 0.5, "personal": 0.6, "cases": 2.0, "diff_sd": 0.1}).site_validation["a"]["cases"] == 2.0
    with pytest.raises(ConfigError, match="'cases'\\] must be a whole number"):
        meta({"global": 0.5, "personal": 0.6, "cases": 2.5, "diff_sd": 0.1})
    with pytest.raises(ConfigError, match="'diff_sd'\\] must be a number in \\[0, 1\\]"):
        meta({"global": 0.5, "personal": 0.6, "cases": 2.0, "diff_sd": -0.1})
    with pytest.raises(ConfigError, match="optionally 'cases' and 'diff_sd'"):
        meta({"global": 0.5, "personal": 0.6, "spread": 0.1})
