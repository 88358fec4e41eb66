"""The averaging family: FedAvg (and Centralized, FedAvg over one pooled site), FedProx, Scaffold, Local."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import ConfigError
from engine.fl.aggregation import fedavg, scaffold_server_update, scaffold_site_control
from engine.fl.local_training import (
    LocalTrainingConfig,
    train_scaffold_round,
    train_segmentation_round,
)
from engine.fl.methods.contract import (
    FederatedMethod,
    SiteInstructions,
    SiteRuntime,
    SiteUpdate,
    WeightSet,
)
from engine.fl.weights import Weights, subtract
from engine.models import build_segmentation_net
from engine.tasks import TaskSpec

if TYPE_CHECKING:
    pass


class FedAvg(FederatedMethod):
    """FedAvg (McMahan et al.): one global model, ``w = sum_k n_k/n w_k``."""

    name = "fedavg"

    def initial_state(self) -> WeightSet:
        return {"global": self._initial_segmentation()}

    def site_instructions(self, state: WeightSet, rnd: int, site: str) -> SiteInstructions:
        return SiteInstructions(rnd, {"global": state["global"]})

    def aggregate(self, state: WeightSet, rnd: int, updates: Mapping[str, SiteUpdate]) -> WeightSet:
        new = dict(state)
        new["global"] = fedavg([(u.weights["global"], u.num_samples) for u in updates.values()])
        return new

    def train_at_site(self, instructions: SiteInstructions, site: SiteRuntime,
                      progress: Any = None, cancel: Any = None) -> SiteUpdate:
        ctx = self._context(instructions.round, site, progress, cancel)
        weights, metrics = train_segmentation_round(
            self.task, instructions.weights["global"], site.train, self.round_training(instructions.round),
            self._site_seed(instructions.round, site), ctx)
        return SiteUpdate({"global": weights}, len(site.train.images), metrics)


class FedProx(FedAvg):
    """FedProx (Li et al.): FedAvg plus ``mu/2 ||w - w_round||^2`` in each site's loss."""

    name = "fedprox"

    def __init__(self, task: TaskSpec, site_names: list[str], training: LocalTrainingConfig,
                 seed: int = 0, rounds: int = 1, mu: float = 0.01) -> None:
        super().__init__(task, site_names, training, seed, rounds)
        if mu < 0:
            raise ConfigError(f"FedProx mu must be >= 0, got {mu}")
        self.mu = mu

    @classmethod
    def from_settings(cls, task: TaskSpec, site_names: list[str], training: LocalTrainingConfig, seed: int,
                      rounds: int, settings: Any) -> FedProx:
        return cls(task, site_names, training, seed, rounds, mu=settings.prox_mu)

    def site_instructions(self, state: WeightSet, rnd: int, site: str) -> SiteInstructions:
        return SiteInstructions(rnd, {"global": state["global"]}, {"prox_mu": self.mu})

    def train_at_site(self, instructions: SiteInstructions, site: SiteRuntime,
                      progress: Any = None, cancel: Any = None) -> SiteUpdate:
        ctx = self._context(instructions.round, site, progress, cancel)
        cfg = replace(self.round_training(instructions.round), prox_mu=float(instructions.config["prox_mu"]))
        received = instructions.weights["global"]
        weights, metrics = train_segmentation_round(
            self.task, received, site.train, cfg, self._site_seed(instructions.round, site), ctx,
            prox_anchor=received)
        return SiteUpdate({"global": weights}, len(site.train.images), metrics)


class Scaffold(FedAvg):
    """Scaffold (Karimireddy et al.): control variates correct each site's drift.

    The server keeps ``c``, each site its own ``c_k`` (site state, never sent as such; the site
    sends the change ``c_k+ - c_k``). Every local gradient gets ``c - c_k`` added before the
    Adam step. The new ``c_k+`` is the mean of the site's uncorrected minibatch gradients over
    the round (option I-like, summed during training at no extra cost), not option II's
    ``(x - y_k)/(steps * lr)``, which assumes plain SGD steps and has the wrong scale with Adam
    (see :func:`engine.fl.aggregation.scaffold_site_control`).
    """

    name = "scaffold"

    def _zero_control(self, weights: Weights) -> Weights:
        params = dict(build_segmentation_net(self.task.in_channels, self.task.out_channels).named_parameters())
        return {k: torch.zeros_like(v) for k, v in weights.items() if k in params}

    def initial_state(self) -> WeightSet:
        weights = self._initial_segmentation()
        return {"global": weights, "control": self._zero_control(weights)}

    def site_instructions(self, state: WeightSet, rnd: int, site: str) -> SiteInstructions:
        return SiteInstructions(rnd, {"global": state["global"], "control": state["control"]})

    def expected_update_shapes(self, state: WeightSet, site: str) -> WeightSet:
        return {"global": state["global"], "control_delta": state["control"]}

    def aggregate(self, state: WeightSet, rnd: int, updates: Mapping[str, SiteUpdate]) -> WeightSet:
        new = super().aggregate(state, rnd, updates)
        new["control"] = scaffold_server_update(
            state["control"], [u.weights["control_delta"] for u in updates.values()], len(self.site_names))
        return new

    def train_at_site(self, instructions: SiteInstructions, site: SiteRuntime,
                      progress: Any = None, cancel: Any = None) -> SiteUpdate:
        ctx = self._context(instructions.round, site, progress, cancel)
        received = instructions.weights["global"]
        server_c = instructions.weights["control"]
        site_c = site.state.get("scaffold_control") or {k: torch.zeros_like(v) for k, v in server_c.items()}
        correction = subtract(server_c, site_c)
        weights, grads, metrics = train_scaffold_round(
            self.task, received, site.train, self.round_training(instructions.round),
            self._site_seed(instructions.round, site), ctx, correction)
        new_c = scaffold_site_control(grads.gradient_sum(), grads.batches, site_c)
        site.state["scaffold_control"] = new_c
        return SiteUpdate({"global": weights, "control_delta": subtract(new_c, site_c)},
                          len(site.train.images), metrics)


class LocalOnly(FederatedMethod):
    """Each site trains alone; nothing is exchanged (baseline). The server keeps no model."""

    name = "local"
    #: the common initialisation a site starts from travels exactly (nothing comes back)
    WIRE_PARTS = frozenset()

    def initial_state(self) -> WeightSet:
        init = self._initial_segmentation()
        return {f"personal/{s}": init for s in self.site_names}

    def site_instructions(self, state: WeightSet, rnd: int, site: str) -> SiteInstructions:
        # round 1 hands out the common initialisation; later rounds continue from the site's own model
        return SiteInstructions(rnd, {"personal": state[f"personal/{site}"]} if rnd == 1 else {})

    def expected_update_shapes(self, state: WeightSet, site: str) -> WeightSet:
        return {}

    def aggregate(self, state: WeightSet, rnd: int, updates: Mapping[str, SiteUpdate]) -> WeightSet:
        return dict(state)

    def train_at_site(self, instructions: SiteInstructions, site: SiteRuntime,
                      progress: Any = None, cancel: Any = None) -> SiteUpdate:
        ctx = self._context(instructions.round, site, progress, cancel)
        start = instructions.weights.get("personal", site.state.get("local_model"))
        weights, metrics = train_segmentation_round(
            self.task, start, site.train, self.round_training(instructions.round),
            self._site_seed(instructions.round, site), ctx)
        site.state["local_model"] = weights
        return SiteUpdate({}, len(site.train.images), metrics)


