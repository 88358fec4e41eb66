"""Methods that talk to sites many times per round: the coordinator drives a dialogue.

:class:`engine.fl.methods.FederatedMethod` covers methods with one message pair per site and
round (FedAvg and its relatives, FedSM). Split learning (BlackFed) and data-free distillation
(FedIOD) need many exchanges inside a round, and an exchange may address only some of the
sites (BlackFed's round robin). An :class:`ExchangeMethod` keeps the same server/site split:

- server half: :meth:`ExchangeMethod.initial_state` and :meth:`ExchangeMethod.dialogue`, a
  generator per round that *yields* the requests of one exchange (``{site: Request}``) and is
  *sent* the answers (``{site: Reply | Failure}``) back; its return value is the new server
  state. Failures arrive as data, never as exceptions (as in Flower's strategies).
- site half: :meth:`ExchangeMethod.answer`, run where the data lives; it may keep private
  state between exchanges and rounds in :attr:`SiteRuntime.state`.

Requests and replies hold flat named tensors plus JSON-able settings or float metrics, so a
transport moves them the way it moves weight dicts. The in-process transport is
:func:`engine.federation.inprocess.run_exchange_rounds`; every reply goes through
:meth:`ExchangeMethod.validate_reply` before the server half sees it.

Each method declares in :attr:`ExchangeMethod.REPLY_CONTENTS` what every tensor a site may
send *is* (for the site's outbound ledger and the docs), and in
:attr:`ExchangeMethod.REQUEST_CONTENTS` what the coordinator may send; transports refuse
anything undeclared in either direction.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from engine.errors import ConfigError, WeightsError
from engine.fl.weights import all_finite

if TYPE_CHECKING:
    import numpy as np

    from engine.fl.methods import SiteRuntime, WeightSet
    from engine.tasks import TaskSpec

@dataclass
class Request:
    """What the coordinator asks one site in one exchange.

    Attributes
    ----------
    action
        What the site should do (method-specific, e.g. ``"client_step"``).
    tensors
        Flat named tensors (each name must be in the method's :attr:`~ExchangeMethod.REQUEST_CONTENTS`).
    config
        JSON-serialisable settings (numbers, strings, booleans, lists of them).
    """

    action: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    """What one site sends back: named tensors, float metrics and a sample count. Nothing else."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    num_samples: int = 0


@dataclass(frozen=True)
class Failure:
    """A site that gave no usable answer to a request, and why (no local detail of the site)."""

    reason: str


#: One round of a method's server half: yields requests, is sent answers, returns the new state.
RoundDialogue = Generator[dict[str, Request], dict[str, "Reply | Failure"], "WeightSet"]


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Raw bytes of ``tensors`` on the wire (before framing)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class ExchangeMethod(ABC):
    """Base of every method whose round is a dialogue of several exchanges.

    Parameters
    ----------
    task
        The segmentation task.
    site_names
        Configured sites, in index order.
    seed
        Base seed; every site, round and exchange derives its own from it.
    rounds
        Rounds the method runs (see :attr:`total_rounds`).
    """

    name: ClassVar[str]
    #: Tensor names a site may send, each with what it is (shown in the outbound ledger).
    REPLY_CONTENTS: ClassVar[dict[str, str]] = {}
    #: Tensor names the coordinator may send, each with what it is.
    REQUEST_CONTENTS: ClassVar[dict[str, str]] = {}
    #: Whether replies carry data derived from the site's images (activations, masks) rather than
    #: weights or statistics; a network site answers such a method only if its operator agreed.
    SHARES_ACTIVATIONS: ClassVar[bool] = False

    def __init__(self, task: TaskSpec, site_names: list[str], seed: int = 0, rounds: int = 1) -> None:
        if rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {rounds}")
        if not site_names:
            raise ConfigError("a federation needs at least one site")
        if len(set(site_names)) != len(site_names):
            raise ConfigError(f"site names must be unique, got {site_names}")
        self.task = task
        self.site_names = list(site_names)
        self.seed = seed
        self.rounds = rounds

    @property
    def total_rounds(self) -> int:
        """Rounds the method runs (checkpoints are taken between rounds)."""
        return self.rounds

    # --- server half -----------------------------------------------------------------------
    @abstractmethod
    def initial_state(self) -> WeightSet:
        """Server state before round 1 (named weight dicts, checkpointed between rounds)."""

    @abstractmethod
    def dialogue(self, state: WeightSet, rnd: int) -> RoundDialogue:
        """Round ``rnd`` (1-based): yield ``{site: Request}``, receive ``{site: Reply | Failure}``, return the state."""

    # --- site half -------------------------------------------------------------------------
    @abstractmethod
    def answer(self, request: Request, site: SiteRuntime, progress: Any = None, cancel: Any = None) -> Reply:
        """Answer one request with the site's data and private state (``site.state``)."""

    # --- checks ----------------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Refuse a request that carries a tensor the method does not declare (site side, before use)."""
        _check_names(request.tensors, self.REQUEST_CONTENTS, f"request {request.action!r}")

    def validate_reply(self, request: Request, site: str, reply: Reply) -> None:
        """Refuse a reply with undeclared tensors, NaN/Inf in a tensor or a metric (server side, before the
        dialogue sees it). An honest site leaves a non-finite metric out of its reply.

        Methods extend this with the shapes they expect for ``request``.
        """
        _check_names(reply.tensors, self.REPLY_CONTENTS, f"reply of {site} to {request.action!r}")
        for name, tensor in reply.tensors.items():
            if tensor.dtype.is_floating_point and not all_finite(tensor):
                raise WeightsError(f"reply of {site} to {request.action!r}: {name} contains NaN or Inf")
        for key, value in reply.metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise WeightsError(f"reply of {site} to {request.action!r}: metric {key!r} is {value!r}, not a "
                                   "finite number; the site's software may be modified or broken")
        if reply.num_samples < 0:
            raise WeightsError(f"reply of {site} reports {reply.num_samples} samples")

    def max_reply_bytes(self) -> int | None:
        """Raw tensor bytes of the largest reply a site may send (``None``: not known in advance).

        The network transport sizes the coordinator's upload limit from it.
        """
        return None

    # --- evaluation (simulation and benchmarks) ---------------------------------------------
    @abstractmethod
    def segmenter(self, state: WeightSet, sites: list[SiteRuntime],
                  device: str = "auto") -> Callable[[int, np.ndarray], np.ndarray]:
        """``predict(site_index, images) -> masks`` of the trained method, as each site would use it."""


def _check_names(tensors: Mapping[str, torch.Tensor], declared: Mapping[str, str], what: str) -> None:
    undeclared = sorted(set(tensors) - set(declared))
    if undeclared:
        raise WeightsError(f"{what} carries undeclared tensors {undeclared[:5]}; "
                           f"allowed: {sorted(declared)}")
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise WeightsError(f"{what}: {name} is not a tensor")


__all__ = ["ExchangeMethod", "Failure", "Reply", "Request", "RoundDialogue", "tensor_bytes"]
