"""Single-model bundles: the result of FedAvg, FedProx, Scaffold (or centralized training) as a FedSM bundle.

Such a bundle holds only the global U-Net (``global.*`` tensors) with metadata ``routing="none"``;
``site_names`` are the sites that trained it (for the per-site validation Dice and provenance), and
there is no selector and no personalized model. ``fedsm infer``, ``fedsm evaluate`` and the desktop
app open it like a super model: every image goes to the global model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.bundle.supermodel import BundleMetadata, SuperModelBundle, single_model_methods
from engine.errors import ConfigError
from engine.tasks import get_task

if TYPE_CHECKING:
    import torch


def single_model_bundle(task: str, method: str, weights: Mapping[str, torch.Tensor], site_names: Sequence[str],
                        image_size: int, rounds: int = 0, val_dice: Mapping[str, float | None] | None = None,
                        extra: Mapping[str, Any] | None = None) -> SuperModelBundle:
    """A bundle holding one global model.

    Parameters
    ----------
    task
        ``"fundus"`` or ``"prostate"``.
    method
        One of :func:`engine.bundle.supermodel.single_model_methods`.
    weights
        The global U-Net's state dict.
    site_names
        The sites whose data trained it.
    image_size
        Side of the U-Net's square input.
    rounds, val_dice, extra
        As in :class:`~engine.bundle.BundleMetadata`.

    Raises
    ------
    ConfigError
        For a method that is not a single-model method, or invalid metadata.
    """
    if method not in single_model_methods():
        raise ConfigError(f"{method!r} does not produce a single global model; use one of "
                          f"{', '.join(single_model_methods())}")
    spec = get_task(task)
    meta = BundleMetadata(
        task=spec.name, label_names=list(spec.label_names), in_channels=spec.in_channels, image_size=image_size,
        selector_size=32, site_names=list(site_names), normalisation=spec.normalisation, method=method,
        routing="none", lam=1.0, gamma=0.0, rounds=int(rounds), val_dice=dict(val_dice or {}),
        extra=dict(extra or {}))
    return SuperModelBundle(meta, dict(weights), {}, {})
