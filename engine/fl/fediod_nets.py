"""FedIOD's generator (at the coordinator) and discriminator (one per site), sized for a CPU.

The generator maps noise ``w`` to images in [0, 1], the range both tasks' normalised images
lie in (``rgb/255`` and the volume's 1st-99th percentile scaling, see
:mod:`engine.data.preprocess`). The discriminator is a patch discriminator without batch
normalisation, so a generated image's score (and the gradient the site releases for it) does
not depend on the other images of the batch.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from engine.errors import ConfigError


class Generator(nn.Module):
    """DCGAN-style generator: a linear map to an ``S/8`` grid, three upsampling blocks, a sigmoid.

    Parameters
    ----------
    z_dim
        Length of the noise vector.
    out_channels
        Image channels (the task's ``in_channels``).
    image_size
        Side of the square images (a multiple of 16).
    width
        Feature channels of the last block (the first has ``4 * width``).
    """

    def __init__(self, z_dim: int, out_channels: int, image_size: int, width: int = 32) -> None:
        super().__init__()
        if image_size < 16 or image_size % 16:
            raise ConfigError(f"the generator needs an image size that is a multiple of 16, got {image_size}")
        if z_dim < 1 or width < 1:
            raise ConfigError(f"z_dim and width must be >= 1, got {z_dim} and {width}")
        self.z_dim = z_dim
        self.base = image_size // 8
        self.width = width
        self.project = nn.Sequential(nn.Linear(z_dim, 4 * width * self.base * self.base),
                                     nn.BatchNorm1d(4 * width * self.base * self.base))
        blocks: list[nn.Module] = []
        channels = [4 * width, 2 * width, width, width]
        for c_in, c_out in itertools.pairwise(channels):
            blocks += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c_in, c_out, 3, padding=1),
                       nn.BatchNorm2d(c_out), nn.LeakyReLU(0.2)]
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Conv2d(width, out_channels, 3, padding=1)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        h = self.project(w).view(-1, 4 * self.width, self.base, self.base)
        return torch.sigmoid(self.head(self.blocks(h)))


class PatchDiscriminator(nn.Module):
    """Three strided 4x4 convolutions and a 3x3 head: one real/generated logit per ``8x8`` patch.

    Parameters
    ----------
    in_channels
        Image channels.
    width
        Feature channels of the first convolution.
    """

    def __init__(self, in_channels: int, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, width, 4, stride=2, padding=1), nn.LeakyReLU(0.2),
            nn.Conv2d(width, 2 * width, 4, stride=2, padding=1), nn.LeakyReLU(0.2),
            nn.Conv2d(2 * width, 2 * width, 4, stride=2, padding=1), nn.LeakyReLU(0.2),
            nn.Conv2d(2 * width, 1, 3, padding=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
