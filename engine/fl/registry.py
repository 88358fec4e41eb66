"""Where the dialogue methods (:mod:`engine.fl.exchange`) are found by name.

``fedsm simulate``, ``fedsm bench`` and the network federation build a dialogue method from its
name and the run's settings (a flat mapping: :class:`engine.simulate.SimulationConfig` as a dict,
or the network's :class:`engine.federation.spec.MethodSpec`). Each entry names a factory
``module:function`` with the signature::

    factory(name: str, task: TaskSpec, site_names: list[str], settings: Mapping[str, Any]) -> ExchangeMethod

imported only when that method is used, so listing the methods stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.fl.exchange import ExchangeMethod
    from engine.tasks import TaskSpec

#: Dialogue method name -> ``"module:factory"``.
EXCHANGE_METHODS: dict[str, str] = {
    "blackfed-v1": "engine.fl.blackfed:build_blackfed",
    "blackfed-v2": "engine.fl.blackfed:build_blackfed",
    "split-whitebox": "engine.fl.split_whitebox:build_split_whitebox",
}

#: Dialogue methods that send activations of a site's images (split learning): a network site
#: runs them only with ``[site] share_activations = true`` (docs/federation.md §10).
SPLIT_LEARNING_METHODS: tuple[str, ...] = ("blackfed-v1", "blackfed-v2", "split-whitebox")


def build_exchange_method(name: str, task: TaskSpec, site_names: list[str],
                          settings: Mapping[str, Any]) -> ExchangeMethod:
    """The dialogue method ``name`` for ``site_names``, configured from ``settings``."""
    target = EXCHANGE_METHODS.get(name)
    if target is None:
        raise ConfigError(f"{name!r} is not a dialogue method; known: {', '.join(sorted(EXCHANGE_METHODS)) or 'none'}")
    module_name, _, function = target.partition(":")
    factory = getattr(importlib.import_module(module_name), function)
    return factory(name, task, list(site_names), settings)
