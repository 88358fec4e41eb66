"""Scaffold with Adam: the site control variate is the mean of the round's uncorrected gradients.

Option II of Karimireddy et al. (``c_k - c + (x - y_k) / (steps * lr)``) assumes plain SGD steps;
with Adam it has the wrong scale. These tests pin the replacement: ``c_k+`` = mean over the
round's minibatches of the gradient *before* ``c - c_k`` is added, while the optimizer sees the
corrected gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from testsupport import random_split

from engine.fl.aggregation import scaffold_site_control
from engine.fl.local_training import Device, ScaffoldGradients, _dice_loss, _Learner, batch_order
from engine.fl.methods import Scaffold, SiteRuntime
from engine.models import build_segmentation_net
from engine.tasks import FUNDUS


def _tiny_learner(weight: list[float], bias: float) -> _Learner:
    net = torch.nn.Linear(2, 1)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([weight]))
        net.bias.fill_(bias)
    return _Learner(net, lr=0.1, device=Device(torch.device("cpu"), amp=False))


def test_hook_sums_uncorrected_gradients_and_adam_sees_corrected_ones():
    # Prepare: linear losses, so each step's gradient is known whatever the weights are:
    # loss_b = w . a_b + bias * s_b  ->  d/dw = a_b, d/dbias = s_b
    learner = _tiny_learner([0.5, -0.5], 0.0)
    a = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -2.0]]), torch.tensor([[-1.0, 3.0]])]
    s = [1.0, -2.0, 4.0]
    correction = {"weight": torch.tensor([[0.5, -0.25]]), "bias": torch.tensor([2.0])}
    hook = ScaffoldGradients(correction)
    # Execute
    seen = []
    for a_b, s_b in zip(a, s, strict=True):
        learner.step(lambda net, a_b=a_b, s_b=s_b: (net.weight * a_b).sum() + net.bias.sum() * s_b, hook)
        seen.append((learner.net.weight.grad.clone(), learner.net.bias.grad.clone()))
    # Assert: the optimizer saw gradient + (c - c_k) ...
    for (gw, gb), a_b, s_b in zip(seen, a, s, strict=True):
        assert torch.allclose(gw, a_b + correction["weight"])
        assert torch.allclose(gb, torch.tensor([s_b]) + correction["bias"])
    # ... and c_k+ is the mean of the uncorrected gradients: ((1+3-1)/3, (2-2+3)/3) = (1, 1), bias (1-2+4)/3 = 1
    c_new = scaffold_site_control(hook.gradient_sum(), hook.batches, {k: torch.zeros_like(v)
                                                                      for k, v in correction.items()})
    assert hook.batches == 3 and hook.skipped == 0
    assert torch.allclose(c_new["weight"], torch.tensor([[1.0, 1.0]]))
    assert torch.allclose(c_new["bias"], torch.tensor([1.0]))


def test_control_is_mean_gradient_along_the_adam_trajectory_not_option_two():
    # Prepare: quadratic loss 0.5 * ||w - t||^2 with small gradients; the gradient at each step is
    # w_b - t, where w_b is the weight *before* step b (recorded inside the loss function)
    target = torch.tensor([[0.51, -0.49]])
    learner = _tiny_learner([0.5, -0.5], 0.0)
    start = learner.net.weight.detach().clone()
    hook = ScaffoldGradients({"weight": torch.zeros(1, 2), "bias": torch.zeros(1)})
    iterates = []

    def loss(net):
        iterates.append(net.weight.detach().clone())
        return 0.5 * (net.weight - target).pow(2).sum()

    steps = 4
    for _ in range(steps):
        learner.step(loss, hook)
    # Execute
    c_new = scaffold_site_control(hook.gradient_sum(), hook.batches,
                                  {"weight": torch.zeros(1, 2), "bias": torch.zeros(1)})
    # Assert: mean of (w_b - t) over the four iterates Adam visited; the bias had gradient 0
    expected = torch.stack([w - target for w in iterates]).mean(0)
    assert torch.allclose(c_new["weight"], expected, atol=1e-6)
    assert torch.equal(c_new["bias"], torch.zeros(1))
    # Option II, (x - y)/(steps * lr), would be of order 1 per coordinate here: Adam moves ~lr per
    # coordinate per step whatever the gradient's size (gradients are ~0.01)
    option_two = (start - learner.net.weight.detach()) / (steps * 0.1)
    assert float(expected.abs().max()) < 0.05 < float(option_two.abs().min())


def test_hook_leaves_non_finite_steps_out_of_the_mean():
    learner = _tiny_learner([0.0, 0.0], 0.0)
    hook = ScaffoldGradients({"weight": torch.zeros(1, 2), "bias": torch.zeros(1)})
    learner.step(lambda net: (net.weight * torch.tensor([[2.0, 4.0]])).sum() + 0 * net.bias.sum(), hook)
    learner.step(lambda net: (net.weight * torch.tensor([[float("inf"), 1.0]])).sum() + 0 * net.bias.sum(), hook)
    assert (hook.batches, hook.skipped) == (1, 1)
    assert torch.allclose(hook.gradient_sum()["weight"], torch.tensor([[2.0, 4.0]]))


def test_scaffold_site_control_after_one_batch_is_the_gradient_at_the_received_weights(tiny_training):
    # Prepare: 4 training images and batch 4 -> one step, taken at the received weights x, so
    # c_k+ must equal the Dice-loss gradient at x on that batch (computed independently below)
    site = SiteRuntime("site1", 0, random_split(4, seed=3))
    method = Scaffold(FUNDUS, ["site1", "site2"], tiny_training, seed=1)
    state = method.initial_state()
    state["control"] = {k: torch.full_like(v, 0.01) for k, v in state["control"].items()}  # c != 0 = c_k
    instructions = method.site_instructions(state, 1, "site1")
    # Execute
    update = method.train_at_site(instructions, site)
    # Assert
    net = build_segmentation_net(FUNDUS.in_channels, FUNDUS.out_channels)
    net.load_state_dict(state["global"])
    net.train()
    (idx,) = batch_order(4, tiny_training.batch_size, tiny_training.epochs, method._site_seed(1, site))
    _dice_loss()(net(torch.from_numpy(site.train.images[idx])), torch.from_numpy(site.train.masks[idx])).backward()
    c_new = site.state["scaffold_control"]
    assert set(c_new) == {name for name, _ in net.named_parameters()}
    for name, param in net.named_parameters():
        assert torch.allclose(c_new[name], param.grad, rtol=1e-4, atol=1e-7), name
        # the site sends c_k+ - c_k, and its old c_k was 0
        assert torch.equal(update.weights["control_delta"][name], c_new[name])


def test_scaffold_second_round_sends_the_change_of_its_control(tiny_training):
    rts = [SiteRuntime(f"site{k + 1}", k, random_split(6, seed=k, shift=0.3 * k)) for k in range(2)]
    method = Scaffold(FUNDUS, [s.name for s in rts], tiny_training, seed=0)
    state = method.initial_state()
    first = method.train_at_site(method.site_instructions(state, 1, "site1"), rts[0])
    c1 = {k: v.clone() for k, v in rts[0].state["scaffold_control"].items()}
    state = method.aggregate(state, 1, {"site1": first})
    second = method.train_at_site(method.site_instructions(state, 2, "site1"), rts[0])
    c2 = rts[0].state["scaffold_control"]
    for k in c1:
        assert torch.allclose(second.weights["control_delta"][k], c2[k] - c1[k])
    # on the gradient's scale: a few Dice-loss gradients, nowhere near option II's ~1 per coordinate
    assert max(float(v.abs().max()) for v in c2.values()) < 1.0
    assert np.isfinite(second.metrics["loss"])


@pytest.mark.parametrize("batches", [1, 2])
def test_gradient_sum_has_every_parameter(batches):
    hook = ScaffoldGradients({"weight": torch.zeros(1, 2), "bias": torch.zeros(1)})
    learner = _tiny_learner([1.0, 1.0], 0.0)
    for _ in range(batches):
        learner.step(lambda net: net.weight.sum(), hook)  # bias gets no gradient at all
    out = hook.gradient_sum()
    assert torch.equal(out["bias"], torch.zeros(1)) and torch.allclose(out["weight"], torch.full((1, 2), batches * 1.0))
