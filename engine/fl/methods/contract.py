"""The contract every federated weight method keeps: a server half and a site half.

A method is split the way Flower splits a Strategy from a ClientApp:

- server half: :meth:`FederatedMethod.initial_state`, :meth:`~FederatedMethod.site_instructions`
  (what each site receives this round) and :meth:`~FederatedMethod.aggregate` (new server
  state from the updates that arrived; a site that did not answer is simply absent);
- site half: :meth:`~FederatedMethod.train_at_site`, run where the data lives.

Payloads are dicts of named weight dicts (``"global"``, ``"personal"``, ``"selector"``, ...),
so a transport only has to move tensors, counts and metrics. Both the in-process simulation
(:mod:`engine.federation.inprocess`) and the network transport call exactly these methods.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.errors import ConfigError
from engine.fl.local_training import (
    LocalTrainingConfig,
    RoundContext,
    scheduled_lr,
)
from engine.fl.weights import Weights, check_compatible, model_weights
from engine.fl.wire_precision import DEFAULT_WIRE_PRECISION, check_wire_precision
from engine.models import build_segmentation_net, build_selector
from engine.tasks import TaskSpec

if TYPE_CHECKING:
    from engine.data.site_data import SplitArrays


#: Server state and payloads: part name -> weight dict.
WeightSet = dict[str, Weights]
#: Payload part of the selector's Adam state (reference scheme).
OPTIM_PART = "selector_optim"

log = logging.getLogger(__name__)



def derived_seed(*parts: object) -> int:
    """Stable 63-bit seed from any parts (same value in every process and Python version)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()
    return int(digest[:15], 16)


@dataclass
class SiteInstructions:
    """What the server sends one site for one round."""

    round: int
    weights: WeightSet
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class SiteUpdate:
    """What one site sends back: weights, its training sample count and metrics. Nothing else."""

    weights: WeightSet
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)


#: ``SiteRuntime.state`` key of the seed of a site's privacy noise, set only where the noise must repeat:
#: ``fedsm simulate`` sets it (one process, no one to hide the noise from) so experiments repeat. A site
#: without one (every network site) draws its noise from the operating system's secure generator
#: (:mod:`engine.fl.secure_noise`): noise added for differential privacy must be unknown to the
#: coordinator, which could otherwise regenerate it and subtract it from what the site released.
NOISE_SEED_KEY = "dp_noise_seed"


def noise_generator(site: SiteRuntime) -> torch.Generator | None:
    """A torch generator seeded with ``site``'s :data:`NOISE_SEED_KEY`; ``None`` (secure noise) without one.

    Never seeded from anything the coordinator sent or can derive: the run's seed is known to it.
    """
    value = site.state.get(NOISE_SEED_KEY)
    if value is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(int(value))
    return generator


@dataclass
class SiteRuntime:
    """A site as its own process sees it: name, index, local data and private state.

    ``validation`` is the site's validation split where a method needs it at the site (early
    stopping, a site's own model selection); ``None`` where the caller has none.
    """

    name: str
    index: int
    train: SplitArrays
    state: dict[str, Any] = field(default_factory=dict)
    validation: SplitArrays | None = None


