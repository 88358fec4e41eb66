"""The weight methods' catalogue: the one place a federated weight method is named.

Each :class:`WeightMethod` entry says how to build the method (its class, which reads its own
options from the run's settings in ``from_settings``), its title, how its bundle routes, whether
robust aggregation may replace its plain mean, whether it runs over the network, and what the
benchmark compares it with. The simulation and the network spec build methods through
:func:`build_method`; the CLI help, the bundle's method check, robust aggregation, the report and
the benchmark read the entries. Adding a method is its class plus one :func:`register` call.

A method can also come from outside the product, as a plugin: an installed distribution whose
``fedsm.methods`` entry point names a :class:`WeightMethod` (``name = "module:ENTRY"``) is
registered when this module is imported, in every process (``fedsm simulate``, ``fedsm server``,
``fedsm site``). Both ends of a federation need the plugin installed; a site without it refuses
the run as an unknown method. The entry's module should stay light (the entry only names its
class by ``factory``), since every command imports it.

Importing this module costs no torch (the SuperNode checks a run's method against its site's
``[bounds]`` with it); :func:`build_method` imports the method's module when it builds one.
Dialogue methods (BlackFed, FedIOD: messages other than weights) have their own registry,
:mod:`engine.fl.registry`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from engine.errors import ConfigError

log = logging.getLogger(__name__)

#: Entry-point group of weight methods from other distributions (plugins).
PLUGIN_GROUP = "fedsm.methods"

#: Bundle routings: a gamma threshold over K sites, an argmax over K+1 models, a single model.
ROUTINGS = ("gamma", "argmax", "none")


@dataclass(frozen=True)
class WeightMethod:
    """One federated weight method.

    Attributes
    ----------
    name
        What ``--methods``, federation.toml and the bundle call it.
    title
        How tables and reports name it.
    factory
        ``"module:Class"``: a :class:`engine.fl.methods.FederatedMethod` subclass (``from_settings``).
    routing
        Its bundle's routing (:data:`ROUTINGS`), or ``None`` when it writes no bundle (Local: one
        model per site, none shared).
    mean_aggregation
        Its ``global`` (and selector) parts are a plain weighted mean of the sites' parts, which
        ``aggregation = "median"`` / ``"trimmed_mean"`` may replace (:mod:`engine.fl.robust`).
    network
        It runs over the network federation (``fedsm server``); else simulation only.
    pooled
        It trains on the pooled data of every site (Centralized: the upper bound, simulation only).
    per_batch_selector
        It keeps the per-batch selector and its small default learning rate (FedSM-extra).
    paper_dice
        Client-average Dice the FedSM paper reports for it, per task (Table 3), for the benchmark.
    compared_with
        Methods the benchmark reports its paired Dice difference against.
    """

    name: str
    title: str
    factory: str
    routing: str | None = "none"
    mean_aggregation: bool = False
    network: bool = True
    pooled: bool = False
    per_batch_selector: bool = False
    paper_dice: Mapping[str, float] = field(default_factory=dict)
    compared_with: tuple[str, ...] = ()


_CATALOGUE: dict[str, WeightMethod] = {}
#: Plugins that could not be loaded: entry point -> why (named when their method is asked for).
_PLUGIN_ERRORS: dict[str, str] = {}


def register(entry: WeightMethod) -> WeightMethod:
    """Add ``entry``; :class:`ConfigError` if its name is taken or its routing unknown."""
    if entry.name in _CATALOGUE:
        raise ConfigError(f"a weight method named {entry.name!r} is already registered")
    if entry.routing is not None and entry.routing not in ROUTINGS:
        raise ConfigError(f"method {entry.name!r}: routing must be one of {ROUTINGS} or None, got {entry.routing!r}")
    if ":" not in entry.factory:
        raise ConfigError(f"method {entry.name!r}: factory must be 'module:Class', got {entry.factory!r}")
    _CATALOGUE[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a method registered by a test (the product's own entries stay)."""
    _CATALOGUE.pop(name, None)


def method(name: str) -> WeightMethod:
    """The entry of ``name``; :class:`ConfigError` naming the known ones otherwise."""
    try:
        return _CATALOGUE[name]
    except KeyError:
        broken = "".join(f"; plugin {ep} could not be loaded: {why}" for ep, why in _PLUGIN_ERRORS.items())
        raise ConfigError(f"unknown method {name!r}; choose from {', '.join(_CATALOGUE)}{broken}") from None


