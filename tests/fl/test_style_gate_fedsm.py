"""The site-style gate inside FedSM: what sites send, what the server fits, how a super model routes with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from testsupport import random_split
from torch import nn

from engine.bundle import BundleMetadata, SuperModelBundle, load_bundle, save_bundle
from engine.errors import ConfigError
from engine.federation.inprocess import run_rounds
from engine.fl.methods import FedSM, SiteRuntime, SiteUpdate
from engine.fl.style_gate import GATE_PART, HIST_PART, STATS_PART, gate_metadata, style_statistics
from engine.inference.predictor import SuperModelPredictor
from engine.models import build_segmentation_net, build_selector
from engine.tasks import FUNDUS


def sites(n: int = 3) -> list[SiteRuntime]:
    return [SiteRuntime(f"site{k + 1}", k, random_split(4 + 2 * k, seed=k, shift=0.25 * k),
                        validation=random_split(3, seed=10 + k, shift=0.25 * k)) for k in range(n)]


def test_sites_send_statistics_every_round_and_a_histogram_last(tiny_training):
    rts = sites()
    names = [s.name for s in rts]
    method = FedSM(FUNDUS, names, tiny_training, seed=0, rounds=1, lam=0.7, selector_warmup=1, style_gate=0.95)
    state, records = run_rounds(method, rts, method.total_rounds)
    assert [r.answered for r in records] == [names] * 3
    assert set(state["style_stats"]) == {f"{s}.{k}" for s in names for k in ("count", "sum", "outer")}
    assert float(state["style_stats"]["site2.count"][0]) == 6  # site2 holds 6 training images
    gate = state[GATE_PART]
    assert gate["means"].shape == (3, 66) and gate["sites"].tolist() == [0, 1, 2]
    threshold = float(gate["threshold"][0])
    assert 0 < threshold < float("inf") and float(gate["quantile"][0]) == 0.95
    # the last round sends validation Dice and the distance histogram only: a few KB
    assert 0 < records[2].bytes_from_site["site1"] < 20_000
    meta = gate_metadata(gate, names)
    assert meta["sites"] == names and meta["threshold"] == pytest.approx(threshold)


def test_gate_off_sends_nothing_more(tiny_training):
    rts = sites(2)
    method = FedSM(FUNDUS, [s.name for s in rts], tiny_training, seed=0, rounds=1, lam=0.5)
    state, records = run_rounds(method, rts, method.total_rounds)
    assert GATE_PART not in state and "style_stats" not in state
    assert records[1].bytes_from_site["site1"] == 0


def test_updates_without_statistics_or_with_a_misplaced_histogram_are_refused(tiny_training):
    rts = sites(2)
    method = FedSM(FUNDUS, [s.name for s in rts], tiny_training, seed=0, rounds=1, lam=0.5, style_gate=0.9)
    state = method.initial_state()
    update = method.train_at_site(method.site_instructions(state, 1, "site1"), rts[0])
    assert STATS_PART in update.weights
    method.validate_update(state, "site1", update)
    bare = SiteUpdate({k: v for k, v in update.weights.items() if k != STATS_PART}, update.num_samples,
                      update.metrics)
    with pytest.raises(ConfigError, match="lacks its style statistics"):
        method.validate_update(state, "site1", bare)
    stray = SiteUpdate({**update.weights, HIST_PART: {"counts": torch.zeros(802, dtype=torch.float64)}},
                       update.num_samples, update.metrics)
    with pytest.raises(ConfigError, match="outside the last round"):
        method.validate_update(state, "site1", stray)
    wrong = SiteUpdate({**update.weights, STATS_PART: style_statistics(np.zeros((2, 1, 8, 8)))},
                       update.num_samples, update.metrics)
    with pytest.raises(ConfigError, match="shape"):
        method.validate_update(state, "site1", wrong)
    inflated = SiteUpdate(update.weights, update.num_samples + 1, update.metrics)
    with pytest.raises(ConfigError, match="style statistics but trained on"):
        method.validate_update(state, "site1", inflated)


class SureSelector(nn.Module):
    """Sends every image to site 1 with confidence 0.998 (shown as 1.00)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(len(x), 2)
        logits[:, 0] = 6.0
        return logits


