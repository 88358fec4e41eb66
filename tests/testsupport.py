"""Helpers shared by test modules across folders.

They live here rather than in ``conftest.py``: with ``tests/gui/conftest.py`` also loaded, a bare
``from conftest import ...`` resolves to whichever conftest was imported last.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

#: Real public images with expert masks, beside the project (``../shared/data``); absent in a user's clone.
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
#: A test-only weight-method plugin: a distribution whose ``fedsm.methods`` entry point names
#: ``test-damped-avg`` (a FedAvg whose coordinator moves halfway); no product file names it.
PLUGINS = Path(__file__).with_name("plugins")
PLUGIN_METHOD = "test-damped-avg"


@contextmanager
def plugin_installed() -> Iterator[str]:
    """The plugin of :data:`PLUGINS` installed in this process (on its path, found as an installed plugin
    is, registered), then removed; yields its method's name. Child processes get it on ``PYTHONPATH``."""
    from engine import catalogue

    sys.path.insert(0, str(PLUGINS))
    try:
        assert catalogue.load_plugins() == (PLUGIN_METHOD,)
        yield PLUGIN_METHOD
    finally:
        catalogue.unregister(PLUGIN_METHOD)
        sys.path.remove(str(PLUGINS))


def random_split(n: int, channels: int = 3, labels: int = 2, size: int = 32, seed: int = 0, shift: float = 0.0):
    """Random images and masks as a ``SplitArrays``, brightness shifted by ``shift`` (a site's style)."""
    from engine.data.site_data import SplitArrays

    rng = np.random.default_rng(seed)
    images = np.clip(rng.random((n, channels, size, size), dtype=np.float32) * 0.5 + shift, 0, 1).astype(np.float32)
    masks = (rng.random((n, labels, size, size)) > 0.7).astype(np.float32)
    return SplitArrays(images, masks, np.arange(n, dtype=np.int64))


def write_photo_site(root: Path, stems: list[str], mask_name: str = "{stem}.png", size: int = 24) -> Path:
    """``root/images/<stem>.png`` photos and ``root/masks/...`` ORIGA label maps (disc with a cup)."""
    from PIL import Image

    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir(parents=True)
    yy, xx = np.mgrid[:size, :size]
    for i, stem in enumerate(stems):
        r = (yy - size / 2) ** 2 + (xx - size / 2 - i % 3) ** 2
        label = np.where(r < (size / 3) ** 2, 1, 0).astype(np.uint8)
        label[r < (size / 6) ** 2] = 2
        photo = np.stack([80 + 100 * (label > 0), 40 + 60 * (label == 2), np.full_like(label, 30)], -1)
        Image.fromarray(photo.astype(np.uint8)).save(root / "images" / f"{stem}.png")
        Image.fromarray(label).save(root / "masks" / mask_name.format(stem=stem))
    return root


def fedavg_network_bundle(work: Path) -> Path:
    """What the coordinator writes for a FedAvg run (engine.federation.flower.server.write_results)."""
    from types import SimpleNamespace

    import torch

    from engine.federation.flower.server import write_results
    from engine.federation.spec import MethodSpec
    from engine.models import build_segmentation_net

    torch.manual_seed(0)
    spec = MethodSpec(method="fedavg", task="fundus", site_names=("north", "south"), rounds=2, image_size=32)
    cfg = SimpleNamespace(spec=spec, work_dir=work)
    state = {"global": build_segmentation_net(3, 2).state_dict()}
    work.mkdir(parents=True, exist_ok=True)
    summary = write_results(cfg, SimpleNamespace(total_rounds=2), state, [], "session1", "sha256:" + "0" * 64)
    assert summary["files"] == {"global": "global.safetensors"}
    return work / "global.safetensors"
