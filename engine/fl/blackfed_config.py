"""BlackFed's settings and their hard bounds, without torch (the method is :mod:`engine.fl.blackfed`).

A network run's BlackFed settings are options of the signed run spec (``blackfed_<field>``;
split-whitebox reads the same ones as ``split_<field>``): each field of :class:`BlackFedConfig`
declares its bounds beside it (:func:`engine.fl.setting_bounds.bounded`), and :data:`OPTIONS` /
:data:`TOTALS` are what :mod:`engine.fl.registry` hands a site that checks a signed run before it
pulls any payload. ``site.toml`` ``[bounds]`` tightens them (``max_blackfed_perturbations``;
``max_epochs`` bounds both phases' epochs, ``max_lr`` the client's SPSA step size).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from engine.errors import ConfigError
from engine.fl.setting_bounds import Total, bounded, bounds_of, integer, number

#: Channels of the client net's output (FedSM's first U-Net level; the paper's 64).
DEFAULT_SPLIT_CHANNELS = 16


@dataclass(frozen=True)
class SpsaSettings:
    """SPSA-GC hyper-parameters.

    Attributes
    ----------
    lr
        Step size ``a``.
    c
        Perturbation size: the losses are taken at ``theta +- c * delta``.
    perturbations
        Independent perturbations averaged per step (the authors' ``sp_avg``).
    momentum
        ``beta`` of the gradient correction (0 = plain SPSA).
    """

    lr: float = 0.01
    c: float = 0.01
    perturbations: int = 5
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.c <= 0:
            raise ConfigError(f"SPSA lr and c must be > 0, got lr={self.lr}, c={self.c}")
        if self.perturbations < 1:
            raise ConfigError(f"SPSA needs >= 1 perturbation per step, got {self.perturbations}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"SPSA momentum must lie in [0, 1), got {self.momentum}")


@dataclass(frozen=True)
class BlackFedConfig:
    """BlackFed's hyper-parameters (CPU preset; the paper's values in brackets), each with its hard bounds.

    Attributes
    ----------
    channels
        ``C``, channels of the client net's output [64; here FedSM's first U-Net level].
    client_epochs, server_epochs
        ``c_e``, ``s_e``: passes over the site's training batches per turn [10, 10].
    batch_size
        Images per exchange [8].
    server_lr
        AdamW step size of ``g`` [paper text 1e-4; authors' code 1e-3].
    client_lr, spsa_c, perturbations, momentum
        SPSA-GC: step size, perturbation size, perturbations averaged per step, ``beta``
        [authors' code: 0.01, 0.01, 5, 0.9].
    image_size
        Side of the images (checked on every reply; 0 = not checked).
    """

    channels: int = bounded(DEFAULT_SPLIT_CHANNELS, integer(1, 256, help="channels of the client net's output"))
    client_epochs: int = bounded(2, integer(0, 1000, limited_by=("max_epochs",),
                                            help="SPSA passes over the site's batches per turn"))
    server_epochs: int = bounded(2, integer(1, 1000, limited_by=("max_epochs",),
                                            help="passes that train the coordinator's net per turn"))
    batch_size: int = bounded(8, integer(1, 4096, limited_by=("max_batch_size", "min_batch_size"),
                                         help="images per exchange"))
    server_lr: float = bounded(1e-3, number(0.0, 1.0, low_open=True, help="the coordinator's AdamW step size"))
    client_lr: float = bounded(0.01, number(0.0, 1.0, low_open=True, limited_by=("max_lr",),
                                            help="the site's SPSA step size"))
    spsa_c: float = bounded(0.01, number(0.0, 1.0, low_open=True, help="SPSA's perturbation size"))
    perturbations: int = bounded(5, integer(1, 100, help="SPSA perturbations averaged per step"))
    momentum: float = bounded(0.9, number(0.0, 1.0, high_open=True, help="SPSA-GC's gradient correction"))
    image_size: int = bounded(0, integer(0, 4096, limited_by=("max_image_size",),
                                         help="image side checked on replies (0: not checked)"))

    def __post_init__(self) -> None:
        broken = [p for name, bound in OPTIONS.items() if (p := bound.problem(name, getattr(self, name)))]
        if broken:
            raise ConfigError("BlackFed: " + "; ".join(broken))

    def spsa(self) -> SpsaSettings:
        """The client's SPSA-GC settings."""
        return SpsaSettings(self.client_lr, self.spsa_c, self.perturbations, self.momentum)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> BlackFedConfig:
        """From a run's flat settings: ``blackfed_<field>`` keys, else ``batch_size``/``image_size``/``lr``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = f"blackfed_{f.name}"
            if settings.get(key) is not None:
                values[f.name] = settings[key]
        for name, key in (("batch_size", "batch_size"), ("image_size", "image_size"), ("server_lr", "lr")):
            if name not in values and settings.get(key) is not None:
                values[name] = settings[key]
        return cls(**values)


#: The options a coordinator may sign for BlackFed (and split-whitebox), by field name.
OPTIONS = bounds_of(BlackFedConfig)


def _client_passes(options: Mapping[str, Any]) -> float:
    epochs = options.get("client_epochs", BlackFedConfig.client_epochs)
    perturbations = options.get("perturbations", BlackFedConfig.perturbations)
    return int(epochs) * 2 * int(perturbations)


#: What a site's client phase costs per batch: a forward pass per perturbation sign, per epoch.
TOTALS = (
    Total("client passes per batch", "client_epochs x 2 x perturbations", _client_passes, 2000,
          "max_client_passes"),
)

__all__ = ["DEFAULT_SPLIT_CHANNELS", "OPTIONS", "TOTALS", "BlackFedConfig", "SpsaSettings"]