def _gated_bundle() -> tuple[SuperModelBundle, np.ndarray]:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    dark = (rng.random((6, 3, 32, 32)) * 0.2).astype(np.float32)
    a, b = dark, dark + 0.1
    from engine.fl.style_gate import fit_style_gate, style_descriptors, style_distances

    gate = fit_style_gate([style_statistics(a), style_statistics(b)])
    d, _ = style_distances(style_descriptors(np.concatenate([a, b])), gate)
    gate |= {"threshold": torch.tensor([float(d.max()) * 1.01], dtype=torch.float64),
             "quantile": torch.tensor([1.0], dtype=torch.float64)}
    validation = {"s1": {"global": 0.5, "personal": 0.6}, "s2": {"global": 0.5, "personal": 0.6}}
    meta = BundleMetadata(task="fundus", label_names=["disc", "cup"], in_channels=3, image_size=32, selector_size=32,
                          site_names=["s1", "s2"], gamma=0.6, site_validation=validation, routing_guard=True,
                          style_gate=gate_metadata(gate, ["s1", "s2"]))
    bundle = SuperModelBundle(meta, build_segmentation_net(3, 2).state_dict(),
                              {s: build_segmentation_net(3, 2).state_dict() for s in ("s1", "s2")},
                              build_selector(3, 2).state_dict())
    return bundle, dark


def test_predictor_sends_unlike_images_to_global_and_says_why(tmp_path):
    bundle, dark = _gated_bundle()
    save_bundle(tmp_path / "gated.safetensors", bundle)
    loaded = load_bundle(tmp_path / "gated.safetensors")
    assert loaded.metadata.style_gate == bundle.metadata.style_gate
    predictor = SuperModelPredictor(loaded, device="cpu")
    predictor.selector = SureSelector()
    bright = np.full((2, 3, 32, 32), 0.9, dtype=np.float32)  # no site looks like this
    pred = predictor.predict(np.concatenate([dark[:2], bright]))
    assert pred.routed.tolist() == [1, 1, 0, 0]
    assert pred.unlike_sites.tolist() == [False, False, True, True]
    assert pred.reasons[2].startswith("global (style gate): the image is unlike every participating site's images")
    threshold = loaded.metadata.style_gate["threshold"]
    assert pred.reasons[2].endswith(f"(style distance {pred.style_distance[2]:.1f} > threshold {threshold:.1f}; "
                                    "selector confidence 1.00)")
    assert pred.reasons[0].startswith("s1: selector confidence 1.00 > gamma 0.60")
    # a volume is judged whole (the bundle's gate judges cases): the sentence names the volume and its mean
    volume = predictor.predict(np.concatenate([dark[:1], bright]), cases=np.zeros(3))
    assert volume.routed.tolist() == [0, 0, 0]
    mean = float(volume.style_distance.mean())
    assert all(r.startswith("global (style gate): its volume (3 images, judged whole) is unlike every "
                            f"participating site's images (mean style distance {mean:.1f} > threshold") for r in
               volume.reasons)
    ungated = predictor.predict(bright, style_gate=False)
    assert ungated.routed.tolist() == [1, 1] and ungated.unlike_sites.tolist() == [True, True]


