"""The local-training recipe's named choices, without torch.

Kept apart from :mod:`engine.fl.local_training` (which uses them) so that what only needs the
names, such as a site checking a run's signed settings against its bounds
(:mod:`engine.fl.method_spec`), imports no torch.
"""

from __future__ import annotations

from engine.errors import ConfigError

#: Learning-rate schedules over rounds (:func:`engine.fl.local_training.scheduled_lr`).
LR_SCHEDULES = ("constant", "cosine", "step")
#: Segmentation losses (:func:`engine.fl.local_training.segmentation_loss`).
SEGMENTATION_LOSSES = ("dice", "dicece")
#: Selector BatchNorm during local training (``LocalTrainingConfig.selector_bn``).
SELECTOR_BN_MODES = ("batch", "running", "fresh")

#: ``wire_precision`` values (engine.fl.wire_precision): ``"bfloat16"`` (the default) or ``"float32"``.
WIRE_PRECISIONS = ("bfloat16", "float32")
DEFAULT_WIRE_PRECISION = "bfloat16"


def check_wire_precision(value: object) -> str:
    """``value`` if it is one of :data:`WIRE_PRECISIONS`, else :class:`ConfigError`."""
    if value not in WIRE_PRECISIONS:
        raise ConfigError(f"wire_precision must be one of {', '.join(WIRE_PRECISIONS)}, got {value!r} "
                          "(bfloat16 halves the bytes each way; float32 sends every tensor as it is)")
    return str(value)


__all__ = ["DEFAULT_WIRE_PRECISION", "LR_SCHEDULES", "SEGMENTATION_LOSSES", "SELECTOR_BN_MODES", "WIRE_PRECISIONS",
           "check_wire_precision"]
