"""Shared fixtures: small random site data and a fast local-training configuration."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

# Keep Flower-free, display-free, deterministic defaults for every test process.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def single_torch_thread() -> Iterator[None]:
    """Run every test with one torch thread.

    The test networks are tiny and gain nothing from threads, while OpenMP threads spinning
    against other processes on a small shared machine make a forward pass up to 100x slower.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_training():
    from engine.fl.local_training import LocalTrainingConfig

    return LocalTrainingConfig(epochs=1, batch_size=4, lr=1e-3, selector_lr=1e-4, selector_size=32, device="cpu")


def random_split(n: int, channels: int = 3, labels: int = 2, size: int = 32, seed: int = 0, shift: float = 0.0):
    from engine.data.site_data import SplitArrays

    rng = np.random.default_rng(seed)
    images = np.clip(rng.random((n, channels, size, size), dtype=np.float32) * 0.5 + shift, 0, 1).astype(np.float32)
    masks = (rng.random((n, labels, size, size)) > 0.7).astype(np.float32)
    return SplitArrays(images, masks, np.arange(n, dtype=np.int64))
