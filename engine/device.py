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


def describe_device(name: str = "auto") -> dict[str, object]:
    """Which device inference would use for ``name``, and why, without loading any model.

    Returns
    -------
    dict
        ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``; ``None`` when the request cannot be
        met), ``requested``, ``available``, ``mixed_precision``, ``name`` (GPU model or
        ``"CPU"``), ``cuda_available``, ``gpus`` (names of the visible CUDA GPUs) and ``reason``,
        one sentence for the user, e.g. ``{"device": "cpu", "reason": "CUDA not available: this
        PyTorch build has no CUDA support"}``.

    Raises
    ------
    ConfigError
        When the name is not one of :data:`DEVICE_CHOICES`.
    """
    cuda = bool(torch.cuda.is_available())
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    if cuda:
        why_no_cuda = ""
    elif torch.version.cuda is None:
        why_no_cuda = "this PyTorch build has no CUDA support (CPU-only build)"
    else:
        why_no_cuda = f"PyTorch is built for CUDA {torch.version.cuda} but sees no GPU (driver or CUDA_VISIBLE_DEVICES)"
    info: dict[str, object] = {"requested": name, "cuda_available": cuda, "gpus": gpus}
    try:
        device, amp = resolve_device(name)
    except DeviceError as exc:
        return {**info, "device": None, "available": False, "mixed_precision": False, "name": None,
                "reason": str(exc)}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu = torch.cuda.get_device_name(index)
        how = "the first visible CUDA GPU" if str(name).strip().lower() == "auto" else "requested"
        reason = f"{gpu} ({how}); fp16 autocast on"
    else:
        gpu = "CPU"
        reason = "CPU requested" if str(name).strip().lower() == "cpu" else f"CUDA not available: {why_no_cuda}"
    return {**info, "device": str(device), "available": True, "mixed_precision": amp, "name": gpu, "reason": reason}
