"""16-bit weights on the wire, fp32 masters at both ends.

A federated round moves whole networks each way. Sent as float32 they dominate a FedSM round
(U-Net, personalized U-Net, selector and its two Adam moments). This module halves them
without letting the rounding build up over rounds:

- **down** (coordinator -> site): the float32 tensors of the parts a method allows
  (:meth:`engine.fl.methods.FederatedMethod.wire_parts`) travel as bfloat16 *values*. The site
  trains in float32 from those values.
- **up** (site -> coordinator): for every float32 tensor the site received in such a part, the
  reply carries the bfloat16 *difference* between what the site trained and what it received.
  The coordinator adds it to its own float32 master (what it meant to send), so an update is
  rounded relative to its own size, not to the weights', and the master never passes through 16
  bits. A tensor the site did not receive (statistics, histograms, a model sent once at the end)
  travels as it is.

bfloat16 rather than float16: it keeps float32's exponent range, so Adam's second moments (down
to ~1e-20) and the smallest differences need no scaling and cannot underflow to zero; its 8-bit
mantissa rounds a value by at most 2^-9 of itself.

Both transports call the same four functions (:func:`encode_down`, :func:`decode_down`,
:func:`encode_up`, :func:`decode_up`), so the in-process simulation computes exactly what a
network federation does.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from engine.errors import WeightsError
from engine.fl.training_options import DEFAULT_WIRE_PRECISION, WIRE_PRECISIONS, check_wire_precision

__all__ = ["DEFAULT_WIRE_PRECISION", "WIRE_PRECISIONS", "DownCache", "check_wire_precision", "decode_down",
           "decode_up", "encode_down", "encode_up"]

WIRE_DTYPE = torch.bfloat16

Weights = dict[str, torch.Tensor]
WeightSet = dict[str, Weights]


def _compressible(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32


class DownCache:
    """Encoded parts by the identity of their source dict: a part every site receives (the global model,
    the selector) is converted once per round, and stays the same object (so a transport packs it once)."""

    def __init__(self) -> None:
        self._encoded: dict[int, tuple[Mapping[str, torch.Tensor], Weights]] = {}

    def get(self, tensors: Mapping[str, torch.Tensor]) -> Weights:
        hit = self._encoded.get(id(tensors))
        if hit is None or hit[0] is not tensors:
            hit = (tensors, {k: v.to(WIRE_DTYPE) if _compressible(v) else v for k, v in tensors.items()})
            self._encoded[id(tensors)] = hit  # keeps ``tensors`` alive, so its id stays unique
        return hit[1]


def encode_down(weights: Mapping[str, Weights], parts: Collection[str], cache: DownCache | None = None) -> WeightSet:
    """What the coordinator sends: the float32 tensors of ``parts`` as bfloat16 values, the rest as they are.

    With a ``cache`` (one per round), a part shared by several sites is converted once.
    """
    cache = cache if cache is not None else DownCache()
    return {part: cache.get(tensors) if part in parts else tensors for part, tensors in weights.items()}


def decode_down(weights: Mapping[str, Weights], parts: Collection[str]) -> WeightSet:
    """What the site trains from: the bfloat16 tensors of ``parts`` widened to float32 (exactly)."""
    out: WeightSet = {}
    for part, tensors in weights.items():
        if part in parts:
            out[part] = {k: v.to(torch.float32) if v.dtype == WIRE_DTYPE else v for k, v in tensors.items()}
        else:
            out[part] = tensors
    return out


def encode_up(update: Mapping[str, Weights], received: Mapping[str, Weights], parts: Collection[str]) -> WeightSet:
    """What the site sends back: for each float32 tensor it received in ``parts``, the bfloat16 difference
    between its value now and the value received; every other tensor as it is."""
    out: WeightSet = {}
    for part, tensors in update.items():
        base = received.get(part) if part in parts else None
        if base is None:
            out[part] = dict(tensors)
            continue
        out[part] = {}
        for key, value in tensors.items():
            ref = base.get(key)
            if ref is not None and _compressible(ref) and value.dtype == ref.dtype and value.shape == ref.shape:
                out[part][key] = (value.detach() - ref).to(WIRE_DTYPE)
            else:
                out[part][key] = value
    return out


def decode_up(reply: Mapping[str, Weights], sent: Mapping[str, Weights], parts: Collection[str],
              what: str = "reply") -> WeightSet:
    """The site's update as the coordinator uses it: each difference added to the float32 master the
    coordinator sent (``sent``: before :func:`encode_down`); every other tensor as it arrived.

    A tensor that should arrive as a difference but does not (another dtype or shape) raises
    :class:`WeightsError`; the method's own check then judges the rebuilt update like any other.
    """
    out: WeightSet = {}
    for part, tensors in reply.items():
        base = sent.get(part) if part in parts else None
        if base is None:
            out[part] = dict(tensors)
            continue
        out[part] = {}
        for key, value in tensors.items():
            master = base.get(key)
            if master is None or not _compressible(master):
                out[part][key] = value
                continue
            if value.dtype != WIRE_DTYPE:
                raise WeightsError(f"{what}: {part}/{key} has dtype {value.dtype}; it must travel as the bfloat16 "
                                   "difference from what was sent")
            if value.shape != master.shape:
                raise WeightsError(f"{what}: {part}/{key} has shape {tuple(value.shape)}, expected "
                                   f"{tuple(master.shape)}")
            out[part][key] = master + value.to(torch.float32)
    return out
