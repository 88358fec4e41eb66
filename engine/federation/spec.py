"""What the coordinator tells every site about the run: the method and its hyper-parameters.

:class:`MethodSpec` (the part of ``federation.toml`` that decides the numbers a site computes,
each setting with its hard bounds declared beside it) lives in :mod:`engine.fl.method_spec`, below
the security layer, so that a site checks a signed spec against its bounds without this package;
it is re-exported here. :func:`build_method` builds the method a spec describes through the
catalogue, with the local training of the settings class ``fedsm simulate`` shares
(:class:`engine.fl.method_spec.TrainingSettings`), so a network run and a simulation with the same
settings compute the same weights.

The compute device is not part of the spec: each site chooses its own in ``site.toml``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from engine import catalogue
from engine.fl.method_spec import MethodSpec
from engine.fl.registry import EXCHANGE_METHODS, build_exchange_method
from engine.tasks import get_task


def build_method(spec: MethodSpec, device: str = "auto") -> Any:
    """The :class:`engine.fl.methods.FederatedMethod` of ``spec`` (as ``fedsm simulate`` builds it)."""
    task = get_task(spec.task)
    names = list(spec.site_names)
    if spec.method in EXCHANGE_METHODS:
        settings = {k: v for k, v in asdict(spec).items() if k != "options"} | dict(spec.options) | {"device": device}
        return build_exchange_method(spec.method, task, names, settings)
    training = spec.local_training(spec.method, device)
    return catalogue.build_method(spec.method, task, names, training, spec.seed, spec.rounds, spec)


__all__ = ["MethodSpec", "build_method"]
