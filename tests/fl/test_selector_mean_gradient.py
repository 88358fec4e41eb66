"""The reference selector's step follows the MEAN of its pass's batch gradients, not their sum.

Summed, a site's share of the federation's averaged Adam moments grows with its batch count on
top of its sample weight, so the largest site steers every site's next step (engine/fl/selector_training.py).
"""

import numpy as np
import torch
import torch.nn.functional as F
from testsupport import random_split

import engine.models
from engine.fl.local_training import LocalTrainingConfig, RoundContext, selector_inputs
from engine.fl.selector_training import initial_optimizer_state, reference_selector_round
from engine.tasks import FUNDUS


def _linear_selector(in_channels: int, num_classes: int, head: str = "gap", width: int = 64) -> torch.nn.Module:
    """A selector without BatchNorm: every image's gradient is its own, whatever batch it is in."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_channels * 32 * 32, num_classes))


def test_the_step_follows_the_mean_batch_gradient_whatever_the_batch_count(monkeypatch):
    monkeypatch.setattr(engine.models, "build_selector", _linear_selector)
    cfg = LocalTrainingConfig(epochs=1, batch_size=2, lr=1e-3, selector_lr=1e-3, selector_size=32, device="cpu")
    net = _linear_selector(3, 2)
    weights, zero = net.state_dict(), initial_optimizer_state(net)
    images = random_split(4, seed=3).images
    # by hand: equal batches of 2, so the mean of the batches' mean gradients is the mean over all images
    x = torch.from_numpy(selector_inputs(images, 32))
    net.zero_grad()
    F.cross_entropy(net(x), torch.full((len(x),), 1)).backward()
    mean_grad = {name: p.grad.clone() for name, p in net.named_parameters()}
    for data in (images, np.concatenate([images, images])):  # 2 batches, then the same images in 4
        _, optim, metrics = reference_selector_round(FUNDUS, weights, zero, np.full(len(data), 1), 2, data, cfg, 0,
                                                     RoundContext("fedsm", 1, "b"))
        for name, grad in mean_grad.items():  # Adam's first step from zero moments: m = 0.1 g, v = 0.001 g^2
            assert torch.allclose(optim[f"exp_avg.{name}"], 0.1 * grad, rtol=1e-4, atol=1e-10), (len(data), name)
            assert torch.allclose(optim[f"exp_avg_sq.{name}"], 0.001 * grad ** 2, rtol=1e-3, atol=1e-14), name
        assert metrics["loss_selector"] > 0
