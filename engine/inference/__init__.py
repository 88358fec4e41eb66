"""Super-model inference: routing rules, device choice, the routed predictor, file-level runs.

Routed model index convention everywhere: 0 = global model, k (1..K) = site k's personalized
model. The routing rules are pure numpy and imported eagerly; the torch-based parts
(:mod:`~engine.device`, :mod:`~engine.inference.predictor`,
:mod:`~engine.inference.run`) load on first use, so importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.inference.routing import check_gamma, confidence, route_fedsm, route_fedsm_extra

if TYPE_CHECKING:
    from engine.device import resolve_device
    from engine.inference.predictor import Prediction, SuperModelPredictor
    from engine.inference.run import infer_path

_LAZY = {
    "resolve_device": "engine.device",
    "Prediction": "engine.inference.predictor",
    "SuperModelPredictor": "engine.inference.predictor",
    "infer_path": "engine.inference.run",
}

__all__ = [
    "Prediction",
    "SuperModelPredictor",
    "check_gamma",
    "confidence",
    "infer_path",
    "resolve_device",
    "route_fedsm",
    "route_fedsm_extra",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.inference' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
