"""Where the dialogue methods (:mod:`engine.fl.exchange`) are found by name.

``fedsm simulate``, ``fedsm bench`` and the network federation build a dialogue method from its
name and the run's settings (a flat mapping: :class:`engine.simulate.SimulationConfig` as a dict,
or the network's :class:`engine.federation.spec.MethodSpec`). Each entry names a factory
``module:function`` with the signature::

    factory(name: str, task: TaskSpec, site_names: list[str], settings: Mapping[str, Any]) -> ExchangeMethod

imported only when that method is used, so listing the methods stays cheap.

A dialogue method's options (``federation.toml`` ``[training]`` keys ``<family>_<name>``, e.g.
``blackfed_client_epochs``) are declared, with their hard bounds, where the method declares its
settings; :data:`EXCHANGE_OPTIONS` says where, for each option family. Those modules import no
torch: a site checks a signed run's options before it pulls any payload.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError
from engine.fl.setting_bounds import Total

if TYPE_CHECKING:
    from engine.fl.exchange import ExchangeMethod
    from engine.fl.setting_bounds import Bound, Total
    from engine.tasks import TaskSpec

#: Dialogue method name -> ``"module:factory"``.
EXCHANGE_METHODS: dict[str, str] = {
    "blackfed-v1": "engine.fl.blackfed:build_blackfed",
    "blackfed-v2": "engine.fl.blackfed:build_blackfed",
    "split-whitebox": "engine.fl.split_whitebox:build_split_whitebox",
    "fediod": "engine.fl.fediod:build_fediod",
}

#: Dialogue methods that send activations of a site's images (split learning): a network site
#: runs them only with ``[site] share_activations = true`` (docs/federation.md §10).
SPLIT_LEARNING_METHODS: tuple[str, ...] = ("blackfed-v1", "blackfed-v2", "split-whitebox")


#: Option family (a method name's first part) -> ``"module:attribute"`` of its options' declarations,
#: an object with ``OPTIONS`` (name -> :class:`engine.fl.setting_bounds.Bound`) and ``TOTALS``
#: (:class:`engine.fl.setting_bounds.Total` over the unprefixed names). split-whitebox reads BlackFed's
#: settings (``split_<name>``).
EXCHANGE_OPTIONS: dict[str, str] = {
    "blackfed": "engine.fl.blackfed_config",
    "split": "engine.fl.blackfed_config",
    "fediod": "engine.fl.fediod_config",
}


def option_family(method: str) -> str:
    """The prefix of ``method``'s options: ``blackfed`` for ``blackfed-v2``, ``split`` for ``split-whitebox``."""
    return method.split("-")[0]


def _declarations(family: str) -> Any:
    target = EXCHANGE_OPTIONS.get(family)
    return None if target is None else importlib.import_module(target)


def option_bounds(method: str) -> dict[str, Bound]:
    """The options ``method`` may be given, by their ``[training]`` key, with their bounds (none for weight methods)."""
    family = option_family(method)
    module = _declarations(family) if method in EXCHANGE_METHODS else None
    return {} if module is None else {f"{family}_{name}": bound for name, bound in module.OPTIONS.items()}


def option_totals(method: str) -> list[Total]:
    """Limits on ``method``'s options taken together; each reads the options by their ``[training]`` keys."""
    family = option_family(method)
    module = _declarations(family) if method in EXCHANGE_METHODS else None
    if module is None:
        return []
    prefix = family + "_"

    def scoped(total: Total) -> Total:
        def value(options: Mapping[str, Any]) -> float | None:
            return total.value({k[len(prefix):]: v for k, v in options.items() if k.startswith(prefix)})

        return Total(f"{family} {total.name}", total.formula, value, total.high,
                     f"max_{family}_{total.site_key.removeprefix('max_')}")

    return [scoped(t) for t in module.TOTALS]


def all_option_bounds() -> dict[str, Bound]:
    """Every dialogue option of every method, by its ``[training]`` key."""
    out: dict[str, Bound] = {}
    for method in EXCHANGE_METHODS:
        out.update(option_bounds(method))
    return out


def all_option_totals() -> list[Total]:
    """:func:`option_totals` of every option family (once each)."""
    seen: dict[str, Total] = {}
    for method in EXCHANGE_METHODS:
        for total in option_totals(method):
            seen.setdefault(total.site_key, total)
    return list(seen.values())


def build_exchange_method(name: str, task: TaskSpec, site_names: list[str],
                          settings: Mapping[str, Any]) -> ExchangeMethod:
    """The dialogue method ``name`` for ``site_names``, configured from ``settings``."""
    target = EXCHANGE_METHODS.get(name)
    if target is None:
        raise ConfigError(f"{name!r} is not a dialogue method; known: {', '.join(sorted(EXCHANGE_METHODS)) or 'none'}")
    module_name, _, function = target.partition(":")
    factory = getattr(importlib.import_module(module_name), function)
    return factory(name, task, list(site_names), settings)
