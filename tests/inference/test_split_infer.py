"""Inference with a BlackFed (split-network) bundle: the chosen site's client net, then its server net."""

import numpy as np
import pytest
from PIL import Image
from testsupport import random_split

from engine import api
from engine.bundle.split import save_split_bundle
from engine.errors import ConfigError
from engine.federation.inprocess import run_exchange_rounds
from engine.fl.blackfed import BlackFed, BlackFedConfig
from engine.fl.methods import SiteRuntime
from engine.tasks import FUNDUS


@pytest.fixture(scope="module")
def split_bundle(tmp_path_factory):
    sites = [SiteRuntime(f"site{k + 1}", k, random_split(4, seed=k, size=32)) for k in range(2)]
    cfg = BlackFedConfig(client_epochs=1, server_epochs=1, batch_size=4, perturbations=1, image_size=32)
    method = BlackFed(FUNDUS, ["site1", "site2"], variant="v2", config=cfg)
    state, _ = run_exchange_rounds(method, sites, 1)
    path = tmp_path_factory.mktemp("bf") / "blackfed-v2.safetensors"
    save_split_bundle(path, method.report_extra(state, sites)["bundle"])
    return path, method, state, sites


def test_infer_segments_a_photo_with_the_chosen_sites_nets(split_bundle, tmp_path):
    from engine.fl.blackfed_segment import split_logits

    path, method, state, sites = split_bundle
    photo = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)
    Image.fromarray(photo).save(tmp_path / "eye.png")
    result = api.infer(path, tmp_path / "eye.png", tmp_path / "out", device="cpu", site="site2")
    assert result["routing"] == "site" and result["forced_model"] == "site2"
    assert result["inputs"][0]["models_used"] == {"site2": 1}
    written = np.asarray(Image.open(tmp_path / "out" / result["inputs"][0]["mask"]))
    assert written.shape == (32, 32)
    # the same as site2's client net followed by site2's own server entry, thresholded at 0.5 and
    # cleaned as every fundus mask is (largest component, holes filled, cup inside the disc)
    from engine.inference.postprocess import clean_fundus_masks

    x = (photo.astype(np.float32) / 255.0).transpose(2, 0, 1)[None]
    logits = split_logits(FUNDUS, 16, method.client_weights(sites[1]), state["server/site2"], x, "cpu")
    expected = clean_fundus_masks(logits[0] > 0) > 0
    from engine.inference.study import segment_study
    from engine.io.readers import open_study

    seg = segment_study(path, open_study(tmp_path / "eye.png"), device="cpu", force_model="site2")
    labels = seg.labels.array
    assert labels.shape[:2] == (32, 32)
    assert np.array_equal(labels.reshape(32, 32) > 0, expected.any(0))


def test_a_split_bundle_needs_a_known_site(split_bundle, tmp_path):
    path, *_ = split_bundle
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "eye.png")
    with pytest.raises(ConfigError, match="choose the site"):
        api.infer(path, tmp_path / "eye.png", tmp_path / "out", device="cpu")
    with pytest.raises(ConfigError, match="site1"):
        api.infer(path, tmp_path / "eye.png", tmp_path / "out", device="cpu", site="site9")
    assert api.bundle_sites(path) == {"kind": "split", "method": "blackfed-v2", "sites": ["site1", "site2"],
                                      "server": "per-site", "task": "fundus"}
