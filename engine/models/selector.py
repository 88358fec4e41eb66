"""Model selector: a VGG-11 (batch norm) backbone that tells which site an image looks like.

The paper's reference selector keeps VGG-11's classic classifier (25088-4096-4096-K), which
holds ~120M of its ~129M parameters. The selector only has to recognise a site's acquisition
style, so the default head is global average pooling followed by a small MLP: the same
backbone at a few percent of the traffic. The classic head stays available for comparison.

``width`` is the backbone's first convolution width; every later layer scales with it (VGG-11's
64-128-256-256-512-512-512-512 at the paper's 64). The backbone's parameters scale with its
square: width 16 holds 1/16 of the paper's 9.2M, for a selector that travels every round with
its Adam moments (issue 33 measures routing against the paper's width before any default moves).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise
from typing import Literal

import torch
from torch import nn

#: VGG-11 configuration "A": conv widths, "M" = 2x2 max pooling.
VGG11_LAYOUT: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
#: The paper's backbone width (the first convolution's channels in :data:`VGG11_LAYOUT`).
PAPER_WIDTH = 64
#: Widths a selector may have: the paper's and narrower ones (every layer divides exactly).
SELECTOR_WIDTHS = (8, 16, 32, 64)

SelectorHead = Literal["gap", "classic"]


def check_width(width: int) -> int:
    """Return ``width`` if a selector may have it, else raise :class:`ValueError` naming the choices."""
    if width not in SELECTOR_WIDTHS:
        raise ValueError(f"selector width must be one of {SELECTOR_WIDTHS} (the paper's is {PAPER_WIDTH}), "
                         f"got {width!r}")
    return width


def feature_channels(width: int = PAPER_WIDTH) -> int:
    """Channels of the backbone's last feature map (512 at the paper's width)."""
    return 512 * width // PAPER_WIDTH


def _vgg11_bn_features(in_channels: int, base: int = PAPER_WIDTH) -> nn.Sequential:
    layers: list[nn.Module] = []
    channels = in_channels
    for item in VGG11_LAYOUT:
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            width = int(item) * base // PAPER_WIDTH
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
    width
        The backbone's first convolution width (:data:`SELECTOR_WIDTHS`; the paper's 64 by
        default); the gap head's first layer takes :func:`feature_channels` inputs.
    """

    def __init__(self, in_channels: int, num_classes: int, head: SelectorHead = "gap",
                 width: int = PAPER_WIDTH) -> None:
        super().__init__()
        self.width = check_width(width)
        self.features = _vgg11_bn_features(in_channels, width)
        features = feature_channels(width)
        if head == "gap":
            self.pool: nn.Module = nn.AdaptiveAvgPool2d(1)
            self.classifier = nn.Sequential(
                nn.Flatten(),
                nn.Linear(features, 256),
                nn.ReLU(inplace=True),
                nn.Linear(256, num_classes),
            )
        elif head == "classic":
            self.pool = nn.AdaptiveAvgPool2d(7)
            self.classifier = nn.Sequential(
                nn.Flatten(),
                nn.Linear(features * 7 * 7, 4096),
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


def build_selector(in_channels: int, num_classes: int, head: SelectorHead = "gap",
                   width: int = PAPER_WIDTH) -> ModelSelector:
    """Build a model selector; see :class:`ModelSelector`."""
    return ModelSelector(in_channels, num_classes, head, width)


def width_of(weights: Mapping[str, torch.Tensor]) -> int:
    """The backbone width of a selector's weights: its first convolution's output channels."""
    return int(weights["features.0.weight"].shape[0])


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def head_parameter_count(head: SelectorHead, num_classes: int, width: int = PAPER_WIDTH) -> int:
    """Parameters of a selector head alone (weights + biases), without building it.

    Lets traffic reports compare heads without allocating the 120M-parameter classic head.
    """
    features = feature_channels(width)
    if head == "gap":
        dims = [features, 256, num_classes]
    elif head == "classic":
        dims = [features * 7 * 7, 4096, 4096, num_classes]
    else:
        raise ValueError(f"unknown selector head {head!r}")
    return sum(a * b + b for a, b in pairwise(dims))
