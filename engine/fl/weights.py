"""Operations on weight dicts (``parameter name -> tensor``), the currency of every strategy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.errors import WeightsError

Weights = dict[str, torch.Tensor]


def clone_weights(weights: Mapping[str, torch.Tensor]) -> Weights:
    """Detached CPU copy of ``weights`` (safe to keep while the model trains on)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}


def model_weights(model: torch.nn.Module) -> Weights:
    """Detached CPU copy of a model's full state (parameters and buffers)."""
    return clone_weights(model.state_dict())


def weighted_sum(terms: Sequence[tuple[Mapping[str, torch.Tensor], float]]) -> Weights:
    """``sum_i c_i * w_i`` key by key, computed in float64 and cast back to each key's dtype.

    Integer buffers (BatchNorm's ``num_batches_tracked``) are rounded back to integers.
    """
    if not terms:
        raise WeightsError("nothing to combine: no weight sets were given")
    first = terms[0][0]
    out: Weights = {}
    for key, ref in first.items():
        acc = torch.zeros(ref.shape, dtype=torch.float64)
        for weights, coef in terms:
            # One pass per term: the float64 accumulator takes coef * w directly.
            acc.add_(weights[key].detach().to("cpu", torch.float64), alpha=float(coef))
        if ref.dtype.is_floating_point:
            out[key] = acc.to(ref.dtype)
        else:
            out[key] = torch.round(acc).to(ref.dtype)
    return out


def subtract(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> Weights:
    """``a - b`` for floating-point keys (integer buffers are skipped)."""
    return {k: a[k] - b[k] for k in a if a[k].dtype.is_floating_point}


def payload_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    """Bytes the tensors of ``weights`` occupy on the wire (raw, uncompressed)."""
    return sum(t.numel() * t.element_size() for t in weights.values())


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a floating-point ``tensor`` is finite (no NaN, no Inf).

    One pass and no temporary the size of the tensor: a NaN or an infinity makes the sum
    NaN or infinite, so a finite sum proves every element finite. Only a sum that
    overflowed from finite values (elements near the dtype's largest) is not proof of the
    opposite; then every element is checked.
    """
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def check_compatible(reference: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor],
                     what: str = "update") -> None:
    """Raise :class:`WeightsError` unless ``update`` matches ``reference`` and is finite.

    Checks key sets, shapes and dtypes, then NaN/Inf, and says exactly which key is wrong.
    """
    missing = sorted(set(reference) - set(update))
    extra = sorted(set(update) - set(reference))
    if missing or extra:
        raise WeightsError(
            f"{what} does not fit the model: missing keys {missing[:5]}, unexpected keys {extra[:5]}"
        )
    for key, ref in reference.items():
        got = update[key]
        if tuple(got.shape) != tuple(ref.shape):
            raise WeightsError(f"{what}: {key} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
        if got.dtype != ref.dtype:
            raise WeightsError(f"{what}: {key} has dtype {got.dtype}, expected {ref.dtype}")
        if got.dtype.is_floating_point and not all_finite(got):
            raise WeightsError(f"{what}: {key} contains NaN or Inf; the site's training diverged")
