"""Model selector: a VGG-11 (batch norm) backbone that tells which site an image looks like.

The paper's reference selector keeps VGG-11's classic classifier (25088-4096-4096-K), which
holds ~120M of its ~129M parameters. The selector only has to recognise a site's acquisition
style, so the default head is global average pooling followed by a small MLP: the same
backbone at a few percent of the traffic. The classic head stays available for comparison.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Literal

import torch
from torch import nn

#: VGG-11 configuration "A": conv widths, "M" = 2x2 max pooling.
VGG11_LAYOUT: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")

SelectorHead = Literal["gap", "classic"]


def _vgg11_bn_features(in_channels: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    channels = in_channels
    for item in VGG11_LAYOUT:
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            width = int(item)
            layers += [
                nn.Conv2d(channels, width, kernel_size=3, padding=1),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
            ]
            channels = width
    return nn.Sequential(*layers)


class ModelSelector(nn.Module):
    """VGG-11-BN image classifier over K sites (or K+1 models for FedSM-extra).

    Parameters
    ----------
    in_channels
        Image channels (3 fundus, 1 MRI).
    num_classes
        Number of routing targets: K sites, or K + 1 models for FedSM-extra.
    head
        ``"gap"`` (default): global average pooling, 512-256-``num_classes`` MLP.
        ``"classic"``: adaptive 7x7 pooling and the 25088-4096-4096-``num_classes`` head of
        the original VGG, kept only to compare traffic and memory.
    """

    def __init__(self, in_channels: int, num_classes: int, head: SelectorHead = "gap") -> None:
        super().__init__()
        self.features = _vgg11_bn_features(in_channels)
        if head == "gap":
            self.pool: nn.Module = nn.AdaptiveAvgPool2d(1)
            self.classifier = nn.Sequential(
                nn.Flatten(),
                nn.Linear(512, 256),
                nn.ReLU(inplace=True),
                nn.Linear(256, num_classes),
            )
        elif head == "classic":
            self.pool = nn.AdaptiveAvgPool2d(7)
            self.classifier = nn.Sequential(
                nn.Flatten(),
                nn.Linear(512 * 7 * 7, 4096),
                nn.ReLU(inplace=True),
                nn.Dropout(),
                nn.Linear(4096, 4096),
                nn.ReLU(inplace=True),
                nn.Dropout(),
                nn.Linear(4096, num_classes),
            )
        else:
            raise ValueError(f"unknown selector head {head!r}; use 'gap' or 'classic'")
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits of shape ``(N, num_classes)``."""
        return self.classifier(self.pool(self.features(x)))


def build_selector(in_channels: int, num_classes: int, head: SelectorHead = "gap") -> ModelSelector:
    """Build a model selector; see :class:`ModelSelector`."""
    return ModelSelector(in_channels, num_classes, head)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def head_parameter_count(head: SelectorHead, num_classes: int) -> int:
    """Parameters of a selector head alone (weights + biases), without building it.

    Lets traffic reports compare heads without allocating the 120M-parameter classic head.
    """
    if head == "gap":
        dims = [512, 256, num_classes]
    elif head == "classic":
        dims = [512 * 7 * 7, 4096, 4096, num_classes]
    else:
        raise ValueError(f"unknown selector head {head!r}")
    return sum(a * b + b for a, b in pairwise(dims))
