"""Super-model bundle file: round trip, atomic writes, and clear errors for every kind of bad file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.bundle import (
    BUNDLE_FORMAT_VERSION,
    BundleMetadata,
    SuperModelBundle,
    file_sha256,
    load_bundle,
    read_metadata,
    save_bundle,
)
from engine.errors import BundleError, ConfigError
from engine.io.files import write_rgb_png
from engine.models import build_segmentation_net, build_selector

SITES = ["site-A", "site_B"]


def make_metadata(**overrides: object) -> BundleMetadata:
    fields: dict[str, object] = dict(
        task="fundus",
        label_names=["disc", "cup"],
        in_channels=3,
        image_size=32,
        selector_size=32,
        site_names=SITES,
        lam=0.7,
        gamma=0.6,
        rounds=3,
        val_dice={"site-A": 0.81, "site_B": None},
        extra={"optimizer": "adam", "lr": 1e-3},
    )
    fields.update(overrides)
    return BundleMetadata(**fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def bundle() -> SuperModelBundle:
    torch.manual_seed(0)
    meta = make_metadata()
    return SuperModelBundle(
        metadata=meta,
        global_weights=build_segmentation_net(3, 2).state_dict(),
        personal_weights={s: build_segmentation_net(3, 2).state_dict() for s in SITES},
        selector_weights=build_selector(3, len(SITES)).state_dict(),
    )


@pytest.fixture(scope="module")
def saved(bundle: SuperModelBundle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bundle") / "model.safetensors"
    save_bundle(path, bundle)
    return path


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b) or set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


# --- round trip -------------------------------------------------------------------------------


def test_round_trip_keeps_every_tensor_and_the_metadata(bundle: SuperModelBundle, tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "sm.safetensors"
    # Execute
    digest = save_bundle(path, bundle)
    loaded = load_bundle(path)
    # Assert
    assert digest == file_sha256(path)
    assert len(digest) == 64
    assert loaded.metadata == bundle.metadata
    assert loaded.source == str(path)
    assert_same_weights(loaded.global_weights, bundle.global_weights)
    assert_same_weights(loaded.selector_weights, bundle.selector_weights)
    assert list(loaded.personal_weights) == SITES
    for site in SITES:
        assert_same_weights(loaded.personal_weights[site], bundle.personal_weights[site])
    # Integer buffers (BatchNorm's counter) keep their dtype.
    counters = [k for k in loaded.selector_weights if k.endswith("num_batches_tracked")]
    assert counters and loaded.selector_weights[counters[0]].dtype == torch.int64


def test_tensor_names_are_namespaced(saved: Path) -> None:
    header = read_header(saved)
    names = [n for n in header if n != "__metadata__"]
    assert any(n.startswith("global.model.") for n in names)
    assert any(n.startswith("personal.site-A.") for n in names)
    assert any(n.startswith("personal.site_B.") for n in names)
    assert any(n.startswith("selector.features.") for n in names)
    meta = json.loads(header["__metadata__"]["fedsm"])
    assert meta["format"] == "fedsm-supermodel"
    assert meta["format_version"] == 1
    assert meta["site_names"] == SITES
    assert meta["method"] == "fedsm" and meta["routing"] == "gamma"


def test_read_metadata_matches_and_created_is_utc(saved: Path, bundle: SuperModelBundle) -> None:
    meta = read_metadata(saved)
    assert meta == bundle.metadata
    assert meta.created.endswith("+00:00")
    assert meta.normalisation == "rgb/255"
    assert meta.model_names == ["global", *SITES]
    assert meta.selector_classes == 2


def test_non_contiguous_and_shared_tensors_are_saved(tmp_path: Path, bundle: SuperModelBundle) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    weights = dict(bundle.global_weights)
    weights["extra_t"] = base.t()  # non-contiguous view
    weights["extra_same"] = base  # shares storage with the view
    odd = SuperModelBundle(bundle.metadata, weights, bundle.personal_weights, bundle.selector_weights)
    path = tmp_path / "odd.safetensors"
    save_bundle(path, odd)
    loaded = load_bundle(path)
    assert torch.equal(loaded.global_weights["extra_t"], base.t())
    assert torch.equal(loaded.global_weights["extra_same"], base)


def test_metadata_json_round_trip() -> None:
    meta = make_metadata(method="fedsm-extra", routing="argmax")
    again = BundleMetadata.from_json(meta.to_json())
    assert again == meta
    assert again.selector_classes == 3


# --- atomic writes and no pickle -------------------------------------------------------------


def test_save_leaves_no_temporary_files(tmp_path: Path, bundle: SuperModelBundle) -> None:
    save_bundle(tmp_path / "a.safetensors", bundle)
    save_bundle(tmp_path / "a.safetensors", bundle)  # overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def test_failed_save_keeps_the_old_file(
    tmp_path: Path, bundle: SuperModelBundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a.safetensors"
    save_bundle(path, bundle)
    before = file_sha256(path)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_bundle(path, bundle)
    assert file_sha256(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def test_file_is_safetensors_not_pickle(saved: Path) -> None:
    raw = saved.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert 8 + header_len <= len(raw)
    assert raw[8:9] == b"{"
    json.loads(raw[8 : 8 + header_len])
    assert not raw.startswith(b"\x80")  # pickle protocol marker
    assert not raw.startswith(b"PK")  # torch.save zip archive


def test_loading_never_unpickles(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr("pickle.loads", forbidden)
    monkeypatch.setattr("pickle.load", forbidden)
    assert load_bundle(saved).metadata.site_names == SITES


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a.b", "site A", "", "global", "ü", "a/b"])
def test_unsafe_site_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=r"site name|reserved"):
        make_metadata(site_names=[name], val_dice={})


def test_duplicate_sites_and_inconsistent_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="duplicates"):
        make_metadata(site_names=["a", "a"], val_dice={})
    with pytest.raises(ConfigError, match="routes with"):
        make_metadata(method="fedsm", routing="argmax")
    with pytest.raises(ConfigError, match="gamma"):
        make_metadata(gamma=1.5)
    with pytest.raises(ConfigError, match="multiple of 16"):
        make_metadata(image_size=50)
    with pytest.raises(ConfigError, match="in_channels"):
        make_metadata(in_channels=1)
    with pytest.raises(ConfigError, match="val_dice"):
        make_metadata(val_dice={"elsewhere": 0.5})
    with pytest.raises(ConfigError, match="unknown task"):
        make_metadata(task="liver")


def test_personal_weights_must_match_declared_sites(bundle: SuperModelBundle, tmp_path: Path) -> None:
    partial = SuperModelBundle(
        bundle.metadata,
        bundle.global_weights,
        {"site-A": bundle.personal_weights["site-A"]},
        bundle.selector_weights,
    )
    with pytest.raises(ConfigError, match="declares"):
        save_bundle(tmp_path / "x.safetensors", partial)
    assert list(tmp_path.iterdir()) == []


# --- bad files -------------------------------------------------------------------------------


def read_header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def assert_bundle_error(path: Path, *fragments: str) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_file(tmp_path: Path) -> None:
    assert_bundle_error(tmp_path / "nope.safetensors", "not found")


def test_folder_instead_of_file(tmp_path: Path) -> None:
    assert_bundle_error(tmp_path, "folder")


def test_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "random.safetensors"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_bundle_error(path, "not a FedSM super-model file")


def test_tiny_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"abc")
    assert_bundle_error(path, "not a FedSM super-model file")


def test_png_renamed(tmp_path: Path) -> None:
    path = tmp_path / "photo.safetensors"
    write_rgb_png(tmp_path / "photo.png", np.zeros((8, 8, 3), np.uint8))
    path.write_bytes((tmp_path / "photo.png").read_bytes())
    assert_bundle_error(path, "not a FedSM super-model file")


def test_truncated_in_the_data(saved: Path, tmp_path: Path) -> None:
    raw = saved.read_bytes()
    path = tmp_path / "half.safetensors"
    path.write_bytes(raw[: len(raw) // 2])
    assert_bundle_error(path, "truncated")


def test_truncated_in_the_header(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "head.safetensors"
    path.write_bytes(saved.read_bytes()[:100])
    assert_bundle_error(path, "truncated")


def test_trailing_garbage(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "long.safetensors"
    path.write_bytes(saved.read_bytes() + b"garbage")
    assert_bundle_error(path, "corrupt")


def test_foreign_safetensors_file(tmp_path: Path) -> None:
    path = tmp_path / "foreign.safetensors"
    save_file({"weight": torch.zeros(3)}, str(path))
    assert_bundle_error(path, "was not written by FedSM")
    other = tmp_path / "other.safetensors"
    save_file({"weight": torch.zeros(3)}, str(other), metadata={"format": "pt"})
    assert_bundle_error(other, "was not written by FedSM")


def rewrite_metadata(saved: Path, target: Path, change: dict) -> None:
    """Copy the saved bundle's tensors to ``target`` with modified FedSM metadata."""
    bundle = load_bundle(saved)
    meta = json.loads(bundle.metadata.to_json())
    meta.update(change)
    flat = {f"global.{k}": v for k, v in bundle.global_weights.items()}
    flat.update({f"selector.{k}": v for k, v in bundle.selector_weights.items()})
    for site, weights in bundle.personal_weights.items():
        flat.update({f"personal.{site}.{k}": v for k, v in weights.items()})
    save_file(flat, str(target), metadata={"fedsm": json.dumps(meta)})


def test_newer_format_version(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "future.safetensors"
    rewrite_metadata(saved, path, {"format_version": BUNDLE_FORMAT_VERSION + 1, "new_field": 1})
    assert_bundle_error(path, "upgrade FedSM", f"version {BUNDLE_FORMAT_VERSION + 1}")


def test_wrong_format_name(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "wrong.safetensors"
    rewrite_metadata(saved, path, {"format": "something-else"})
    assert_bundle_error(path, "not written by FedSM")


def test_invalid_metadata_is_a_bundle_error(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    rewrite_metadata(saved, path, {"gamma": 7})
    assert_bundle_error(path, "gamma")


def test_missing_tensors_for_a_declared_site(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "missing.safetensors"
    rewrite_metadata(saved, path, {"site_names": [*SITES, "site-C"]})
    assert_bundle_error(path, "site-C", "no weights")


def test_tensors_for_an_undeclared_site(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "undeclared.safetensors"
    rewrite_metadata(saved, path, {"site_names": ["site-A"], "val_dice": {}})
    assert_bundle_error(path, "site_B", "does not declare")
