"""Routed super-model inference: shapes, routing, only routed models run, progress and cancel."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.bundle import BundleMetadata, SuperModelBundle
from engine.data.preprocess import resize_images
from engine.device import resolve_device
from engine.errors import BundleError, CancelledError, ConfigError, DataError, DeviceError
from engine.inference.predictor import Prediction, SuperModelPredictor
from engine.models import build_segmentation_net, build_selector

SITES = ["alpha", "beta"]


def make_bundle(method: str = "fedsm", gamma: float = 0.5) -> SuperModelBundle:
    torch.manual_seed(0)
    routing = "argmax" if method == "fedsm-extra" else "gamma"
    meta = BundleMetadata(
        task="fundus",
        label_names=["disc", "cup"],
        in_channels=3,
        image_size=32,
        selector_size=32,
        site_names=SITES,
        method=method,
        routing=routing,
        gamma=gamma,
    )
    return SuperModelBundle(
        metadata=meta,
        global_weights=build_segmentation_net(3, 2).state_dict(),
        personal_weights={s: build_segmentation_net(3, 2).state_dict() for s in SITES},
        selector_weights=build_selector(3, meta.selector_classes).state_dict(),
    )


@pytest.fixture(scope="module")
def bundle() -> SuperModelBundle:
    return make_bundle()


@pytest.fixture(scope="module")
def predictor(bundle: SuperModelBundle) -> SuperModelPredictor:
    return SuperModelPredictor(bundle, device="cpu")


class BrightnessSelector(nn.Module):
    """Stub selector that routes by image brightness, to make routing predictable.

    mean < 0.3 -> equal logits (p = 0.5 each, not above gamma 0.5 -> global);
    mean < 0.6 -> site 1 sure; otherwise site 2 sure.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=(1, 2, 3))
        logits = torch.zeros(len(x), 2)
        logits[(mean >= 0.3) & (mean < 0.6), 0] = 10.0
        logits[mean >= 0.6, 1] = 10.0
        return logits


def constant_images(values: list[float], height: int = 50, width: int = 70) -> np.ndarray:
    return np.stack([np.full((3, height, width), v, dtype=np.float32) for v in values])


