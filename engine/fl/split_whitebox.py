"""White-box split learning: BlackFed's split and schedule with a first-order client (benchmark baseline).

The paper compares BlackFed against split training where the client net gets true gradients.
Here the coordinator answers each client step with ``dL/d activations`` of the uploaded batch,
and the site back-propagates it through ``f_k`` and takes an AdamW step (``server_lr``). Same
networks, seeds, round robin, batches and server phase as :class:`~engine.fl.blackfed.BlackFed`
v1, so the difference in Dice is the price of the zero-order (gradient-free) client.

This method sends a gradient to the sites by design: it is the comparison BlackFed's threat
model excludes, not an alternative to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.fl.blackfed import BlackFed, BlackFedConfig
from engine.fl.blackfed_nets import split_loss

if TYPE_CHECKING:
    from engine.fl.exchange import Reply
    from engine.tasks import TaskSpec


@dataclass
class _FirstOrderTurn:
    """The client net trained during one turn, its AdamW, and the batch whose gradient is awaited."""

    net: torch.nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor | None = None

    @property
    def pending(self) -> bool:
        return self.x is not None


class SplitWhiteBox(BlackFed):
    """Split learning with a first-order client (sends ``dL/d activations`` to the site)."""

    name = "split-whitebox"
    CLIENT_ACTION: ClassVar[str] = "client_grad"
    FEEDBACK: ClassVar[str] = "activation_grad"
    REQUEST_CONTENTS: ClassVar[dict[str, str]] = {
        "activation_grad": "gradient of the coordinator's loss w.r.t. the site's uploaded activations "
                           "(white-box baseline only; BlackFed never sends it)",
    }

    def __init__(self, task: TaskSpec, site_names: list[str], seed: int = 0, rounds: int = 1,
                 config: BlackFedConfig | None = None) -> None:
        super().__init__(task, site_names, seed, rounds, "v1", config)
        self.name = "split-whitebox"  # type: ignore[misc]
        self._nets: dict[int, torch.nn.Module] = {}

    def client_feedback(self, g: torch.nn.Module, reply: Reply) -> torch.Tensor:
        acts = reply.tensors["activations"].detach().clone().requires_grad_(True)
        g.eval()
        for p in g.parameters():
            p.requires_grad_(False)
        try:
            loss = split_loss(g(acts), reply.tensors["masks"].to(torch.float32))
            (grad,) = torch.autograd.grad(loss, acts)
        finally:
            for p in g.parameters():
                p.requires_grad_(True)
        return grad.detach()

    def copies_per_image(self, action: str) -> int:
        return 1  # one forward pass per client step

    def start_turn(self, net: torch.nn.Module) -> Any:
        own = self.client_net(net.state_dict())
        return _FirstOrderTurn(own, torch.optim.AdamW(own.parameters(), lr=self.config.server_lr))

    def apply_feedback(self, turn: Any, net: torch.nn.Module, feedback: torch.Tensor) -> None:
        turn.opt.zero_grad(set_to_none=True)
        out = turn.net(turn.x)
        out.backward(feedback.to(out.dtype))
        turn.opt.step()
        turn.x = None
        net.load_state_dict(turn.net.state_dict())

    def client_activations(self, turn: Any, net: torch.nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
        turn.x = x
        with torch.no_grad():
            return turn.net(x)


def build_split_whitebox(name: str, task: TaskSpec, site_names: list[str],
                         settings: Mapping[str, Any]) -> SplitWhiteBox:
    """Registry factory of the white-box split baseline (reads BlackFed's ``blackfed_*`` settings)."""
    translated = {k.replace("split_", "blackfed_", 1) if k.startswith("split_") else k: v for k, v in settings.items()}
    return SplitWhiteBox(task, site_names, int(settings.get("seed", 0)), int(settings.get("rounds", 1)),
                         BlackFedConfig.from_settings(translated))
