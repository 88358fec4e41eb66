"""BlackFed's pieces: the split network, its loss and the SPSA-GC zero-order optimiser.

BlackFed (Paranjape et al., NeurIPS 2024) splits a segmentation network in two:

- the **client net** ``f_k`` (:func:`build_client_net`): two 3x3 convolutions with ``C``
  output channels at full resolution; it stays at site ``k`` and is trained without any
  gradient from the coordinator, by SPSA-GC (:class:`SpsaGc`);
- the **server net** ``g`` (:func:`build_server_net`): MONAI's 2D U-Net with
  ``in_channels = C`` and FedSM's channels and strides, trained by the coordinator with AdamW
  on the activations ``f_k(x)`` the sites send.

Everything here is plain torch on flat parameter vectors, so the site half and the tests use
the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ConfigError
from engine.fl.blackfed_config import DEFAULT_SPLIT_CHANNELS, SpsaSettings
from engine.models import build_segmentation_net


class ClientNet(nn.Sequential):
    """``f_k``: conv 3x3 (in -> C), ReLU, conv 3x3 (C -> C); full resolution, linear output.

    The authors' client is a U-Net's first double convolution (with BatchNorm and a final
    ReLU). Here BatchNorm is left out: its running statistics would change with every one of
    SPSA's perturbed forward passes, and a zero-order step cannot tell those changes from the
    weights'. The output stays linear so the server net's first normalisation sees signed features.
    """

    def __init__(self, in_channels: int, channels: int = DEFAULT_SPLIT_CHANNELS) -> None:
        if in_channels < 1 or channels < 1:
            raise ConfigError(f"client net channels must be >= 1, got in={in_channels}, out={channels}")
        super().__init__(nn.Conv2d(in_channels, channels, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(channels, channels, 3, padding=1))


def build_client_net(in_channels: int, channels: int = DEFAULT_SPLIT_CHANNELS) -> ClientNet:
    """The site's client net (see :class:`ClientNet`)."""
    return ClientNet(in_channels, channels)


def build_server_net(channels: int, out_channels: int) -> nn.Module:
    """The coordinator's server net: FedSM's U-Net with ``in_channels = channels``."""
    return build_segmentation_net(channels, out_channels)


def split_loss(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """BCE + Dice on sigmoid outputs (the authors' ``"bce + dice"``), one Dice over the batch."""
    probs = torch.sigmoid(logits)
    dims = (0, 2, 3)
    inter = (probs * masks).sum(dims)
    dice = 1.0 - (2.0 * inter + 1e-5) / (probs.sum(dims) + masks.sum(dims) + 1e-5)
    return F.binary_cross_entropy_with_logits(logits, masks) + dice.mean()


def client_flops_per_image(in_channels: int, channels: int, size: int) -> int:
    """Multiply-accumulates x 2 of one client-net forward pass on a ``size x size`` image."""
    macs = size * size * 9 * (in_channels * channels + channels * channels)
    return 2 * macs


def rademacher(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` independent signs ``+-1`` (float32)."""
    return torch.randint(0, 2, (n,), generator=generator).to(torch.float32).mul_(2).sub_(1)


def spsa_gradient(losses: torch.Tensor, deltas: torch.Tensor, c: float) -> torch.Tensor:
    """SPSA estimate from ``losses = [L(x + c d_1), L(x - c d_1), L(x + c d_2), ...]``.

    ``g = mean_p (L+_p - L-_p) / (2c) * d_p`` (``1/d = d`` for Rademacher signs). Unbiased
    up to ``O(c^2)`` third-derivative terms; exact in expectation for a quadratic.
    """
    pairs = losses.reshape(-1, 2).to(torch.float64)
    if pairs.shape[0] != deltas.shape[0]:
        raise ConfigError(f"{pairs.shape[0]} loss pairs for {deltas.shape[0]} perturbations")
    diff = (pairs[:, 0] - pairs[:, 1]) / (2.0 * c)
    return (diff[:, None] * deltas.to(torch.float64)).mean(0).to(torch.float32)


class SpsaGc:
    """SPSA with gradient correction (Oh et al., BlackVIP, CVPR 2023), on a flat parameter vector.

    One step evaluates the loss at the look-ahead point ``theta + beta m`` perturbed by
    ``+- c delta_p`` (Nesterov-style correction), then::

        g_hat = SPSA estimate at theta + beta m
        m     = beta m - a g_hat
        theta = theta + m

    The step is split in two halves so a transport can sit between them:
    :meth:`probe_points` gives the ``2P`` parameter vectors to evaluate, :meth:`update` takes
    the ``2P`` losses.
    """

    def __init__(self, theta: torch.Tensor, settings: SpsaSettings, momentum: torch.Tensor | None = None) -> None:
        self.theta = theta.detach().to(torch.float32).clone()
        self.settings = settings
        self.m = torch.zeros_like(self.theta) if momentum is None else momentum.detach().clone()
        self._deltas: torch.Tensor | None = None

    @property
    def pending(self) -> bool:
        """Whether probe points were handed out and their losses not yet applied."""
        return self._deltas is not None

    def probe_points(self, generator: torch.Generator) -> list[torch.Tensor]:
        """The ``2P`` vectors ``lookahead + c d_1, lookahead - c d_1, ...`` to evaluate the loss at."""
        s = self.settings
        self._deltas = torch.stack([rademacher(self.theta.numel(), generator) for _ in range(s.perturbations)])
        centre = self.theta + s.momentum * self.m
        points: list[torch.Tensor] = []
        for delta in self._deltas:
            points += [centre + s.c * delta, centre - s.c * delta]
        return points

    def update(self, losses: torch.Tensor) -> torch.Tensor:
        """Apply the step with the losses of :meth:`probe_points`; return the gradient estimate."""
        if self._deltas is None:
            raise ConfigError("SPSA update without probe points; call probe_points first")
        if losses.numel() != 2 * len(self._deltas):
            raise ConfigError(f"expected {2 * len(self._deltas)} losses, got {losses.numel()}")
        g_hat = spsa_gradient(losses.reshape(-1), self._deltas, self.settings.c)
        self.m = self.settings.momentum * self.m - self.settings.lr * g_hat
        self.theta = self.theta + self.m
        self._deltas = None
        return g_hat

    def step(self, loss_fn: Callable[[torch.Tensor], float], generator: torch.Generator) -> torch.Tensor:
        """One whole step where the losses can be computed here (tests, single-process use)."""
        points = self.probe_points(generator)
        return self.update(torch.tensor([loss_fn(p) for p in points], dtype=torch.float64))


def flat_parameters(net: nn.Module) -> torch.Tensor:
    """The net's parameters as one float32 vector (in ``parameters()`` order)."""
    return torch.nn.utils.parameters_to_vector([p.detach() for p in net.parameters()]).to(torch.float32)


def load_flat(net: nn.Module, theta: torch.Tensor) -> None:
    """Write a flat vector back into the net's parameters."""
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(theta, list(net.parameters()))


def weights_of(net: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of a net's state dict."""
    return {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}


def net_from(build: Callable[[], nn.Module], weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """A net built by ``build`` with ``weights`` loaded."""
    net = build()
    net.load_state_dict(dict(weights))
    return net