def load_plugins() -> tuple[str, ...]:
    """Register the weight methods of installed plugins (:data:`PLUGIN_GROUP`); return their names.

    An entry already registered under the same name by the same plugin is kept (calling this again
    is harmless). A plugin that fails to import, names something other than a :class:`WeightMethod`
    or takes a name already taken is skipped with a warning, and named in the error of
    :func:`method` for an unknown method; the product's own methods always load.
    """
    added = []
    _PLUGIN_ERRORS.clear()  # the errors of this scan: a plugin since removed is no longer reported
    for ep in entry_points(group=PLUGIN_GROUP):
        where = f"{ep.name} = {ep.value}"
        try:
            entry = ep.load()
            if not isinstance(entry, WeightMethod):
                raise ConfigError(f"it names a {type(entry).__name__}, not an engine.catalogue.WeightMethod")
            if _CATALOGUE.get(entry.name) == entry:
                continue
            register(entry)
        except Exception as exc:  # a broken plugin must not take the product's own methods with it
            _PLUGIN_ERRORS[where] = str(exc) or type(exc).__name__
            log.warning("weight-method plugin %s not loaded: %s", where, _PLUGIN_ERRORS[where])
            continue
        added.append(entry.name)
    return tuple(added)


def method_names() -> tuple[str, ...]:
    """Every weight method, in the order reports list them."""
    return tuple(_CATALOGUE)


def federation_methods() -> tuple[str, ...]:
    """Weight methods a network federation can run."""
    return tuple(n for n, e in _CATALOGUE.items() if e.network)


def bundle_routing(name: str) -> str | None:
    """How ``name``'s bundle routes (``None``: it writes none)."""
    return method(name).routing


def single_model_methods() -> tuple[str, ...]:
    """Weight methods whose result is one global model (a single-model bundle)."""
    return tuple(n for n, e in _CATALOGUE.items() if e.routing == "none")


def mean_aggregation_methods() -> frozenset[str]:
    """Methods whose ``global`` part robust aggregation may take as a median or trimmed mean."""
    return frozenset(n for n, e in _CATALOGUE.items() if e.mean_aggregation)


def build_method(name: str, task: Any, site_names: list[str], training: Any, seed: int, rounds: int,
                 settings: Any) -> Any:
    """Build ``name`` for a run: its class's ``from_settings`` with the run's settings.

    ``training`` is the run's :class:`engine.fl.local_training.LocalTrainingConfig`, made by the
    caller with :meth:`engine.fl.method_spec.TrainingSettings.local_training` (which reads the entry's
    :attr:`WeightMethod.per_batch_selector`); ``settings`` is the run's ``TrainingSettings`` (a
    simulation's config or a network run's spec), from which the class reads its own options.
    """
    entry = method(name)
    module, _, attr = entry.factory.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    # how its weights travel is a run setting of every weight method, the same at both ends
    return cls.from_settings(task, site_names, training, seed, rounds, settings).use_wire_precision(
        settings.wire_precision)


#: SoftPull lam per task when none is given (the paper's best values).
DEFAULT_LAM = {"fundus": 0.7, "prostate": 0.3}


def extra_rounds_default(rounds: int) -> int:
    """FedSM-extra's selector rounds when none are given: half the training rounds, rounded up (paper: 100 + 50)."""
    return max(1, -(-int(rounds) // 2))


# The product's methods, in the order reports list them. Paper figures: Xu et al., CVPR 2022, Table 3.
register(WeightMethod("centralized", "Centralized", "engine.fl.methods.averaging:FedAvg", network=False, pooled=True,
                      paper_dice={"fundus": 0.8898, "prostate": 0.8737}))
register(WeightMethod("local", "Local", "engine.fl.methods.averaging:LocalOnly", routing=None))
register(WeightMethod("fedavg", "FedAvg", "engine.fl.methods.averaging:FedAvg", mean_aggregation=True,
                      paper_dice={"fundus": 0.8710, "prostate": 0.8684}, compared_with=("centralized",)))
register(WeightMethod("fedprox", "FedProx", "engine.fl.methods.averaging:FedProx", mean_aggregation=True,
                      paper_dice={"fundus": 0.8434}, compared_with=("fedavg",)))
register(WeightMethod("scaffold", "Scaffold", "engine.fl.methods.averaging:Scaffold",
                      paper_dice={"fundus": 0.8141}, compared_with=("fedavg",)))
register(WeightMethod("fedsm", "FedSM", "engine.fl.methods.fedsm:FedSM", routing="gamma", mean_aggregation=True,
                      paper_dice={"fundus": 0.8914, "prostate": 0.8763},
                      compared_with=("fedavg", "centralized", "local")))
register(WeightMethod("fedsm-extra", "FedSM-extra", "engine.fl.methods.fedsm:FedSMExtra", routing="argmax",
                      mean_aggregation=True, per_batch_selector=True, paper_dice={"fundus": 0.8905},
                      compared_with=("fedsm", "fedavg")))

# methods of installed plugins come after the product's own
load_plugins()
