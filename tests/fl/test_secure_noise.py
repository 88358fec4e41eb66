"""The secure Gaussian noise a network site adds for differential privacy (engine.fl.secure_noise)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.fl import secure_noise


def test_standard_normals_have_the_moments_and_tails_of_n01():
    # Execute: 400,001 draws (an odd count: Box-Muller makes pairs)
    z = secure_noise.standard_normals(400_001)
    # Assert: float64, finite, mean 0, variance 1, Gaussian kurtosis and the two-sided 3-sigma tail (0.27 %)
    assert z.dtype == np.float64 and z.shape == (400_001,) and np.isfinite(z).all()
    se = 1 / math.sqrt(z.size)
    assert abs(z.mean()) < 5 * se
    assert z.var() == pytest.approx(1.0, abs=5 * math.sqrt(2) * se)
    assert (z**4).mean() == pytest.approx(3.0, abs=0.05)
    assert (np.abs(z) > 3).mean() == pytest.approx(0.0027, abs=0.0005)


def test_secure_gaussian_scales_shapes_and_rounds_once_to_float32():
    noise = secure_noise.secure_gaussian((50, 40, 100), std=2.5)
    assert noise.dtype == torch.float32 and noise.shape == (50, 40, 100)
    assert float(noise.std()) == pytest.approx(2.5, rel=0.01)
    assert torch.equal(secure_noise.secure_gaussian((3, 4), std=0.0), torch.zeros(3, 4))
    assert secure_noise.secure_gaussian((0, 5)).shape == (0, 5)
    with pytest.raises(ValueError, match="std"):
        secure_noise.secure_gaussian((2,), std=-1.0)
    with pytest.raises(ValueError, match="std"):
        secure_noise.secure_gaussian((2,), std=math.nan)


def test_draws_ignore_every_seed_a_process_can_set():
    # Prepare: the global generators a coordinator-chosen seed could reach, seeded identically twice
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        np.random.seed(0)
        draws.append(secure_noise.secure_gaussian((1000,)))
    # Assert: the two draws share nothing (correlation of independent N(0,1) samples: ~ N(0, 1/1000))
    assert not torch.equal(draws[0], draws[1])
    correlation = float(torch.corrcoef(torch.stack(draws))[0, 1])
    assert abs(correlation) < 5 / math.sqrt(1000)


def test_uniforms_use_53_bits_and_never_reach_zero_where_the_logarithm_is_taken(monkeypatch):
    # Prepare: the OS generator replaced by its extremes: all-zero bytes, then all-one bytes
    monkeypatch.setattr(secure_noise.os, "urandom", lambda n: b"\x00" * n)
    low = secure_noise.standard_normals(4)
    monkeypatch.setattr(secure_noise.os, "urandom", lambda n: b"\xff" * n)
    high = secure_noise.standard_normals(4)
    # Assert: u1 = 2^-53 (not 0) gives the largest radius sqrt(2 * 53 ln 2) at angle 0; u1 -> 1 gives ~0
    assert np.isfinite(low).all() and low[0] == pytest.approx(math.sqrt(2 * 53 * math.log(2)))
    assert np.abs(high).max() < 1e-7
    assert secure_noise._uniform_bits(3).max() < 2**53
