"""Gaussian privacy noise from the operating system's cryptographically secure generator.

A site's differential-privacy noise must be unpredictable to the coordinator that receives the
noised values. A seeded pseudo-random generator (torch's Mersenne Twister) is only as secret as
its seed and is not designed to resist recovering its state from what it produced; this module
draws every bit from ``os.urandom`` (the kernel's CSPRNG), so nothing a site keeps or sends can be
used to predict a draw.

Two further details follow the literature on attacks against floating-point Gaussian samplers
(Holohan & Braghin 2021, arXiv:2107.10138; Opacus's ``secure_mode`` applies the same remedy, but
needs the unmaintained ``torchcsprng`` for its generator):

- each standard normal comes from the Box-Muller transform of two uniforms with 53 random bits each
  (the full precision of a float64), computed in float64;
- each released value is the sum of four such normals divided by two (again ``N(0, 1)``), which
  makes recovering the uniforms behind a released float, the known attack on a single Box-Muller
  draw, as hard as a search over ``2^159`` candidates instead of ``2^53``.

Draws cannot be repeated: a simulation that must repeat (``fedsm simulate``) seeds a torch
generator instead (:data:`engine.fl.methods.contract.NOISE_SEED_KEY`).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

#: Normals summed per released value (Opacus's ``2n`` with ``n = 2``); their sum / 2 is ``N(0, 1)``.
NORMALS_PER_VALUE = 4
_MANTISSA_BITS = 53


def _uniform_bits(count: int) -> np.ndarray:
    """``count`` independent integers uniform on ``[0, 2^53)`` from the OS generator."""
    raw = np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
    return raw >> np.uint64(64 - _MANTISSA_BITS)


def standard_normals(count: int) -> np.ndarray:
    """``count`` independent float64 ``N(0, 1)`` draws from the OS generator (Box-Muller, 53-bit uniforms)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    pairs = (count + 1) // 2
    bits = _uniform_bits(2 * pairs).astype(np.float64)
    scale = 2.0 ** -_MANTISSA_BITS
    u1 = (bits[:pairs] + 1.0) * scale  # (0, 1]: the logarithm stays finite
    u2 = bits[pairs:] * scale  # [0, 1)
    radius = np.sqrt(-2.0 * np.log(u1))
    angle = 2.0 * math.pi * u2
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]


def secure_gaussian(shape: tuple[int, ...] | torch.Size, std: float = 1.0) -> torch.Tensor:
    """Float32 tensor of ``shape`` with independent ``N(0, std^2)`` entries from the OS generator.

    Each entry is the sum of :data:`NORMALS_PER_VALUE` standard normals, rescaled to unit
    variance, then multiplied by ``std`` (in float64 before the one rounding to float32).
    """
    if not math.isfinite(std) or std < 0:
        raise ValueError(f"std must be a finite number >= 0, got {std}")
    count = math.prod(shape)
    draws = standard_normals(NORMALS_PER_VALUE * count).reshape(NORMALS_PER_VALUE, count)
    values = draws.sum(axis=0) / math.sqrt(NORMALS_PER_VALUE) * std
    return torch.from_numpy(values.astype(np.float32)).reshape(tuple(shape))