class ScriptedSelector(nn.Module):
    """Site 1 with probability 0.9 for a dark image (mean below 0.15), 0.3 (so site 2 with 0.7) otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.where(x.mean(dim=(1, 2, 3)) < 0.15, 0.9, 0.3)
        return torch.stack([p.log(), (1 - p).log()], dim=1)


def test_a_volume_goes_to_one_model_decided_by_its_slices_mean_probabilities():
    bundle, dark = _gated_bundle()
    predictor = SuperModelPredictor(bundle, device="cpu")
    predictor.selector = ScriptedSelector()
    like_s1, like_s2 = dark[:1], dark[:1] + 0.1  # both inside the gate
    # image by image (no cases): the selector's per-image choice, site 1 then site 2
    assert predictor.predict(np.concatenate([like_s1, like_s2])).routed.tolist() == [1, 2]
    # one volume of the two: mean p(site 1) 0.6, not above gamma 0.6, so the whole volume to global
    whole = predictor.predict(np.concatenate([like_s1, like_s2]), cases=np.zeros(2))
    assert whole.routed.tolist() == [0, 0]
    np.testing.assert_allclose(whole.confidence, [0.6, 0.6], atol=1e-6)
    np.testing.assert_allclose(whole.probabilities[:, 0], [0.9, 0.3], atol=1e-6)  # still per slice
    assert whole.reasons == ["global: its volume's selector confidence 0.60 (mean over 2 images) <= gamma 0.60"] * 2
    # two slices like site 1 and one like site 2: every slice to site 1 (mean 0.7), not one to site 2
    three = predictor.predict(np.concatenate([like_s1, like_s1, like_s2]), cases=np.zeros(3))
    assert three.routed.tolist() == [1, 1, 1]
    assert three.reasons[2].startswith("s1: its volume's selector confidence 0.70 (mean over 3 images) > gamma 0.60")
    # two volumes are decided each on its own
    two = predictor.predict(np.concatenate([like_s1, like_s1, like_s2]), cases=np.array([4, 4, 1]))
    assert two.routed.tolist() == [1, 1, 2]
    assert two.reasons[2].startswith("s2: selector confidence 0.70 > gamma 0.60")  # a case of one image


def test_style_routing_sends_a_volume_to_the_site_its_slices_are_most_alike_on_average():
    bundle, dark = _gated_bundle()
    predictor = SuperModelPredictor(_style_routed(bundle), device="cpu")
    predictor.selector = SureSelector()
    images = np.concatenate([dark[:1], dark[1:3] + 0.1])  # one slice like s1, two like s2
    assert predictor.predict(images).nearest_site.tolist() == [1, 2, 2]
    pred = predictor.predict(images, cases=np.zeros(3))
    assert pred.nearest_site.tolist() == [2, 2, 2] and pred.routed.tolist() == [2, 2, 2]
    assert pred.reasons[0].startswith("s2: s2's images are the most alike its volume (3 images; mean style distance ")


def test_the_selector_report_routes_volumes_as_the_super_model_does():
    from engine.selector_report import SiteImages, selector_report

    bundle, dark = _gated_bundle()
    predictor = SuperModelPredictor(bundle, device="cpu")
    predictor.selector = ScriptedSelector()
    images = np.concatenate([dark[:1], dark[:1], dark[:1] + 0.1])
    masks = np.zeros((3, 2, 32, 32), dtype=np.uint8)
    site = SiteImages("s1", images, masks, np.zeros(3, dtype=np.int64))
    report = selector_report(predictor, [site], None, gamma=0.6, gammas=(0.6,))
    assert report["routing_per_gamma"][0]["seen"] == {"global": 0.0, "own_site": 1.0, "other_site": 0.0}
    assert report["ece"]["accuracy"] == pytest.approx(2 / 3)  # the selector itself is still judged per image
    per_image = SiteImages("s1", images, masks, np.arange(3))
    shares = selector_report(predictor, [per_image], None, gamma=0.6, gammas=(0.6,))["routing_per_gamma"][0]["seen"]
    assert shares["own_site"] == pytest.approx(2 / 3) and shares["other_site"] == pytest.approx(1 / 3)


def test_bad_gate_metadata_is_refused():
    bundle, _ = _gated_bundle()
    meta = dict(bundle.metadata.style_gate)
    with pytest.raises(ConfigError, match="style_gate"):
        BundleMetadata(task="fundus", label_names=["disc", "cup"], in_channels=3, image_size=32, selector_size=32,
                       site_names=["s1"], style_gate=meta)


def test_federation_setting_parses_and_survives_the_spec_round_trip():
    from engine.federation.spec import MethodSpec, build_method

    base = {"method": "fedsm", "task": "fundus", "site_names": ("a", "b"), "rounds": 1, "image_size": 32}
    assert MethodSpec(**base).style_gate == 0.95  # on by default, like fedsm simulate
    off = MethodSpec.from_dict({**base, "style_gate": "off"})
    assert off.style_gate is None and build_method(off, "cpu").style_quantile is None
    tight = MethodSpec.from_dict({**base, "style_gate": 0.9})
    assert MethodSpec.from_json(tight.to_json()) == tight and build_method(tight, "cpu").style_quantile == 0.9
    assert MethodSpec.from_json(off.to_json()).style_gate is None
    with pytest.raises(ConfigError, match="style gate"):
        MethodSpec.from_dict({**base, "style_gate": "sometimes"})


def _style_routed(bundle: SuperModelBundle, **changes) -> SuperModelBundle:
    from dataclasses import replace

    return SuperModelBundle(replace(bundle.metadata, site_routing="style", **changes), bundle.global_weights,
                            bundle.personal_weights, bundle.selector_weights)


def test_style_routing_sends_each_image_to_its_nearest_site_and_says_why(tmp_path):
    bundle, dark = _gated_bundle()
    save_bundle(tmp_path / "style.safetensors", _style_routed(bundle))
    loaded = load_bundle(tmp_path / "style.safetensors")
    assert loaded.metadata.site_routing == "style"
    predictor = SuperModelPredictor(loaded, device="cpu")
    predictor.selector = SureSelector()  # sure of s1 for every image: style routing must not follow it
    bright = np.full((2, 3, 32, 32), 0.9, dtype=np.float32)
    images = np.concatenate([dark[:2], dark[:2] + 0.1, bright])
    pred = predictor.predict(images)
    assert pred.routed.tolist() == [1, 1, 2, 2, 0, 0]
    assert pred.confidence[2] > 0.99  # the selector still runs and is reported
    assert pred.reasons[0].startswith("s1: s1's images are the most alike (style distance ")
    assert "threshold" in pred.reasons[0] and "and s1's model beat global" in pred.reasons[0]
    assert pred.reasons[4].startswith("global (style gate): the image is unlike every participating site's images")
    # the gate is part of the rule: turning it off at inference does not send unlike images to a site
    assert predictor.predict(bright, style_gate=False).routed.tolist() == [0, 0]


def test_style_routing_keeps_the_guard():
    bundle, dark = _gated_bundle()
    worse = {"s1": {"global": 0.5, "personal": 0.6}, "s2": {"global": 0.5, "personal": 0.4}}
    predictor = SuperModelPredictor(_style_routed(bundle, site_validation=worse), device="cpu")
    pred = predictor.predict(np.concatenate([dark[:1], dark[:1] + 0.1]))
    assert pred.routed.tolist() == [1, 0] and pred.guarded.tolist() == [False, True]
    assert pred.reasons[1].startswith("global (routing guard): s2's images are the most alike (style distance ")


def test_style_routing_needs_a_gamma_bundle_with_a_gate():
    bundle, _ = _gated_bundle()
    from dataclasses import replace

    with pytest.raises(ConfigError, match="site_routing must be one of"):
        replace(bundle.metadata, site_routing="nearest")
    with pytest.raises(ConfigError, match="needs a FedSM bundle with a site-style gate"):
        replace(bundle.metadata, site_routing="style", style_gate={})
    from engine.federation.spec import MethodSpec

    base = {"method": "fedsm", "task": "fundus", "site_names": ("a", "b"), "rounds": 1, "image_size": 32}
    assert MethodSpec(**base).site_routing == "auto"
    style = MethodSpec.from_dict({**base, "site_routing": "style"})
    assert MethodSpec.from_json(style.to_json()).site_routing == "style"
    with pytest.raises(ConfigError, match="which is off"):
        MethodSpec.from_dict({**base, "site_routing": "style", "style_gate": "off"})
    with pytest.raises(ConfigError, match="site_routing must be 'auto', 'selector' or 'style'"):
        MethodSpec.from_dict({**base, "site_routing": "gate"})


def test_simulation_setting_is_checked_before_training():
    from engine.simulate import SimulationConfig

    assert SimulationConfig(methods=("fedsm",)).site_routing == "auto"
    assert SimulationConfig(methods=("fedsm",), site_routing="style").site_routing == "style"
    with pytest.raises(ConfigError, match="which is off"):
        SimulationConfig(methods=("fedsm",), site_routing="style", style_gate=None)
    with pytest.raises(ConfigError, match="site_routing must be 'auto', 'selector' or 'style'"):
        SimulationConfig(methods=("fedsm",), site_routing="nearest")


def test_style_routing_without_a_fitted_gate_falls_back_to_the_selector_and_says_so(caplog):
    from engine.fl.style_gate import bundle_site_routing

    assert bundle_site_routing("style", {"threshold": 1.0}) == "style"
    assert bundle_site_routing("selector", {}) == "selector"
    with caplog.at_level("WARNING", logger="engine.fl.style_gate"):
        assert bundle_site_routing("style", {}) == "selector"
    assert "fitted no site-style gate" in caplog.text


def test_predictions_carry_each_images_nearest_site():
    bundle, dark = _gated_bundle()
    predictor = SuperModelPredictor(bundle, device="cpu")
    pred = predictor.predict(np.concatenate([dark[:1], dark[:1] + 0.1]), force_model=0)
    assert pred.nearest_site.tolist() == [1, 2] and pred.routed.tolist() == [0, 0]
