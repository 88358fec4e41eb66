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
    assert gate["means"].shape == (3, 27) and gate["sites"].tolist() == [0, 1, 2]
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
    assert pred.reasons[0].startswith("s1: selector confidence 1.00 > gamma 0.60")
    ungated = predictor.predict(bright, style_gate=False)
    assert ungated.routed.tolist() == [1, 1] and ungated.unlike_sites.tolist() == [True, True]


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
