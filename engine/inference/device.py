"""Choosing the compute device for inference."""

from __future__ import annotations

import torch

from engine.errors import ConfigError, DeviceError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:<index>")


def resolve_device(name: str = "auto") -> tuple[torch.device, bool]:
    """Turn a device name into a torch device and whether to use mixed precision.

    Parameters
    ----------
    name
        ``"auto"`` (the first CUDA GPU when one is visible, else the CPU), ``"cpu"``,
        ``"cuda"`` or ``"cuda:<index>"``.

    Returns
    -------
    device, use_amp
        ``use_amp`` is True on CUDA: fp16 autocast roughly halves memory and time there,
        and U-Net masks thresholded at 0.5 are insensitive to it. On the CPU fp16 is slow
        or unsupported, so it is False.

    Raises
    ------
    DeviceError
        When CUDA is asked for but no CUDA GPU is visible (or the index is out of range).
    ConfigError
        When the name is not one of the choices.
    """
    key = str(name).strip().lower()
    if key == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), True
        return torch.device("cpu"), False
    if key == "cpu":
        return torch.device("cpu"), False
    if key == "cuda" or key.startswith("cuda:"):
        index_text = key.partition(":")[2]
        if key.startswith("cuda:") and not index_text.isdigit():
            raise ConfigError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device {name!r} was requested but no CUDA GPU is visible to PyTorch on this machine; "
                "use --device cpu or --device auto"
            )
        count = torch.cuda.device_count()
        if index_text and int(index_text) >= count:
            raise DeviceError(
                f"device {name!r} was requested but only {count} CUDA GPU(s) are visible "
                f"(cuda:0..cuda:{count - 1}); choose one of those or --device auto"
            )
        return torch.device(key), True
    raise ConfigError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")
