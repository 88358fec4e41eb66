"""BlackFed v1 and v2 (Paranjape et al., NeurIPS 2024) as a dialogue method.

Split learning where nothing the coordinator sends is a weight or a gradient. Each site ``k``
keeps a small client net ``f_k`` (:mod:`engine.fl.blackfed_nets`); the coordinator keeps the
server net ``g``. One round visits the sites in configured order (round robin, the paper's
Algorithm 1); during site ``k``'s turn:

1. **client phase** (``client_epochs`` passes over the site's training batches): ``g`` fixed,
   ``f_k`` takes SPSA-GC steps. Per step the site sends the activations ``f_k(x)`` of one
   batch at the ``2P`` perturbed parameter vectors, plus the batch's masks; the coordinator
   answers with the ``2P`` loss values (scalars) in the next request; the site forms the
   zero-order gradient estimate itself.
2. **server phase** (``server_epochs`` passes): ``f_k`` fixed, the site sends ``f_k(x)`` and
   the masks of one batch per request; the coordinator takes one AdamW step on ``g`` (a fresh
   AdamW per turn, as the authors' code). Its requests carry nothing (the first one carries
   the last client step's losses).

v1 keeps one ``g`` (the last one) for every site. v2 also stores a copy of ``g`` after each
site's turn (``state["server/<site>"]``), and site ``k`` segments with ``f_k`` and its own
entry. Training is identical for v1 and v2 (their seeds do not depend on the variant), so
the two differ only in which ``g`` a site uses.

**What the coordinator learns.** Activations of every training image (two convolutions
of it: largely invertible, so treat them as the images), the masks, each site's number of
training images and its loss values. Sending the masks (rather than the site computing its
loss from predictions the coordinator returns) is the authors' protocol; it is needed anyway
for the server's AdamW steps, and keeps every coordinator-to-site payload to loss scalars.
What it never sees: ``f_k``'s weights; what a site never receives: a weight or a gradient.

Site state: ``site.state["blackfed_client"]`` (the client net's weights, kept between
rounds; the network site saves it with its private state) and ``site.state["_blackfed_turn"]``
(SPSA's pending perturbations and momentum during a turn; momentum restarts each turn, as in
the authors' code).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from engine.bundle.split import site_split_bundle, split_bundle_from_state
from engine.errors import ConfigError, WeightsError
from engine.fl.blackfed_config import BlackFedConfig
from engine.fl.blackfed_nets import (
    SpsaGc,
    build_client_net,
    build_server_net,
    client_flops_per_image,
    flat_parameters,
    load_flat,
    split_loss,
    weights_of,
)
from engine.fl.blackfed_segment import split_segmenter
from engine.fl.exchange import ExchangeMethod, Reply, Request, RoundDialogue
from engine.fl.local_training import batch_order
from engine.fl.methods import derived_seed

if TYPE_CHECKING:
    from engine.fl.methods import SiteRuntime, WeightSet
    from engine.tasks import TaskSpec

CLIENT_KEY = "blackfed_client"
#: Largest |activation| a client net's reply may hold. The client net is two 3x3 convolutions of images in
#: [0, 1] (:class:`engine.fl.blackfed_nets.ClientNet`): honest values stay orders of magnitude below this,
#: while a reply of 1e30s would overflow the server net's loss without being NaN or Inf on the wire.
MAX_ACTIVATION_ABS = 1e6
TURN_KEY = "_blackfed_turn"


class BlackFed(ExchangeMethod):
    """BlackFed v1 (``variant="v1"``) or v2 (``"v2"``); see the module docstring."""

    name = "blackfed"
    REQUEST_CONTENTS: ClassVar[dict[str, str]] = {
        "losses": "loss values of the site's previous probe (one scalar per perturbed forward pass; no gradient)",
    }
    SHARES_ACTIVATIONS: ClassVar[bool] = True
    REPLY_CONTENTS: ClassVar[dict[str, str]] = {
        "activations": "client-net activations f_k(x) of one training batch (per perturbation in a client step)",
        "masks": "the batch's expert masks (uint8), for the coordinator's loss",
    }

    def __init__(self, task: TaskSpec, site_names: list[str], seed: int = 0, rounds: int = 1,
                 variant: str = "v1", config: BlackFedConfig | None = None) -> None:
        super().__init__(task, site_names, seed, rounds)
        if variant not in ("v1", "v2"):
            raise ConfigError(f"BlackFed variant must be 'v1' or 'v2', got {variant!r}")
        self.variant = variant
        self.name = f"blackfed-{variant}"  # type: ignore[misc]
        self.config = config or BlackFedConfig()

    # --- shared ----------------------------------------------------------------------------
    def _seed(self, *parts: object) -> int:
        # not the variant's name: v1 and v2 train identically and differ only at inference
        return derived_seed(self.seed, "blackfed", *parts)

    def server_net(self, weights: Mapping[str, torch.Tensor] | None = None) -> torch.nn.Module:
        """The server net ``g`` (with ``weights`` loaded when given)."""
        net = build_server_net(self.config.channels, self.task.out_channels)
        if weights is not None:
            net.load_state_dict(dict(weights))
        return net

    def client_net(self, weights: Mapping[str, torch.Tensor] | None = None) -> torch.nn.Module:
        """A client net ``f_k`` (with ``weights`` loaded when given)."""
        net = build_client_net(self.task.in_channels, self.config.channels)
        if weights is not None:
            net.load_state_dict(dict(weights))
        return net

    def steps(self, num_samples: int, epochs: int) -> int:
        """Exchanges of one phase for a site with ``num_samples`` training images."""
        return epochs * math.ceil(num_samples / self.config.batch_size)

    # --- server half -----------------------------------------------------------------------
    def initial_state(self) -> WeightSet:
        torch.manual_seed(self._seed("init", "server"))
        return {"server": weights_of(self.server_net())}

    def dialogue(self, state: WeightSet, rnd: int) -> RoundDialogue:
        new = dict(state)
        g = self.server_net(state["server"])
        for site in self.site_names:
            done = yield from self._turn(g, site, rnd)
            if done and self.variant == "v2":
                new[f"server/{site}"] = weights_of(g)
        new["server"] = weights_of(g)
        return new

    def _ask(self, site: str, request: Request) -> Any:
        answer = yield {site: request}
        reply = answer.get(site)
        return reply if isinstance(reply, Reply) else None

    #: Request action of a client step, and the name of the tensor the coordinator answers it with.
    CLIENT_ACTION: ClassVar[str] = "client_probe"
    FEEDBACK: ClassVar[str] = "losses"

    def _turn(self, g: torch.nn.Module, site: str, rnd: int) -> Any:
        """One site's turn (client phase, then server phase); returns whether it completed."""
        cfg = self.config
        first = self.CLIENT_ACTION if cfg.client_epochs else "server_batch"
        reply = yield from self._ask(site, Request(first, {}, {"round": rnd, "step": 0}))
        if reply is None:
            return False
        n = reply.num_samples
        client_steps, server_steps = self.steps(n, cfg.client_epochs), self.steps(n, cfg.server_epochs)
        feedback: torch.Tensor | None = None
        if cfg.client_epochs:
            feedback = self.client_feedback(g, reply)
            for step in range(1, client_steps):
                reply = yield from self._ask(site, Request(self.CLIENT_ACTION, {self.FEEDBACK: feedback},
                                                           {"round": rnd, "step": step}))
                if reply is None:
                    return False
                feedback = self.client_feedback(g, reply)
        opt = torch.optim.AdamW(g.parameters(), lr=cfg.server_lr)
        for step in range(server_steps):
            if step or cfg.client_epochs:
                carried = {self.FEEDBACK: feedback} if feedback is not None else {}
                feedback = None
                reply = yield from self._ask(site, Request("server_batch", carried, {"round": rnd, "step": step}))
                if reply is None:
                    return False
            self.server_step(g, opt, reply)
        return True

    def client_feedback(self, g: torch.nn.Module, reply: Reply) -> torch.Tensor:
        """What the coordinator answers a client step with: BlackFed, the probe's loss values."""
        return self.probe_losses(g, reply)

    def probe_losses(self, g: torch.nn.Module, reply: Reply) -> torch.Tensor:
        """The loss of ``g`` on each of the ``2P`` perturbed activation batches of a client probe."""
        masks = reply.tensors["masks"].to(torch.float32)
        acts = reply.tensors["activations"]
        b = masks.shape[0]
        g.eval()
        with torch.no_grad():
            out = [float(split_loss(g(acts[i:i + b]), masks)) for i in range(0, acts.shape[0], b)]
        return torch.tensor(out, dtype=torch.float64)

    def server_step(self, g: torch.nn.Module, opt: torch.optim.Optimizer, reply: Reply) -> float:
        """One AdamW step of ``g`` on the activations and masks of ``reply``."""
        g.train()
        opt.zero_grad(set_to_none=True)
        loss = split_loss(g(reply.tensors["activations"]), reply.tensors["masks"].to(torch.float32))
        loss.backward()
        opt.step()
        return float(loss.detach())

    def max_reply_bytes(self) -> int | None:
        """A client step's upload: ``2P x B`` activation maps (float32) and ``B`` masks (uint8)."""
        size = self.config.image_size
        if not size:
            return None
        b, pixels = self.config.batch_size, size * size
        copies = max(self.copies_per_image(self.CLIENT_ACTION), 1)
        return copies * b * self.config.channels * pixels * 4 + b * self.task.out_channels * pixels

    def copies_per_image(self, action: str) -> int:
        """Activation maps per image in a reply to ``action`` (SPSA: ``2P`` probe points)."""
        return 2 * self.config.perturbations if action == self.CLIENT_ACTION else 1

    def validate_reply(self, request: Request, site: str, reply: Reply) -> None:
        super().validate_reply(request, site, reply)
        if request.action == "client_update":
            if reply.tensors:
                raise WeightsError(f"reply of {site} to client_update carries tensors")
            return
        if set(reply.tensors) != {"activations", "masks"}:
            raise WeightsError(f"reply of {site} to {request.action!r} needs activations and masks, "
                               f"got {sorted(reply.tensors)}")
        acts, masks = reply.tensors["activations"], reply.tensors["masks"]
        size = self.config.image_size
        if masks.dtype != torch.uint8 or masks.dim() != 4 or masks.shape[1] != self.task.out_channels:
            raise WeightsError(f"{site}: masks must be uint8 (B, {self.task.out_channels}, H, W), "
                               f"got {masks.dtype} {tuple(masks.shape)}")
        b = masks.shape[0]
        copies = self.copies_per_image(request.action)
        expected = (copies * b, self.config.channels, *masks.shape[2:])
        if acts.dtype != torch.float32 or tuple(acts.shape) != expected:
            raise WeightsError(f"{site}: activations must be float32 {expected}, got {acts.dtype} {tuple(acts.shape)}")
        if not 1 <= b <= self.config.batch_size or (size and tuple(masks.shape[2:]) != (size, size)):
            raise WeightsError(f"{site}: batch of {b} images of {tuple(masks.shape[2:])} px does not fit "
                               f"batch_size {self.config.batch_size} and image_size {size}")
        if bool((masks > 1).any()):
            raise WeightsError(f"{site}: masks must be 0/1")
        largest = float(acts.abs().max()) if acts.numel() else 0.0
        if largest > MAX_ACTIVATION_ABS:
            raise WeightsError(f"{site}: activations up to {largest:.3g} exceed {MAX_ACTIVATION_ABS:g}; a client net "
                               "of this run cannot produce them (modified or broken site software)")
        if reply.num_samples < 1:
            raise WeightsError(f"{site} reports {reply.num_samples} training images")

    # --- site half -------------------------------------------------------------------------
    def answer(self, request: Request, site: SiteRuntime, progress: Any = None, cancel: Any = None) -> Reply:
        rnd, step = int(request.config.get("round", 0)), int(request.config.get("step", 0))
        n = len(site.train.images)
        if n < 1:
            raise ConfigError(f"site {site.name} has no training images")
        net = self.client_net(site.state.get(CLIENT_KEY) or self._initial_client(site.name))
        starts_turn = request.action == self.CLIENT_ACTION and step == 0
        if starts_turn:
            site.state[TURN_KEY] = self.start_turn(net)
        feedback = request.tensors.get(self.FEEDBACK)
        turn = site.state.get(TURN_KEY)
        if feedback is not None:
            if turn is None or not turn.pending:
                raise ConfigError(f"{site.name}: {self.FEEDBACK} arrived without a pending client step")
            self.apply_feedback(turn, net, feedback)
            site.state[CLIENT_KEY] = weights_of(net)
        elif turn is not None and turn.pending and not starts_turn:
            raise ConfigError(f"{site.name}: request {request.action!r} came without the pending step's "
                              f"{self.FEEDBACK}")
        if request.action == "client_update":
            return Reply({}, {}, n)
        if request.action == self.CLIENT_ACTION:
            idx = self._batch(site, rnd, "client", step)
            acts = self.client_activations(turn, net, torch.from_numpy(site.train.images[idx]),
                                           self._seed(rnd, site.name, "spsa", step))
            return Reply({"activations": acts, "masks": self._masks(site, idx)}, {}, n)
        if request.action == "server_batch":
            site.state.pop(TURN_KEY, None)
            idx = self._batch(site, rnd, "server", step)
            with torch.no_grad():
                acts = net(torch.from_numpy(site.train.images[idx]))
            return Reply({"activations": acts.contiguous(), "masks": self._masks(site, idx)}, {}, n)
        raise ConfigError(f"unknown {self.name} request {request.action!r}")

    # the client step at the site (SPSA-GC here; first order in the white-box baseline)
    def start_turn(self, net: torch.nn.Module) -> Any:
        """Per-turn optimiser state of the client net (SPSA-GC's momentum and pending perturbations)."""
        return SpsaGc(flat_parameters(net), self.config.spsa())

    def apply_feedback(self, turn: Any, net: torch.nn.Module, feedback: torch.Tensor) -> None:
        """Finish the pending client step with the coordinator's answer (updates ``net`` in place)."""
        turn.update(feedback)
        load_flat(net, turn.theta)

    def client_activations(self, turn: Any, net: torch.nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
        """Activations a client step uploads: ``f(x)`` at each of SPSA's ``2P`` probe points."""
        gen = torch.Generator().manual_seed(seed % (2**63))
        acts = []
        with torch.no_grad():
            for point in turn.probe_points(gen):
                load_flat(net, point)
                acts.append(net(x))
        load_flat(net, turn.theta)
        return torch.cat(acts)

    def _initial_client(self, site: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(self._seed("init", "client", site))
        return weights_of(self.client_net())

    def _batch(self, site: SiteRuntime, rnd: int, phase: str, step: int) -> np.ndarray:
        epochs = self.config.client_epochs if phase == "client" else self.config.server_epochs
        order = batch_order(len(site.train.images), self.config.batch_size, epochs,
                            self._seed(rnd, site.name, phase))
        if not 0 <= step < len(order):
            raise ConfigError(f"{site.name}: {phase} step {step} outside 0..{len(order) - 1}")
        return order[step]

    @staticmethod
    def _masks(site: SiteRuntime, idx: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((site.train.masks[idx] > 0.5).astype(np.uint8))

    # --- evaluation ------------------------------------------------------------------------
    def server_for(self, state: WeightSet, site: str) -> Mapping[str, torch.Tensor]:
        """The server weights site ``site`` segments with (v2: its own table entry)."""
        if self.variant == "v2" and f"server/{site}" in state:
            return state[f"server/{site}"]
        return state["server"]

    def client_weights(self, site: SiteRuntime) -> dict[str, torch.Tensor]:
        """The site's trained client net (its initial one if it never trained)."""
        return site.state.get(CLIENT_KEY) or self._initial_client(site.name)

    def segmenter(self, state: WeightSet, sites: list[SiteRuntime],
                  device: str = "auto") -> Callable[[int, np.ndarray], np.ndarray]:
        clients = [self.client_weights(s) for s in sites]
        servers = [self.server_for(state, s.name) for s in sites]
        return split_segmenter(self.task, self.config.channels, clients, servers, device)

    # --- the end of a network run: each site's bundle ------------------------------------------
    #: What the coordinator sends each site once, after the last round (the only weights it ever sends).
    FINAL_CONTENTS: ClassVar[dict[str, str]] = {
        "server": "the coordinator's server net g that this site segments with (v2: the copy stored after its "
                  "turn), sent once after the last round so the site can assemble its bundle",
    }

    def final_models(self, state: WeightSet, site: str) -> dict[str, dict[str, torch.Tensor]]:
        """Server half, after the last round: what ``site`` receives to assemble its bundle (its server net)."""
        return {"server": dict(self.server_for(state, site))}

    def site_bundle(self, received: Mapping[str, Mapping[str, torch.Tensor]], site: SiteRuntime, image_size: int,
                    extra: Mapping[str, Any] | None = None) -> Any:
        """Site half: the site's split bundle (its client net with the server net it received).

        ``received`` holds the :attr:`FINAL_CONTENTS` parts (the transport checked their names and that
        they are finite); a server net of another shape raises :class:`WeightsError`.
        """
        server = _fitted(received["server"], self.server_net(), "the server net the coordinator sent")
        client = self.client_weights(site)
        self.client_net(client)  # a client net that does not fit raises here, before anything is written
        return site_split_bundle(self, site.name, client, server, image_size or self.config.image_size,
                                 {"trained_client_net": CLIENT_KEY in site.state, **dict(extra or {})})

    def report_extra(self, state: WeightSet, sites: list[SiteRuntime]) -> dict[str, Any]:
        """Client FLOPs, the settings and the split bundle (the simulation adds local/OOD Dice)."""
        size = self.config.image_size or int(sites[0].train.images.shape[-1])
        clients = {s.name: self.client_weights(s) for s in sites}
        return {
            "variant": self.variant,
            "client_flops_per_image": client_flops_per_image(self.task.in_channels, self.config.channels, size),
            "config": {f.name: getattr(self.config, f.name) for f in fields(self.config)},
            "bundle": split_bundle_from_state(self, state, clients, size),
        }


def _fitted(weights: Mapping[str, torch.Tensor], net: torch.nn.Module, what: str) -> dict[str, torch.Tensor]:
    """``weights`` as a dict once they load strictly into ``net`` (:class:`WeightsError` otherwise)."""
    out = dict(weights)
    try:
        net.load_state_dict(out)
    except RuntimeError as exc:
        raise WeightsError(f"{what} does not fit this run's network ({str(exc).splitlines()[0]})") from None
    return out


def build_blackfed(name: str, task: TaskSpec, site_names: list[str], settings: Mapping[str, Any]) -> BlackFed:
    """Registry factory: ``blackfed-v1`` / ``blackfed-v2`` from a run's settings."""
    variant = name.rsplit("-", 1)[-1]
    return BlackFed(task, site_names, int(settings.get("seed", 0)), int(settings.get("rounds", 1)), variant,
                    BlackFedConfig.from_settings(settings))


__all__ = ["BlackFed", "BlackFedConfig", "build_blackfed"]
