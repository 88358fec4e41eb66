"""Networks of the FedSM super model: segmentation U-Net and model selector."""

from engine.models.segmentation import build_segmentation_net
from engine.models.selector import ModelSelector, build_selector, count_parameters

__all__ = ["ModelSelector", "build_segmentation_net", "build_selector", "count_parameters"]