@contextlib.contextmanager
def spy_calls(predictor: SuperModelPredictor) -> Iterator[dict[int, list[int]]]:
    """Record the batch sizes each U-Net sees, keyed by routed model index."""
    seen: dict[int, list[int]] = {index: [] for index in range(predictor.num_models)}
    handles = [
        predictor.segmentation_net(index).register_forward_hook(
            lambda module, args, output, index=index: seen[index].append(int(args[0].shape[0]))
        )
        for index in seen
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@pytest.fixture
def routed_predictor(predictor: SuperModelPredictor, monkeypatch: pytest.MonkeyPatch) -> SuperModelPredictor:
    monkeypatch.setattr(predictor, "selector", BrightnessSelector())
    return predictor


# --- shapes ----------------------------------------------------------------------------------


def test_outputs_are_at_the_input_resolution(predictor: SuperModelPredictor) -> None:
    images = np.random.default_rng(0).random((3, 3, 50, 70), dtype=np.float32)
    pred = predictor.predict(images, batch_size=2)
    assert pred.masks.shape == (3, 2, 50, 70)
    assert pred.masks.dtype == np.uint8
    assert set(np.unique(pred.masks)) <= {0, 1}
    assert pred.routed.shape == (3,) and pred.routed.dtype == np.int64
    assert pred.probabilities.shape == (3, 2) and pred.probabilities.dtype == np.float32
    np.testing.assert_allclose(pred.probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert pred.confidence.dtype == np.float32
    np.testing.assert_allclose(pred.confidence, pred.probabilities.max(axis=1))


def test_odd_small_inputs_are_resized_back(predictor: SuperModelPredictor) -> None:
    pred = predictor.predict(np.random.default_rng(1).random((1, 3, 17, 23), dtype=np.float32))
    assert pred.masks.shape == (1, 2, 17, 23)


def test_masks_are_the_routed_net_output_resized(predictor: SuperModelPredictor) -> None:
    images = np.random.default_rng(2).random((2, 3, 50, 70), dtype=np.float32)
    pred = predictor.predict(images, force_model=1)
    with torch.no_grad():
        logits = predictor.personal_nets[0](torch.from_numpy(resize_images(images, 32)))
        prob = F.interpolate(torch.sigmoid(logits), size=(50, 70), mode="bilinear", antialias=True)
    np.testing.assert_array_equal(pred.masks, (prob > 0.5).numpy().astype(np.uint8))


def test_no_images(predictor: SuperModelPredictor) -> None:
    pred = predictor.predict(np.zeros((0, 3, 40, 40), dtype=np.float32))
    assert pred.masks.shape == (0, 2, 40, 40)
    assert pred.routed.shape == (0,)


# --- routing ---------------------------------------------------------------------------------


def test_only_routed_models_run(routed_predictor: SuperModelPredictor) -> None:
    # Prepare: 1 image for global, 5 for site 1, 0 for site 2.
    images = constant_images([0.1, 0.4, 0.45, 0.5, 0.4, 0.55])
    with spy_calls(routed_predictor) as seen:
        # Execute
        pred = routed_predictor.predict(images, batch_size=2)
    # Assert
    assert pred.routed.tolist() == [0, 1, 1, 1, 1, 1]
    assert seen[0] == [1]
    assert seen[1] == [2, 2, 1]
    assert seen[2] == []
    assert pred.routed_names(SITES) == ["global", "alpha", "alpha", "alpha", "alpha", "alpha"]


def test_gamma_argument_overrides_the_bundle(routed_predictor: SuperModelPredictor) -> None:
    images = constant_images([0.1, 0.4, 0.9])
    assert routed_predictor.predict(images).routed.tolist() == [0, 1, 2]
    # The sure images have p ~ 0.99995; a gamma of 1 sends everything to the global model.
    assert routed_predictor.predict(images, gamma=1.0).routed.tolist() == [0, 0, 0]
    # p = 0.5 exactly is not above gamma = 0.5, but is above 0.49.
    assert routed_predictor.predict(images, gamma=0.49).routed.tolist() == [1, 1, 2]


def test_force_model_runs_only_that_model(routed_predictor: SuperModelPredictor) -> None:
    images = constant_images([0.1, 0.4, 0.9])
    with spy_calls(routed_predictor) as seen:
        pred = routed_predictor.predict(images, force_model=2)
    assert pred.routed.tolist() == [2, 2, 2]
    assert seen[0] == [] and seen[1] == [] and seen[2] == [3]
    assert pred.probabilities.shape == (3, 2)  # the selector still reports


@pytest.mark.parametrize("bad", [-1, 3, True, 1.0])
def test_bad_force_model(predictor: SuperModelPredictor, bad: object) -> None:
    with pytest.raises(ConfigError, match="force_model"):
        predictor.predict(constant_images([0.1]), force_model=bad)  # type: ignore[arg-type]


def test_fedsm_extra_routes_by_argmax_over_k_plus_one() -> None:
    predictor = SuperModelPredictor(make_bundle("fedsm-extra"), device="cpu")
    images = np.random.default_rng(3).random((4, 3, 40, 40), dtype=np.float32)
    pred = predictor.predict(images)
    assert pred.probabilities.shape == (4, 3)
    np.testing.assert_array_equal(pred.routed, pred.probabilities.argmax(axis=1))


# --- progress, cancel, bad input -----------------------------------------------------------------


def test_progress_counts_selector_and_segmentation_steps(routed_predictor: SuperModelPredictor) -> None:
    calls: list[tuple[int, int]] = []
    routed_predictor.predict(
        constant_images([0.1, 0.4, 0.9, 0.4, 0.4]), batch_size=2, progress=lambda d, t: calls.append((d, t))
    )
    # Selector: 3 batches (2, 2, 1); U-Nets: global 1, site 1 2+1, site 2 1 -> 4 batches.
    assert len(calls) == 7
    assert all(t == 10 for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert calls[-1] == (10, 10)


def test_cancel_raises_and_stops_work(routed_predictor: SuperModelPredictor) -> None:
    with spy_calls(routed_predictor) as seen, pytest.raises(CancelledError, match="cancelled"):
        routed_predictor.predict(constant_images([0.1, 0.4]), cancel=lambda: True)
    assert all(not calls for calls in seen.values())


def test_cancel_during_segmentation(routed_predictor: SuperModelPredictor) -> None:
    checks = iter([False, False, True])  # two selector batches pass, first U-Net batch is refused
    with pytest.raises(CancelledError, match="segmentation"):
        routed_predictor.predict(constant_images([0.1, 0.4, 0.9]), batch_size=2, cancel=lambda: next(checks))


def test_wrong_image_layout_is_a_data_error(predictor: SuperModelPredictor) -> None:
    with pytest.raises(DataError, match=r"\(N, 3, H, W\)"):
        predictor.predict(np.zeros((2, 50, 70, 3), dtype=np.float32))
    with pytest.raises(DataError, match="floating"):
        predictor.predict(np.zeros((1, 3, 8, 8), dtype=np.uint8))
    with pytest.raises(ConfigError, match="batch_size"):
        predictor.predict(np.zeros((1, 3, 8, 8), dtype=np.float32), batch_size=0)


# --- weights that do not fit -------------------------------------------------------------------


def test_weights_with_wrong_shapes_are_a_bundle_error(bundle: SuperModelBundle) -> None:
    personal = dict(bundle.personal_weights)
    personal["beta"] = build_segmentation_net(3, 1).state_dict()  # one output channel too few
    bad = SuperModelBundle(
        bundle.metadata, bundle.global_weights, personal, bundle.selector_weights, source="bad.safetensors"
    )
    with pytest.raises(BundleError, match=r"bad\.safetensors.*site 'beta'.*wrong shape") as info:
        SuperModelPredictor(bad, device="cpu")
    assert "expects" in str(info.value)


def test_missing_and_unexpected_keys_are_a_bundle_error(bundle: SuperModelBundle) -> None:
    weights = dict(bundle.global_weights)
    dropped = next(iter(weights))
    del weights[dropped]
    weights["stray.weight"] = torch.zeros(1)
    bad = SuperModelBundle(bundle.metadata, weights, bundle.personal_weights, bundle.selector_weights)
    with pytest.raises(BundleError, match="global model") as info:
        SuperModelPredictor(bad, device="cpu")
    assert dropped in str(info.value) and "stray.weight" in str(info.value)


def test_selector_for_the_wrong_number_of_sites(bundle: SuperModelBundle) -> None:
    bad = SuperModelBundle(
        bundle.metadata, bundle.global_weights, bundle.personal_weights, build_selector(3, 3).state_dict()
    )
    with pytest.raises(BundleError, match="selector"):
        SuperModelPredictor(bad, device="cpu")


def test_non_finite_weights_are_a_bundle_error(bundle: SuperModelBundle) -> None:
    weights = {k: v.clone() for k, v in bundle.global_weights.items()}
    key = next(k for k, v in weights.items() if v.dtype.is_floating_point)
    weights[key][...] = float("nan")
    bad = SuperModelBundle(bundle.metadata, weights, bundle.personal_weights, bundle.selector_weights)
    with pytest.raises(BundleError, match="NaN"):
        SuperModelPredictor(bad, device="cpu")


def test_prediction_routed_names() -> None:
    pred = Prediction(
        np.zeros((3, 1, 2, 2), np.uint8),
        np.array([0, 2, 1]),
        np.zeros((3, 2), np.float32),
        np.zeros(3, np.float32),
    )
    assert pred.routed_names(["a", "b"]) == ["global", "b", "a"]


# --- device --------------------------------------------------------------------------------------


def test_resolve_device_cpu() -> None:
    assert resolve_device("cpu") == (torch.device("cpu"), False)
    assert resolve_device(" CPU ") == (torch.device("cpu"), False)


def test_resolve_device_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == (torch.device("cpu"), False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == (torch.device("cuda"), True)


def test_resolve_device_cuda_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"no CUDA GPU.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(DeviceError):
        resolve_device("cuda:0")


def test_resolve_device_cuda_index_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == (torch.device("cuda:0"), True)
    with pytest.raises(DeviceError, match="only 1"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:x", ""])
def test_resolve_device_unknown(name: str) -> None:
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_device(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_mixed_precision_matches_shapes(bundle: SuperModelBundle) -> None:
    gpu = SuperModelPredictor(bundle, device="cuda")
    assert gpu.use_amp
    pred = gpu.predict(np.random.default_rng(0).random((3, 3, 50, 70), dtype=np.float32))
    assert pred.masks.shape == (3, 2, 50, 70)