class FederatedMethod(ABC):
    """Base of every method. Subclasses set :attr:`name` and implement the four halves.

    Parameters
    ----------
    task
        The segmentation task.
    site_names
        Configured sites, in index order (site ``k`` has index ``k``; label ``k`` for the
        selector).
    training
        Local training hyper-parameters.
    seed
        Base seed; every site and round derives its own from it.
    rounds
        Training rounds (methods with extra phases add rounds; see :attr:`total_rounds`).
    """

    name: ClassVar[str]
    #: Payload parts that hold networks or optimizer moments: with ``wire_precision="bfloat16"`` their
    #: float32 tensors travel in 16 bits (:mod:`engine.fl.wire_precision`); every other part as it is.
    WIRE_PARTS: ClassVar[frozenset[str]] = frozenset({"global", "personal", "selector", "shared", OPTIM_PART})
    #: How :attr:`WIRE_PARTS` travel (:data:`engine.fl.wire_precision.WIRE_PRECISIONS`); set by
    #: :meth:`use_wire_precision` from the run's settings, the same at the coordinator and the sites.
    wire_precision: str = DEFAULT_WIRE_PRECISION

    @classmethod
    def from_settings(cls, task: TaskSpec, site_names: list[str], training: LocalTrainingConfig, seed: int,
                      rounds: int, settings: Any) -> FederatedMethod:
        """The method for a run's settings (:class:`engine.simulate.SimulationConfig` or
        :class:`engine.federation.spec.MethodSpec`: the attributes a method reads have the same names in
        both). :func:`engine.catalogue.build_method` calls this; a method with options of its own overrides it.
        """
        return cls(task, site_names, training, seed, rounds)

    def __init__(self, task: TaskSpec, site_names: list[str], training: LocalTrainingConfig,
                 seed: int = 0, rounds: int = 1) -> None:
        if rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {rounds}")
        if len(site_names) < 1:
            raise ConfigError("a federation needs at least one site")
        if len(set(site_names)) != len(site_names):
            raise ConfigError(f"site names must be unique, got {site_names}")
        self.task = task
        self.site_names = list(site_names)
        self.training = training
        self.seed = seed
        self.rounds = rounds

    @property
    def total_rounds(self) -> int:
        """Communication rounds the method runs (training rounds plus any extra phases)."""
        return self.rounds

    def use_wire_precision(self, precision: str) -> FederatedMethod:
        """Send :attr:`WIRE_PARTS` in ``precision`` (``"bfloat16"`` or ``"float32"``); returns ``self``."""
        self.wire_precision = check_wire_precision(precision)
        return self

    def wire_parts(self, rnd: int) -> frozenset[str]:
        """The parts whose float32 tensors travel in 16 bits in round ``rnd`` (none with ``float32``)."""
        return self.WIRE_PARTS if self.wire_precision == "bfloat16" else frozenset()

    # --- helpers ---------------------------------------------------------------------------
    def _initial_segmentation(self) -> Weights:
        torch.manual_seed(derived_seed(self.seed, "init", "segmentation"))
        return model_weights(build_segmentation_net(self.task.in_channels, self.task.out_channels))

    def _initial_selector(self, num_classes: int) -> Weights:
        torch.manual_seed(derived_seed(self.seed, "init", "selector"))
        return model_weights(build_selector(self.task.in_channels, num_classes,  # type: ignore[arg-type]
                                            self.training.selector_head, self.training.selector_width))

    def round_training(self, rnd: int) -> LocalTrainingConfig:
        """:attr:`training` with round ``rnd``'s learning rate (the config's ``lr_schedule``).

        Only the U-Nets' rate follows the schedule; the selector's stays as configured. Both
        halves of a method compute it from the round number, so it needs no message.
        """
        cfg = self.training
        if cfg.lr_schedule == "constant":
            return cfg

        return replace(cfg, lr=scheduled_lr(cfg.lr, cfg.lr_schedule, rnd, self.rounds, cfg.lr_min_ratio))

    def _context(self, rnd: int, site: SiteRuntime, progress: Any, cancel: Any) -> RoundContext:
        return RoundContext(self.name, rnd, site.name, progress, cancel)

    def _site_seed(self, rnd: int, site: SiteRuntime, part: str = "") -> int:
        return derived_seed(self.seed, self.name, rnd, site.name, part)

    def _fedavg_seed(self, rnd: int, site: SiteRuntime) -> int:
        """FedAvg's seed for round ``rnd`` at ``site`` (its :meth:`_site_seed`).

        A method whose global model *is* FedAvg's (FedSM, FedSM-extra) trains it from this seed:
        the same batches in the same order, so with the same data and settings its global model
        equals FedAvg's round for round, and a paired comparison with FedAvg measures only what
        the method adds (personalized models and routing), not a second draw of the shuffles.
        """
        return derived_seed(self.seed, "fedavg", rnd, site.name, "")

    # --- server half -----------------------------------------------------------------------
    @abstractmethod
    def initial_state(self) -> WeightSet:
        """Server state before round 1."""

    @abstractmethod
    def site_instructions(self, state: WeightSet, rnd: int, site: str) -> SiteInstructions:
        """Payload for ``site`` in round ``rnd`` (1-based)."""

    @abstractmethod
    def aggregate(self, state: WeightSet, rnd: int, updates: Mapping[str, SiteUpdate]) -> WeightSet:
        """New server state from the updates of the sites that answered (at least one)."""

    # --- site half -------------------------------------------------------------------------
    @abstractmethod
    def train_at_site(self, instructions: SiteInstructions, site: SiteRuntime,
                      progress: Any = None, cancel: Any = None) -> SiteUpdate:
        """Run the local round and return only weights, the sample count and metrics."""

    # --- shared checks ---------------------------------------------------------------------
    def validate_update(self, state: WeightSet, site: str, update: SiteUpdate) -> None:
        """Reject an update whose parts do not fit the server's models (keys, shapes, dtypes, NaN)."""
        reference = self.expected_update_shapes(state, site)
        if set(update.weights) != set(reference):
            raise ConfigError(
                f"update from {site} has parts {sorted(update.weights)}, expected {sorted(reference)}"
            )
        for part, ref in reference.items():
            check_compatible(ref, update.weights[part], what=f"{part} update from {site}")
        if update.num_samples <= 0:
            raise ConfigError(f"update from {site} reports {update.num_samples} training samples")

    def expected_update_shapes(self, state: WeightSet, site: str) -> WeightSet:
        """Reference weights an update's parts must match (default: the global model)."""
        return {"global": state["global"]}


