"""Segmenting files on disk: masks, routing.json, and clear errors for inputs that do not fit."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from engine.bundle import BundleMetadata, SuperModelBundle, file_sha256, load_bundle, save_bundle
from engine.data.preprocess import normalise_volume, slices_to_volume, volume_to_slices
from engine.errors import DataError
from engine.inference.predictor import SuperModelPredictor
from engine.inference.run import infer_path
from engine.inference.study import masks_to_label_map
from engine.io.files import read_label_png, read_nifti, write_nifti, write_rgb_png
from engine.models import build_segmentation_net, build_selector
from engine.tasks import TaskSpec, get_task

SITES = ["north", "south"]


def write_bundle(path: Path, task_name: str, method: str = "fedsm") -> Path:
    torch.manual_seed(0)
    task = get_task(task_name)
    meta = BundleMetadata(
        task=task.name,
        label_names=list(task.label_names),
        in_channels=task.in_channels,
        image_size=32,
        selector_size=32,
        site_names=SITES,
        method=method,
        routing="argmax" if method == "fedsm-extra" else "gamma",
        gamma=0.5,
    )
    out = task.out_channels
    save_bundle(
        path,
        SuperModelBundle(
            metadata=meta,
            global_weights=build_segmentation_net(task.in_channels, out).state_dict(),
            personal_weights={s: build_segmentation_net(task.in_channels, out).state_dict() for s in SITES},
            selector_weights=build_selector(task.in_channels, meta.selector_classes).state_dict(),
        ),
    )
    return path


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bundles")
    return {
        "fundus": write_bundle(folder / "fundus.safetensors", "fundus"),
        "prostate": write_bundle(folder / "prostate.safetensors", "prostate", method="fedsm-extra"),
    }


def photo(path: Path, height: int = 50, width: int = 70, seed: int = 0) -> Path:
    write_rgb_png(path, np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
    return path


AFFINE = np.array(
    [
        [0.6, 0.0, 0.0, -12.5],
        [0.0, 0.7, 0.1, 30.0],
        [0.0, 0.0, 3.0, 7.25],
        [0.0, 0.0, 0.0, 1.0],
    ]
)


def volume(path: Path, shape: tuple[int, int, int] = (40, 36, 5)) -> Path:
    data = np.random.default_rng(1).normal(300.0, 80.0, shape).astype(np.float32)
    write_nifti(path, data, AFFINE)
    return path


# --- 2D photos -----------------------------------------------------------------------------------


def test_photo_gives_a_mask_png_and_routing_json(bundles: dict[str, Path], tmp_path: Path) -> None:
    # Prepare
    source = photo(tmp_path / "eye.png")
    out = tmp_path / "out"
    calls: list[tuple[int, int]] = []
    # Execute
    result = infer_path(
        bundles["fundus"], source, out, gamma=0.3, device="cpu", progress=lambda d, t: calls.append((d, t))
    )
    # Assert
    mask = read_label_png(out / "eye_mask.png")
    assert mask.shape == (50, 70)
    assert set(np.unique(mask)) <= {0, 1, 2}
    assert json.loads((out / "routing.json").read_text()) == result
    bundle_file = bundles["fundus"]
    assert result["bundle"] == {"path": str(bundle_file.resolve()), "sha256": file_sha256(bundle_file)}
    assert result["gamma"] == 0.3
    assert result["device"] == "cpu"
    [entry] = result["inputs"]
    assert entry["input"] == str(source.resolve())
    assert entry["mask"] == "eye_mask.png"
    assert entry["shape"] == [50, 70]
    [record] = entry["images"]
    assert record["index"] == 0
    assert record["model"] in ["global", *SITES]
    assert set(record["probabilities"]) == set(SITES)
    assert record["confidence"] == pytest.approx(max(record["probabilities"].values()))
    # routing decision follows Algorithm 2 with the given gamma
    best_site = max(record["probabilities"], key=record["probabilities"].get)
    assert record["model"] == (best_site if record["confidence"] > 0.3 else "global")
    assert calls[-1] == (2, 2)
    assert sorted(p.name for p in out.iterdir()) == ["eye_mask.png", "routing.json"]


def test_folder_of_photos(bundles: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    photo(folder / "b.jpg", 40, 40, seed=1)
    photo(folder / "a.png", 33, 47, seed=2)
    (folder / "notes.txt").write_text("ignored")
    result = infer_path(bundles["fundus"], folder, tmp_path / "out", device="cpu")
    assert [e["mask"] for e in result["inputs"]] == ["a_mask.png", "b_mask.png"]
    assert read_label_png(tmp_path / "out" / "a_mask.png").shape == (33, 47)
    assert result["gamma"] == 0.5  # the bundle's


def test_rerun_into_the_input_folder_skips_old_masks(bundles: dict[str, Path], tmp_path: Path) -> None:
    photo(tmp_path / "eye.png")
    infer_path(bundles["fundus"], tmp_path, tmp_path, device="cpu")
    result = infer_path(bundles["fundus"], tmp_path, tmp_path, device="cpu")
    assert [e["mask"] for e in result["inputs"]] == ["eye_mask.png"]


# --- volumes -------------------------------------------------------------------------------------


def test_volume_gives_a_nifti_mask_with_the_source_affine(bundles: dict[str, Path], tmp_path: Path) -> None:
    source = volume(tmp_path / "case01.nii.gz")
    out = tmp_path / "out"
    result = infer_path(bundles["prostate"], source, out, device="cpu")
    img = nib.load(str(out / "case01_mask.nii.gz"))
    assert img.shape == (40, 36, 5)
    np.testing.assert_allclose(img.affine, AFFINE, atol=1e-5)
    data = np.asarray(img.dataobj)
    assert data.dtype == np.uint8
    assert set(np.unique(data)) <= {0, 1}
    [entry] = result["inputs"]
    assert entry["kind"] == "volume"
    assert [r["index"] for r in entry["images"]] == [0, 1, 2, 3, 4]
    # FedSM-extra: probabilities over global + sites, argmax routing, no gamma.
    assert set(entry["images"][0]["probabilities"]) == {"global", *SITES}
    assert result["routing"] == "argmax" and result["gamma"] is None
    assert sum(entry["models_used"].values()) == 5
    # Slice z of the mask is the predictor's mask of slice z (no flips or transposes on the way).
    slices = volume_to_slices(normalise_volume(read_nifti(source)[0]))
    direct = SuperModelPredictor(load_bundle(bundles["prostate"]), device="cpu").predict(slices)
    np.testing.assert_array_equal(data, slices_to_volume(direct.masks[:, 0]))
    assert [r["model"] for r in entry["images"]] == direct.routed_names(SITES)


def test_multi_label_volumes_number_channels_from_one_later_wins() -> None:
    task = TaskSpec("two", 1, ("outer", "inner"), "volume-percentile-1-99", volumetric=True)
    masks = np.zeros((2, 3, 1, 1), dtype=np.uint8)
    masks[0, :2] = 1  # outer in slices 0, 1
    masks[1, 1:] = 1  # inner in slices 1, 2
    assert masks_to_label_map(task, masks).ravel().tolist() == [1, 2, 2]


def test_uncompressed_nifti(bundles: dict[str, Path], tmp_path: Path) -> None:
    volume(tmp_path / "case.nii", shape=(20, 24, 3))
    result = infer_path(bundles["prostate"], tmp_path / "case.nii", tmp_path / "out", device="cpu")
    assert result["inputs"][0]["mask"] == "case_mask.nii.gz"
    assert nib.load(str(tmp_path / "out" / "case_mask.nii.gz")).shape == (20, 24, 3)


# --- errors --------------------------------------------------------------------------------------


def test_photo_with_a_prostate_bundle(bundles: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"2D photo.*prostate"):
        infer_path(bundles["prostate"], photo(tmp_path / "eye.png"), tmp_path / "out", device="cpu")
    assert not (tmp_path / "out").exists()


def test_volume_with_a_fundus_bundle(bundles: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"NIfTI volume.*fundus"):
        infer_path(bundles["fundus"], volume(tmp_path / "v.nii.gz"), tmp_path / "out", device="cpu")


def test_unsupported_suffix(bundles: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "scan.dcm"
    path.write_bytes(b"DICM")
    with pytest.raises(DataError, match=r"unsupported.*\.png.*\.nii\.gz"):
        infer_path(bundles["fundus"], path, tmp_path / "out", device="cpu")


def test_empty_folder(bundles: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no files to segment.*\.png"):
        infer_path(bundles["fundus"], tmp_path / "empty", tmp_path / "out", device="cpu")
    (tmp_path / "empty" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match="no files to segment"):
        infer_path(bundles["fundus"], tmp_path / "empty", tmp_path / "out", device="cpu")


def test_missing_input(bundles: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        infer_path(bundles["fundus"], tmp_path / "nope.png", tmp_path / "out", device="cpu")


def test_two_inputs_for_one_mask_name(bundles: dict[str, Path], tmp_path: Path) -> None:
    photo(tmp_path / "eye.png")
    photo(tmp_path / "eye.jpg")
    with pytest.raises(DataError, match=r"eye_mask\.png"):
        infer_path(bundles["fundus"], tmp_path, tmp_path / "out", device="cpu")


def test_unreadable_photo(bundles: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "broken.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"broken\.png"):
        infer_path(bundles["fundus"], tmp_path / "broken.png", tmp_path / "out", device="cpu")
