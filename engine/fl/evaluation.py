"""Dice per case, segmentation with one network, and the selector's routing accuracy."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from engine.data.preprocess import resize_images
from engine.fl.local_training import Device
from engine.models import build_selector
from engine.models.segmentation import segmentation_net_holding
from engine.models.selector import width_of
from engine.tasks import TaskSpec


def dice_per_case(pred: np.ndarray, truth: np.ndarray, case_ids: np.ndarray) -> np.ndarray:
    """Dice of each case and structure.

    Parameters
    ----------
    pred, truth
        Binary ``(N, L, H, W)`` arrays over N images or slices.
    case_ids
        ``(N,)`` case index per image; the slices of one volume share it, so volumes get a
        3D Dice, not a mean of slice Dice values.

    Returns
    -------
    numpy.ndarray
        ``(num_cases, L)`` Dice values, cases in ascending id order. A structure absent from
        both prediction and truth of a case scores 1.
    """
    pred = pred.astype(bool)
    truth = truth.astype(bool)
    cases = np.unique(case_ids)
    out = np.zeros((len(cases), pred.shape[1]), dtype=np.float64)
    for i, case in enumerate(cases):
        sel = case_ids == case
        p = pred[sel].swapaxes(0, 1).reshape(pred.shape[1], -1)
        t = truth[sel].swapaxes(0, 1).reshape(truth.shape[1], -1)
        inter = (p & t).sum(1)
        denom = p.sum(1) + t.sum(1)
        out[i] = np.where(denom > 0, 2.0 * inter / np.maximum(denom, 1), 1.0)
    return out


def segment_with(task: TaskSpec, weights: Mapping[str, torch.Tensor], images: np.ndarray,
                 device: str = "auto", batch_size: int = 16) -> np.ndarray:
    """Binary masks ``uint8 (N, L, H, W)`` from one segmentation network (sigmoid > 0.5)."""
    dev = Device.resolve(device)
    net = segmentation_net_holding(task.in_channels, task.out_channels, weights).to(dev.torch_device)
    out = np.zeros((len(images), task.out_channels, *images.shape[2:]), dtype=np.uint8)
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            x = torch.from_numpy(images[start:start + batch_size]).to(dev.torch_device)
            with torch.autocast("cuda", enabled=dev.amp):
                logits = net(x)
            out[start:start + batch_size] = (logits.float() > 0).cpu().numpy()
    return out


def selector_probabilities(task: TaskSpec, weights: Mapping[str, torch.Tensor], num_classes: int,
                           images: np.ndarray, selector_size: int, head: str = "gap",
                           device: str = "auto", batch_size: int = 64) -> np.ndarray:
    """Softmax output ``float32 (N, num_classes)`` of a selector on already normalised images (its width
    read from ``weights``)."""
    dev = Device.resolve(device)
    net = build_selector(task.in_channels, num_classes, head, width_of(weights))  # type: ignore[arg-type]
    net.load_state_dict(weights)
    net.to(dev.torch_device).eval()
    small = resize_images(images, selector_size)
    probs = np.zeros((len(images), num_classes), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            x = torch.from_numpy(small[start:start + batch_size]).to(dev.torch_device)
            probs[start:start + batch_size] = torch.softmax(net(x).float(), dim=1).cpu().numpy()
    return probs
