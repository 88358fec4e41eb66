"""Segmentation network: MONAI's 2D residual U-Net, as used in the FedSM paper's experiments."""

from __future__ import annotations

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
