"""Optic-disc-centred crops: full photos found by their dark corners, the disc by the smoothed red maximum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from testsupport import SHARED_DATA

from engine import api
from engine.bundle import save_bundle
from engine.bundle.single import single_model_bundle
from engine.data.disc_crop import crop_box, disc_box, is_full_photo, locate_disc
from engine.data.site_data import load_site
from engine.errors import ConfigError
from engine.io.readers import open_study
from engine.models import build_segmentation_net
from engine.tasks import get_task


def full_photo(h: int = 300, w: int = 360, disc: tuple[int, int] = (120, 230), radius: int = 18) -> np.ndarray:
    """A synthetic full fundus photo: orange round field of view on black, a bright disc, a bright rim."""
    yy, xx = np.mgrid[:h, :w]
    rgb = np.zeros((h, w, 3), np.uint8)
    fov = (yy - h / 2) ** 2 + (xx - w / 2) ** 2 < (0.47 * min(h, w)) ** 2
    rgb[fov] = (150, 70, 30)
    rim = fov & ((yy - h / 2) ** 2 + (xx - w / 2) ** 2 > (0.46 * min(h, w)) ** 2)
    rgb[rim] = (250, 200, 150)  # the bright edge of the field of view must not win
    d = (yy - disc[0]) ** 2 + (xx - disc[1]) ** 2 < radius ** 2
    rgb[d] = (240, 200, 120)
    rng = np.random.default_rng(0)
    return np.clip(rgb.astype(np.int16) + rng.integers(-8, 8, rgb.shape), 0, 255).astype(np.uint8) * fov[..., None]


def test_disc_is_found_and_cropped_inside_the_photo():
    rgb = full_photo()
    row, col = locate_disc(rgb)
    assert abs(row - 120) <= 4 and abs(col - 230) <= 4
    assert is_full_photo(rgb) and not is_full_photo(rgb[100:200, 180:280])
    box = disc_box(rgb, "auto")
    assert box.size == 120 and box.top <= 120 - 18 and box.top + box.size >= 120 + 18
    assert disc_box(rgb, "none") is None and disc_box(rgb[100:200, 180:280], "auto") is None
    edge = crop_box((300, 360), (5, 355))
    assert (edge.top, edge.left, edge.size) == (0, 240, 120)
    with pytest.raises(ConfigError, match="unknown fundus crop"):
        disc_box(rgb, "tight")


def test_real_full_photos_and_crops(tmp_path):
    drishti = SHARED_DATA / "fundus" / "DrishtiGS1"
    if not drishti.is_dir():
        pytest.skip("real fundus photos absent (../shared/data)")
    for stem in ("drishtiGS_002", "drishtiGS_004"):
        rgb = np.asarray(Image.open(drishti / "images" / f"{stem}.png").convert("RGB"))
        disc = np.asarray(Image.open(drishti / "masks" / f"{stem}_ODsegSoftmap.png")) >= 128
        ys, xs = np.nonzero(disc)
        row, col = locate_disc(rgb)
        assert abs(row - ys.mean()) < 80 and abs(col - xs.mean()) < 80  # disc radius is about 150 px
        box = disc_box(rgb, "auto")
        assert disc[box.slices()].sum() == disc.sum()  # the whole expert disc lies inside the crop
    origa = np.asarray(Image.open(SHARED_DATA / "fundus" / "ORIGA" / "images" / "621.png").convert("RGB"))
    assert not is_full_photo(origa) and disc_box(origa, "auto") is None


def test_training_crops_photo_and_mask_alike_and_inference_pastes_back(tmp_path):
    # Prepare: a full photo with its ORIGA mask (disc with cup) in a datalist
    rgb = full_photo()
    yy, xx = np.mgrid[:300, :360]
    label = np.zeros((300, 360), np.uint8)
    label[(yy - 120) ** 2 + (xx - 230) ** 2 < 18 ** 2] = 1
    label[(yy - 120) ** 2 + (xx - 230) ** 2 < 8 ** 2] = 2
    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    Image.fromarray(rgb).save(tmp_path / "images" / "a.png")
    Image.fromarray(label).save(tmp_path / "masks" / "a.png")
    api.build_datalist(tmp_path / "images", tmp_path / "masks", tmp_path / "datalist.json", split=(1, 0, 0))
    task = get_task("fundus")
    # Execute
    whole = load_site(tmp_path / "datalist.json", task, 32)
    cropped = load_site(tmp_path / "datalist.json", task, 32, fundus_crop="auto")
    # Assert: cropped, the disc is a large centred structure; whole, a speck
    # a 120 px crop of a 300x360 photo: the disc covers 7.5 times more of the 32 px input
    assert cropped.train.masks[0, 0].sum() > 5 * max(whole.train.masks[0, 0].sum(), 1)
    ys, xs = np.nonzero(cropped.train.masks[0, 0])
    assert abs(ys.mean() - 15.5) < 3 and abs(xs.mean() - 15.5) < 3

    # inference with a bundle trained that way: full-size map, the crop segmented, background outside it
    torch.manual_seed(0)
    weights = build_segmentation_net(3, 2).state_dict()
    last_bias = [k for k in weights if k.endswith("bias")][-1]
    weights[last_bias] = torch.full_like(weights[last_bias], 50.0)  # the network says "disc and cup" everywhere
    save_bundle(tmp_path / "m.safetensors",
                single_model_bundle("fundus", "fedavg", weights, ["a"], 32, extra={"fundus_crop": "auto"}))
    save_bundle(tmp_path / "p.safetensors", single_model_bundle("fundus", "fedavg", weights, ["a"], 32))
    study = open_study(tmp_path / "images" / "a.png")
    seg = api.segment_study(tmp_path / "m.safetensors", study, device="cpu").labels.array
    whole_seg = api.segment_study(tmp_path / "p.safetensors", study, device="cpu").labels.array
    box = disc_box(rgb, "auto")
    inside = np.zeros((300, 360), bool)
    inside[box.slices()] = True
    assert seg.shape == whole_seg.shape == (300, 360)
    assert (seg[inside] == 2).all() and not seg[~inside].any()
    assert (whole_seg == 2).all()
