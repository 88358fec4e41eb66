"""The selector's training schemes by name and their default learning rates, without torch.

Kept apart from :mod:`engine.fl.selector_training` so that what only needs the names (the
SuperNode checking a run's signed settings against the site's ``[bounds]``, a config being
validated) does not import torch: a SuperNode process stays a small Flower process.
"""

from __future__ import annotations

from engine.errors import ConfigError

#: Ways to finish the selector after training (``--selector-calibration``).
SELECTOR_CALIBRATIONS = ("none", "temperature", "lda")
#: Selector learning rate per scheme when none is given: the paper's 1e-3 for the reference
#: scheme, the old per-batch scheme's 1e-5 for ``lda``.
DEFAULT_SELECTOR_LR = {"none": 1e-3, "temperature": 1e-3, "lda": 1e-5}


def check_calibration(name: str) -> str:
    """Return ``name`` if it is a known selector calibration, else raise :class:`ConfigError`."""
    if name not in SELECTOR_CALIBRATIONS:
        raise ConfigError(f"unknown selector calibration {name!r}; choose one of {', '.join(SELECTOR_CALIBRATIONS)}")
    return name


def default_selector_lr(calibration: str, lr: float | None = None) -> float:
    """``lr`` when given, else the scheme's default (:data:`DEFAULT_SELECTOR_LR`)."""
    return float(lr) if lr is not None else DEFAULT_SELECTOR_LR[check_calibration(calibration)]
