"""The selector's training schemes by name and their default learning rates, without torch.

Kept apart from :mod:`engine.fl.selector_training` so that what only needs the names (the
SuperNode checking a run's signed settings against the site's ``[bounds]``, a config being
validated) does not import torch: a SuperNode process stays a small Flower process.
"""

from __future__ import annotations

from engine.errors import ConfigError

#: Ways to finish the selector after training (``--selector-calibration``).
SELECTOR_CALIBRATIONS = ("none", "temperature", "lda")
#: Selector learning rate per scheme when none is given, for the paper's VGG-11 (width 64): the
#: paper's 1e-3 for the reference scheme, the old per-batch scheme's 1e-5 for ``lda``.
DEFAULT_SELECTOR_LR = {"none": 1e-3, "temperature": 1e-3, "lda": 1e-5}
#: The paper's selector width (:data:`engine.models.selector.PAPER_WIDTH`, repeated here without torch).
PAPER_SELECTOR_WIDTH = 64
#: The reference scheme's learning rate for a selector narrower than the paper's. Measured at width 16
#: (docs/results.md, "16-bit on the wire and the selector's width"): at 1e-3 it barely learns in 60
#: one-step rounds (only the largest site's images routed to their own model), at 3e-3 it routes like
#: width 64 at 1e-3, at 1e-2 it overshoots. Widths 8 and 32 use it unmeasured.
NARROW_SELECTOR_LR = 3e-3


def check_calibration(name: str) -> str:
    """Return ``name`` if it is a known selector calibration, else raise :class:`ConfigError`."""
    if name not in SELECTOR_CALIBRATIONS:
        raise ConfigError(f"unknown selector calibration {name!r}; choose one of {', '.join(SELECTOR_CALIBRATIONS)}")
    return name


def default_selector_lr(calibration: str, lr: float | None, width: int) -> float:
    """``lr`` when given, else the scheme's default for a selector of ``width``.

    :data:`DEFAULT_SELECTOR_LR` at the paper's width and for the per-batch ``lda`` scheme;
    :data:`NARROW_SELECTOR_LR` for the reference scheme's narrower selectors.
    """
    if lr is not None:
        return float(lr)
    scheme = check_calibration(calibration)
    if scheme != "lda" and width < PAPER_SELECTOR_WIDTH:
        return NARROW_SELECTOR_LR
    return DEFAULT_SELECTOR_LR[scheme]
