"""The selector's backbone width: a narrower VGG-11 that trains, travels, is recorded in the bundle and routes."""

from __future__ import annotations

import numpy as np
import pytest

from engine.bundle.supermodel import SELECTOR_WIDTHS as BUNDLE_WIDTHS
from engine.errors import ConfigError
from engine.federation.spec import MethodSpec
from engine.fl.local_training import LocalTrainingConfig
from engine.models.selector import PAPER_WIDTH, SELECTOR_WIDTHS, build_selector, count_parameters, width_of


def test_the_bundle_accepts_exactly_the_widths_the_selector_builds():
    assert BUNDLE_WIDTHS == SELECTOR_WIDTHS and PAPER_WIDTH == 64 and PAPER_WIDTH in SELECTOR_WIDTHS
    from engine.fl.selector_schemes import PAPER_SELECTOR_WIDTH

    assert PAPER_SELECTOR_WIDTH == PAPER_WIDTH  # the torch-free copy the learning-rate default reads


def test_parameters_scale_with_the_square_of_the_width_and_the_paper_width_is_vgg11():
    paper = build_selector(3, 3, "gap")
    assert [m.out_channels for m in paper.features if hasattr(m, "out_channels")] == [64, 128, 256, 256, 512, 512,
                                                                                       512, 512]
    narrow = build_selector(3, 3, "gap", 16)
    assert [m.out_channels for m in narrow.features if hasattr(m, "out_channels")] == [16, 32, 64, 64, 128, 128,
                                                                                        128, 128]
    ratio = count_parameters(paper) / count_parameters(narrow)
    assert width_of(paper.state_dict()) == 64 and width_of(narrow.state_dict()) == 16  # read back from weights
    assert 14 < ratio < 17  # the backbone's 16x, diluted a little by the head's fixed 256 units
    import torch

    logits = narrow(torch.zeros(2, 3, 32, 32))
    assert tuple(logits.shape) == (2, 3)


def test_the_default_is_width_16_at_its_measured_rate_and_the_papers_64_keeps_the_papers_rate():
    from engine.bundle.supermodel import DEFAULT_SELECTOR_WIDTH
    from engine.fl.method_spec import TrainingSettings, settings_problems

    assert DEFAULT_SELECTOR_WIDTH == 16
    assert LocalTrainingConfig().selector_width == 16 and LocalTrainingConfig().selector_lr == 3e-3
    assert LocalTrainingConfig(selector_width=64).selector_lr == 1e-3  # the paper's selector, the paper's rate
    assert LocalTrainingConfig(selector_width=64, selector_lr=5e-4).selector_lr == 5e-4
    settings = TrainingSettings()
    assert settings.local_training("fedsm", "cpu").selector_lr == 3e-3
    assert settings.local_training("fedsm-extra", "cpu").selector_lr == 1e-5  # its per-batch scheme's rate
    paper = TrainingSettings(selector_width=64)
    assert paper.local_training("fedsm", "cpu").selector_lr == 1e-3
    # a site's [bounds] judge a null selector_lr at the rate the run will train with
    def limit(key):
        return 2e-3 if key == "max_selector_lr" else None

    run = {"method": "fedsm", "task": "fundus", "site_names": ["site1", "site2"], "selector_lr": None}
    assert any("selector_lr" in p for p in settings_problems(run, limit))
    assert settings_problems({**run, "selector_width": 64}, limit) == []


@pytest.mark.parametrize("width", [0, 12, 128, True, "16"])
def test_other_widths_are_refused_with_the_choices(width):
    with pytest.raises(ConfigError, match=r"selector_width must be one of \(8, 16, 32, 64\)"):
        LocalTrainingConfig(selector_width=width)
    with pytest.raises(ConfigError, match="selector_width must be one of"):
        MethodSpec(method="fedsm", task="fundus", site_names=("site1", "site2"), selector_width=width)


def test_a_narrow_selector_is_recorded_in_the_bundle_and_routes(tmp_path):
    from engine import api
    from engine.bundle import load_bundle, read_metadata
    from engine.inference.predictor import SuperModelPredictor

    api.simulate(tmp_path, task="fundus", sites=2, rounds=1, methods=("fedsm",), image_size=32, seed=0,
                 device="cpu", selector_width=16, keep_best=False)
    path = tmp_path / "supermodel.safetensors"
    assert read_metadata(path).selector_width == 16
    bundle = load_bundle(path)
    assert tuple(bundle.selector_weights["features.0.weight"].shape) == (16, 3, 3, 3)
    predictor = SuperModelPredictor(bundle, device="cpu")
    prediction = predictor.predict(np.zeros((1, 3, 32, 32), dtype=np.float32))
    assert len(prediction.routed) == 1 and prediction.masks.shape[0] == 1 and prediction.masks.shape[2:] == (32, 32)
