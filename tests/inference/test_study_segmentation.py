"""Segmenting a Study: labels aligned with it, one record per slice, gamma/force/cancel, caching."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_predictor import BrightnessSelector
from test_run import SITES, write_bundle

from engine.data.preprocess import normalise_volume, slices_to_volume, volume_to_slices
from engine.errors import CancelledError, ConfigError, DataError
from engine.inference import study as study_module
from engine.inference.study import load_predictor, segment_study
from engine.io.export import export_mask, read_provenance
from engine.io.study import Study


@pytest.fixture(scope="module")
def bundle_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    folder = tmp_path_factory.mktemp("study-bundles")
    files = {
        "fundus": write_bundle(folder / "fundus.safetensors", "fundus"),
        "prostate": write_bundle(folder / "prostate.safetensors", "prostate"),
        "extra": write_bundle(folder / "extra.safetensors", "prostate", method="fedsm-extra"),
    }
    yield files
    study_module.clear_predictor_cache()


@pytest.fixture
def brightness_routed(bundle_files: dict[str, Path]) -> Iterator[Path]:
    """The prostate bundle, whose cached predictor routes by slice brightness (see BrightnessSelector)."""
    study_module.clear_predictor_cache()
    loaded = load_predictor(bundle_files["prostate"], "cpu")
    real = loaded.predictor.selector
    loaded.predictor.selector = BrightnessSelector()
    yield bundle_files["prostate"]
    loaded.predictor.selector = real
    study_module.clear_predictor_cache()


def volume_study(shape: tuple[int, int, int] = (40, 36, 5), slice_values: list[float] | None = None) -> Study:
    if slice_values is None:
        array = np.random.default_rng(1).normal(300.0, 80.0, shape).astype(np.float32)
    else:
        array = np.stack([np.full(shape[:2], v, np.float32) for v in slice_values], axis=2)
    affine = np.diag([0.6, 0.7, 3.0, 1.0])
    return Study(array, "volume", affine, (0.6, 0.7, 3.0), modality="MR", source_format="nifti")


def photo_study() -> Study:
    array = np.random.default_rng(2).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    return Study(array, "photo", np.eye(4), (1.0, 1.0), modality="OP", source_format="png")


def test_volume_labels_follow_the_study_slice_by_slice(bundle_files: dict[str, Path]) -> None:
    # Prepare
    study = volume_study()
    calls: list[tuple[int, int]] = []
    # Execute
    seg = segment_study(bundle_files["extra"], study, device="cpu", progress=lambda d, t: calls.append((d, t)))
    # Assert
    assert seg.labels.array.shape == study.shape == (40, 36, 5)
    assert seg.labels.array.dtype == np.uint8 and set(np.unique(seg.labels.array)) <= {0, 1}
    assert seg.labels.names == {1: "prostate"}
    assert [r.index for r in seg.records] == [0, 1, 2, 3, 4]
    assert seg.model_names == ("global", *SITES)
    assert seg.gamma is None and seg.routing == "argmax" and seg.device == "cpu"
    assert calls[-1] == (10, 10)
    # Slice k of the labels is the predictor's mask of axial slice array[:, :, k].
    predictor = load_predictor(bundle_files["extra"], "cpu").predictor
    direct = predictor.predict(volume_to_slices(normalise_volume(study.array)))
    np.testing.assert_array_equal(seg.labels.array, slices_to_volume(direct.masks[:, 0]))
    for record, probs in zip(seg.records, direct.probabilities, strict=True):
        assert set(record.probabilities) == {"global", *SITES}  # FedSM-extra: K + 1 classes
        assert record.confidence == pytest.approx(float(probs.max()))
        ranked = sorted(record.probabilities, key=record.probabilities.get, reverse=True)
        assert record.model == ranked[0] and record.runner_up == ranked[1]


def test_photo_gives_one_record_and_origa_labels(bundle_files: dict[str, Path]) -> None:
    study = photo_study()
    seg = segment_study(bundle_files["fundus"], study, device="cpu", gamma=0.3)
    assert seg.labels.array.shape == (50, 70)
    assert set(np.unique(seg.labels.array)) <= {0, 1, 2}
    assert seg.labels.names == {1: "rim", 2: "cup"}
    [record] = seg.records
    assert record.index == 0 and set(record.probabilities) == set(SITES)
    assert seg.gamma == 0.3


def test_gamma_and_force_model_change_routing(brightness_routed: Path) -> None:
    # Slices normalise to brightness 0, 0.45, 0.45, 1, 1: undecided (p = 0.5 each), site 1, site 2.
    study = volume_study(slice_values=[0.0, 45.0, 45.0, 100.0, 100.0])
    default = segment_study(brightness_routed, study, device="cpu")  # bundle gamma 0.5: 0.5 is not > 0.5
    assert [r.model for r in default.records] == ["global", "north", "north", "south", "south"]
    assert default.records[0].runner_up == "south" and default.records[1].runner_up == "south"
    low = segment_study(brightness_routed, study, device="cpu", gamma=0.4)
    assert [r.model for r in low.records] == ["north", "north", "north", "south", "south"]
    high = segment_study(brightness_routed, study, device="cpu", gamma=1.0)
    assert [r.model for r in high.records] == ["global"] * 5
    forced = segment_study(brightness_routed, study, device="cpu", force_model="south")
    assert [r.model for r in forced.records] == ["south"] * 5
    assert forced.forced_model == "south"
    assert [r.probabilities for r in forced.records] == [r.probabilities for r in default.records]
    assert segment_study(brightness_routed, study, device="cpu", force_model=0).forced_model == "global"
    assert default.models_used == {"global": 1, "north": 2, "south": 2}


def test_cancel_raises_and_bad_settings_are_refused(bundle_files: dict[str, Path]) -> None:
    study = volume_study(shape=(20, 20, 6))
    with pytest.raises(CancelledError, match="cancelled"):
        segment_study(bundle_files["prostate"], study, device="cpu", batch_size=2, cancel=lambda: True)
    checks = iter([False, False, True])  # cancel on the third batch
    with pytest.raises(CancelledError):
        segment_study(bundle_files["prostate"], study, device="cpu", batch_size=2, cancel=lambda: next(checks))
    with pytest.raises(ConfigError, match=r"'nowhere' is not a model.*global, north, south"):
        segment_study(bundle_files["prostate"], study, device="cpu", force_model="nowhere")
    with pytest.raises(ConfigError, match="gamma"):
        segment_study(bundle_files["prostate"], study, device="cpu", gamma=1.5)


def test_kind_mismatch_is_a_data_error(bundle_files: dict[str, Path]) -> None:
    with pytest.raises(DataError, match=r"is a volume, but the bundle fundus\.safetensors segments fundus"):
        segment_study(bundle_files["fundus"], volume_study(), device="cpu")
    with pytest.raises(DataError, match="is a 2D photo"):
        segment_study(bundle_files["prostate"], photo_study(), device="cpu")


def test_predictors_are_cached_by_bundle_and_device(bundle_files: dict[str, Path], tmp_path: Path) -> None:
    study_module.clear_predictor_cache()
    first = load_predictor(bundle_files["prostate"], "cpu")
    assert load_predictor(bundle_files["prostate"], "auto" if first.predictor.device.type == "cpu" else "cpu") \
        .predictor is first.predictor
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(bundle_files["prostate"].read_bytes())
    assert load_predictor(copy, "cpu").predictor is first.predictor  # same content, same sha256
    other = load_predictor(bundle_files["extra"], "cpu")
    assert other.predictor is not first.predictor and other.sha256 != first.sha256


def test_provenance_travels_with_the_exported_mask(bundle_files: dict[str, Path], tmp_path: Path) -> None:
    study = volume_study()
    seg = segment_study(bundle_files["prostate"], study, device="cpu", gamma=0.7)
    prov = seg.provenance()
    assert (prov.bundle_name, prov.gamma, prov.task, prov.method) == ("prostate.safetensors", 0.7, "prostate", "fedsm")
    assert len(prov.images) == 5 and prov.labels == {1: "prostate"}
    out = export_mask(study, seg.labels, tmp_path / "case_mask.nii.gz", prov)
    assert read_provenance(out) == prov


def test_describe_device_says_which_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from engine.api import describe_device

    assert describe_device("cpu") == {
        "requested": "cpu", "cuda_available": torch.cuda.is_available(),
        "gpus": describe_device("cpu")["gpus"], "device": "cpu", "available": True, "mixed_precision": False,
        "name": "CPU", "reason": "CPU requested",
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    auto = describe_device("auto")
    assert auto["device"] == "cpu" and auto["reason"].startswith("CUDA not available: ")
    cuda = describe_device("cuda")
    assert cuda["device"] is None and cuda["available"] is False and "no CUDA GPU is visible" in cuda["reason"]
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        describe_device("tpu")
