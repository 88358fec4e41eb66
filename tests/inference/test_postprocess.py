"""Mask cleaning (largest component, holes, cup inside disc) and the cup-to-disc ratio on cleaned masks."""

from __future__ import annotations

import numpy as np
import pytest

from engine.inference.cup_disc import vertical_cup_to_disc
from engine.inference.postprocess import clean_fundus_masks, fill_holes, largest_component

NAMES = {1: "rim", 2: "cup"}


def _disc_and_cup(size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    yy, xx = np.mgrid[:size, :size]
    disc = (yy - 32) ** 2 + (xx - 30) ** 2 <= 15 ** 2
    cup = (yy - 32) ** 2 + (xx - 30) ** 2 <= 6 ** 2
    return disc, cup


def test_largest_component_and_holes():
    mask = np.zeros((20, 20), bool)
    mask[2:12, 2:12] = True
    mask[15:17, 15:17] = True  # a speck
    mask[5, 5] = False  # a hole
    kept = largest_component(mask)
    assert not kept[15:17, 15:17].any() and kept[2:12, 2:12].sum() == 99
    assert fill_holes(kept)[5, 5]
    assert not largest_component(np.zeros((4, 4))).any()
    volume = np.zeros((6, 6, 6), bool)
    volume[0:3, 0:3, 0:3] = True
    volume[5, 5, 5] = True
    assert largest_component(volume).sum() == 27


def test_clean_fundus_masks_keeps_cup_inside_the_disc():
    disc, cup = _disc_and_cup()
    noisy_disc = disc.copy()
    noisy_disc[2:4, 60:62] = True  # speck far from the disc
    noisy_cup = cup.copy()
    noisy_cup[60:62, 2:4] = True  # cup speck outside the disc
    noisy_cup[20:25, 45:50] = True  # cup pixels outside the disc, touching its edge
    cleaned = clean_fundus_masks(np.stack([noisy_disc, noisy_cup]))
    assert cleaned.dtype == np.uint8 and cleaned.shape == (2, 64, 64)
    assert np.array_equal(cleaned[0].astype(bool), disc)
    assert np.array_equal(cleaned[1].astype(bool), cup)
    assert not np.logical_and(cleaned[1], ~cleaned[0].astype(bool)).any()
    with pytest.raises(ValueError, match=r"\(2, H, W\)"):
        clean_fundus_masks(np.zeros((3, 4, 4)))


def _label_map(disc: np.ndarray, cup: np.ndarray) -> np.ndarray:
    labels = np.zeros(disc.shape, np.uint8)
    labels[disc] = 1
    labels[cup] = 2
    return labels


def test_cup_to_disc_uses_cleaned_masks_and_says_when_not_to_trust_it():
    disc, cup = _disc_and_cup()
    clean = vertical_cup_to_disc(_label_map(disc, cup), NAMES)
    assert clean.value == pytest.approx(13 / 31) and clean.trusted and clean.reason == ""
    # the same with a speck of cup at the top of the photo: raw extents would give a ratio near 1
    labels = _label_map(disc, cup)
    labels[1, 30] = 2
    specked = vertical_cup_to_disc(labels, NAMES)
    assert specked.value == pytest.approx(clean.value)
    # the cup fills the disc: shown, but not trusted
    full = vertical_cup_to_disc(_label_map(disc, disc), NAMES)
    assert full.value == 1.0 and not full.trusted and "fills the disc" in full.reason
    # no cup at all
    none = vertical_cup_to_disc(_label_map(disc, np.zeros_like(disc)), NAMES)
    assert none.value == 0.0 and not none.trusted and "no cup" in none.reason
    # half the disc scattered away from the main region
    scattered = _label_map(disc, cup)
    scattered[45:64, 50:64] = 1
    odd = vertical_cup_to_disc(scattered, NAMES)
    assert not odd.trusted and "of the disc lay outside" in odd.reason
    # an ORIGA-style "disc" name works like "rim"; maps without disc/cup names give None
    assert vertical_cup_to_disc(_label_map(disc, cup), {1: "disc", 2: "cup"}).value == pytest.approx(clean.value)
    assert vertical_cup_to_disc(_label_map(disc, cup), {1: "prostate"}) is None
    assert vertical_cup_to_disc(np.zeros((5, 5), np.uint8), NAMES) is None


def test_segment_with_cleans_fundus_masks_before_anyone_sees_them():
    from types import SimpleNamespace

    from engine.inference.predictor import Prediction
    from engine.inference.study import LoadedBundle, segment_with
    from engine.io.study import Study

    disc, cup = _disc_and_cup()
    noisy = np.stack([disc, cup]).astype(np.uint8)
    noisy[0, 2:4, 60:62] = 1  # a disc speck
    noisy[1, 60:62, 2:4] = 1  # a cup speck outside the disc
    prediction = Prediction(noisy[None], np.zeros(1, np.int64), np.array([[0.5, 0.5]], np.float32),
                            np.array([0.5], np.float32))
    metadata = SimpleNamespace(task="fundus", model_names=["global", "a", "b"], routing="gamma", gamma=0.6,
                               site_names=["a", "b"], method="fedsm")
    predictor = SimpleNamespace(metadata=metadata, device="cpu", predict=lambda *a, **k: prediction)
    study = Study(np.zeros((64, 64, 3), np.uint8), "photo", np.eye(4), (1.0, 1.0))
    result = segment_with(LoadedBundle(predictor, "0" * 64, "fake.safetensors"), study)  # type: ignore[arg-type]
    labels = result.labels.array
    assert labels[2:4, 60:62].max() == 0 and labels[60:62, 2:4].max() == 0
    assert ((labels == 2) == cup).all() and ((labels >= 1) == disc).all()
