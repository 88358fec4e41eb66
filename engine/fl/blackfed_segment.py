"""Segmentation with a split network (client net then server net), for evaluation and inference."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from engine.fl.blackfed_nets import build_client_net, build_server_net
from engine.fl.local_training import Device
from engine.tasks import TaskSpec


def split_logits(task: TaskSpec, channels: int, client: Mapping[str, torch.Tensor],
                 server: Mapping[str, torch.Tensor], images: np.ndarray, device: str = "auto",
                 batch_size: int = 16) -> np.ndarray:
    """Logits ``float32 (N, L, H, W)`` of ``server(client(images))``."""
    dev = Device.resolve(device)
    f = build_client_net(task.in_channels, channels)
    f.load_state_dict(dict(client))
    g = build_server_net(channels, task.out_channels)
    g.load_state_dict(dict(server))
    f.to(dev.torch_device).eval()
    g.to(dev.torch_device).eval()
    out = np.zeros((len(images), task.out_channels, *images.shape[2:]), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            x = torch.from_numpy(np.ascontiguousarray(images[start:start + batch_size])).to(dev.torch_device)
            out[start:start + batch_size] = g(f(x)).float().cpu().numpy()
    return out


def split_segmenter(task: TaskSpec, channels: int, clients: Sequence[Mapping[str, torch.Tensor]],
                    servers: Sequence[Mapping[str, torch.Tensor]],
                    device: str = "auto") -> Callable[[int, np.ndarray], np.ndarray]:
    """``predict(k, images) -> uint8 masks`` with site ``k``'s client net and server net."""

    def predict(k: int, images: np.ndarray) -> np.ndarray:
        return (split_logits(task, channels, clients[k], servers[k], images, device) > 0).astype(np.uint8)

    return predict
