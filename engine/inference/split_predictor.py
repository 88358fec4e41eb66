"""Inference with a split-network bundle (BlackFed): one site's client net, then its server net.

A split bundle has no selector: the user says which site's client net to use (``fedsm infer
--site NAME``, the desktop app's site choice). :class:`SplitPredictor` has the interface of
:class:`~engine.inference.predictor.SuperModelPredictor` that :mod:`engine.inference.study` uses,
with ``routing = "site"``: the model names are the sites, and ``force_model`` (the chosen site)
is required.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from engine.bundle.split import SplitBundle
from engine.data.preprocess import resize_images
from engine.device import resolve_device
from engine.errors import BundleError, CancelledError, ConfigError, DataError
from engine.fl.blackfed_nets import build_client_net, build_server_net
from engine.inference.predictor import Prediction, SuperModelPredictor

if TYPE_CHECKING:
    from engine.inference.predictor import CancelCheck, ProgressCallback

#: ``routing`` of split bundles: the user chooses the site; nothing is routed.
SITE_ROUTING = "site"


@dataclass(frozen=True)
class SplitView:
    """The metadata fields inference reads, for a split bundle."""

    task: str
    method: str
    label_names: list[str]
    in_channels: int
    image_size: int
    normalisation: str
    site_names: list[str]
    server: str
    routing: str = SITE_ROUTING
    gamma: Any = None

    @property
    def model_names(self) -> list[str]:
        """Selectable models: one per site (its client net with its server net)."""
        return list(self.site_names)


class SplitPredictor:
    """Segments with ``server_k(client_k(x))`` for the chosen site ``k``."""

    def __init__(self, bundle: SplitBundle, device: str = "auto") -> None:
        meta = bundle.metadata
        self.metadata = SplitView(meta.task, meta.method, list(meta.label_names), meta.in_channels, meta.image_size,
                                  meta.normalisation, list(meta.site_names), meta.server)
        self.device, _ = resolve_device(device)
        self.use_amp = False
        self.nets: list[nn.Module] = []
        for site in meta.site_names:
            client = build_client_net(meta.in_channels, meta.channels)
            server = build_server_net(meta.channels, len(meta.label_names))
            try:
                client.load_state_dict(bundle.clients[site])
                server.load_state_dict(bundle.server_for(site))
            except RuntimeError as exc:
                raise BundleError(f"{bundle.source or 'the bundle'}: the weights for site {site} do not fit the "
                                  f"split network ({str(exc).splitlines()[0]}); export the bundle again") from None
            self.nets.append(nn.Sequential(client, server).to(self.device).eval())

    @property
    def num_models(self) -> int:
        return len(self.nets)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def predict(self, images: np.ndarray, gamma: float | None = None, batch_size: int = 16,
                force_model: int | None = None, progress: ProgressCallback | None = None,
                cancel: CancelCheck | None = None, cases: np.ndarray | None = None) -> Prediction:
        """Masks of ``images`` (normalised ``float32 (N, C, H, W)``) with site ``force_model``'s nets.

        ``cases`` is accepted as :meth:`SuperModelPredictor.predict` takes it and not used: a split
        bundle has no style gate.
        """
        names = self.metadata.site_names
        if force_model is None:
            raise ConfigError(f"this {self.metadata.method} bundle segments with one site's client net; choose the "
                              f"site (fedsm infer --site NAME): {', '.join(names)}")
        if isinstance(force_model, bool) or not 0 <= int(force_model) < len(names):
            raise ConfigError(f"site index must be 0..{len(names) - 1} ({', '.join(names)}), got {force_model!r}")
        arr = np.asarray(images)
        if arr.ndim != 4 or arr.shape[1] != self.metadata.in_channels or not np.issubdtype(arr.dtype, np.floating):
            raise DataError(f"images must be normalised float (N, {self.metadata.in_channels}, H, W), "
                            f"got {arr.dtype} {arr.shape}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        n, _, height, width = arr.shape
        k = int(force_model)
        masks = np.zeros((n, len(self.metadata.label_names), height, width), dtype=np.uint8)
        with torch.inference_mode():
            for start in range(0, n, batch_size):
                if cancel is not None and cancel():
                    raise CancelledError(f"inference cancelled after {start} of {n} images")
                x = torch.from_numpy(np.ascontiguousarray(
                    resize_images(arr[start:start + batch_size], self.metadata.image_size), dtype=np.float32))
                masks[start:start + batch_size] = SuperModelPredictor._segment(self.nets[k], x.to(self.device),
                                                                               height, width)
                if progress is not None:
                    progress(2 * min(start + batch_size, n), 2 * n)
        probs = np.zeros((n, len(names)), dtype=np.float32)
        probs[:, k] = 1.0
        return Prediction(masks=masks, routed=np.full(n, k, dtype=np.int64), probabilities=probs,
                          confidence=np.ones(n, dtype=np.float32))


__all__ = ["SITE_ROUTING", "SplitPredictor", "SplitView"]
