"""The local-training recipe's named choices, without torch.

Kept apart from :mod:`engine.fl.local_training` (which uses them) so that what only needs the
names, such as a site checking a run's signed settings against its bounds
(:mod:`engine.fl.method_spec`), imports no torch.
"""

from __future__ import annotations

#: Learning-rate schedules over rounds (:func:`engine.fl.local_training.scheduled_lr`).
LR_SCHEDULES = ("constant", "cosine", "step")
#: Segmentation losses (:func:`engine.fl.local_training.segmentation_loss`).
SEGMENTATION_LOSSES = ("dice", "dicece")
#: Selector BatchNorm during local training (``LocalTrainingConfig.selector_bn``).
SELECTOR_BN_MODES = ("batch", "running", "fresh")

__all__ = ["LR_SCHEDULES", "SEGMENTATION_LOSSES", "SELECTOR_BN_MODES"]
