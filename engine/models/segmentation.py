"""Segmentation network: MONAI's 2D residual U-Net, as used in the FedSM paper's experiments."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
from torch import nn

#: Feature channels per level and downsampling strides of the U-Net.
UNET_CHANNELS = (16, 32, 64, 128, 256)
UNET_STRIDES = (2, 2, 2, 2)
UNET_RESIDUAL_UNITS = 2


def build_segmentation_net(in_channels: int, out_channels: int) -> nn.Module:
    """Build the 2D U-Net shared by the global and the personalized models.

    Parameters
    ----------
    in_channels
        Image channels: 3 for RGB fundus photos, 1 for MRI slices.
    out_channels
        One logit map per structure (sigmoid, not softmax): 2 for fundus (disc, cup),
        1 for prostate.

    Returns
    -------
    torch.nn.Module
        A ``monai.networks.nets.UNet`` producing logits of shape ``(N, out_channels, H, W)``;
        H and W must be multiples of 16.
    """
    from monai.networks.nets import UNet

    return UNet(
        spatial_dims=2,
        in_channels=in_channels,
        out_channels=out_channels,
        channels=UNET_CHANNELS,
        strides=UNET_STRIDES,
        num_res_units=UNET_RESIDUAL_UNITS,
    )


#: Per thread, one U-Net per (in, out) channel pair that :func:`segmentation_net_holding` reloads.
_reused = threading.local()


def segmentation_net_holding(in_channels: int, out_channels: int,
                             weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """A U-Net holding a copy of ``weights``, in eval mode, for inference.

    Building MONAI's U-Net is ~35 ms of Python (its blocks and their random initialisation);
    loading weights into one already built is ~4 ms, and an evaluation loads a model per site
    and round hundreds of times. So the network is built once per thread and channel pair and
    reloaded: every parameter and buffer is overwritten (``strict`` loading), and building it draws
    nothing from the caller's random generator.

    The module is shared with the next call in the same thread: use it before that call, do not
    keep it, do not train it.
    """
    nets = getattr(_reused, "nets", None)
    if nets is None:
        nets = _reused.nets = {}
    key = (int(in_channels), int(out_channels))
    net = nets.get(key)
    if net is None:
        # built under its own generator state, so that the first evaluation of a run draws no
        # more random numbers from the caller's stream than later ones (none)
        with torch.random.fork_rng(devices=[]):
            net = nets[key] = build_segmentation_net(in_channels, out_channels)
    net.load_state_dict(weights)
    return net.eval()
