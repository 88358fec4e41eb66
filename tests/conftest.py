"""Shared fixtures: small random site data and a fast local-training configuration."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Keep Flower-free, display-free, deterministic defaults for every test process.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")



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
