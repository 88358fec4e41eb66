"""What the coordinator tells every site about the run: the method and its hyper-parameters.

A :class:`MethodSpec` is the part of ``federation.toml`` that decides the numbers a site
computes. The coordinator sends it (as JSON) in every instruction, and each site builds the
same :class:`engine.fl.methods.FederatedMethod` from it with :func:`build_method`, so both
halves of a method agree on site order, seeds and hyper-parameters. The defaults and the
construction mirror ``fedsm simulate`` (:class:`engine.simulate.SimulationConfig`), so a
network run and a simulation with the same settings compute the same weights.

The compute device is not part of it: each site chooses its own in ``site.toml``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from engine import catalogue
from engine.bundle import check_site_name
from engine.bundle.supermodel import SELECTOR_WIDTHS
from engine.catalogue import DEFAULT_LAM, extra_rounds_default, federation_methods
from engine.data.disc_crop import check_mode
from engine.errors import ConfigError
from engine.fl.registry import EXCHANGE_METHODS, build_exchange_method
from engine.fl.selector_schemes import check_calibration, default_selector_lr
from engine.tasks import get_task


@dataclass(frozen=True)
class MethodSpec:
    """Method, sites and hyper-parameters of one federated run (see ``docs/federation.md``)."""

    method: str
    task: str
    site_names: tuple[str, ...]
    rounds: int = 3
    seed: int = 0
    image_size: int = 256
    lam: float | None = None
    #: a number, or ``"auto"``: chosen in the last round from the sites' validation histograms
    gamma: float | str = 0.6
    gamma_pass: float = 0.95
    prox_mu: float = 0.01
    extra_rounds: int | None = None
    epochs: int = 1
    batch_size: int = 8
    lr: float = 1e-3
    selector_lr: float | None = None
    selector_size: int = 32
    selector_head: str = "gap"
    selector_width: int = 64
    lr_schedule: str = "constant"
    lr_min_ratio: float = 0.01
    loss: str = "dice"
    selector_calibration: str = "none"
    selector_warmup: int = 0
    selector_epochs: int = 1
    selector_bn: str = "batch"
    routing_guard: bool = True
    #: FedSM's site-style gate: the quantile of the sites' validation distances it lets through, or
    #: ``"off"`` / ``false`` (engine.fl.style_gate)
    style_gate: float | None = 0.95
    #: How FedSM's bundle picks an image's site: ``"auto"`` (the better of the two below on the sites'
    #: validation images; engine.fl.routing_choice), ``"selector"`` (the paper's selector and gamma)
    #: or ``"style"`` (the style gate's nearest site; engine.fl.style_gate.route_by_style)
    site_routing: str = "auto"
    #: ``"auto"``: sites crop full fundus photos around the optic disc (engine.data.disc_crop).
    fundus_crop: str = "none"
    #: How FedSM trains its personalized models: ``"softpull"`` (the paper's), ``"finetune"``,
    #: ``"apfl"``, ``"perfedavg"`` or ``"pfedme"`` (engine.fl.personalization)
    personalization: str = "softpull"
    #: How networks and optimizer moments travel (:mod:`engine.fl.wire_precision`): ``"bfloat16"`` or ``"float32"``
    wire_precision: str = "bfloat16"
    #: Settings of a dialogue method, keyed ``<family>_<name>`` (``blackfed_client_epochs``); in
    #: ``[training]`` they are written as top-level keys with that prefix.
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        get_task(self.task)

        if self.method not in federation_methods() and self.method not in EXCHANGE_METHODS:
            raise ConfigError(f"method {self.method!r} cannot run over the network; choose one of "
                              f"{', '.join([*federation_methods(), *EXCHANGE_METHODS])}")
        names = tuple(self.site_names)
        for name in names:
            check_site_name(name)
        if len(set(names)) != len(names):
            raise ConfigError(f"site names must be unique, got {list(names)}")
        if not names:
            raise ConfigError("a federation needs at least one site; list them in [federation] sites")
        object.__setattr__(self, "site_names", names)
        for name in ("rounds", "epochs", "batch_size", "image_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

        check_calibration(self.selector_calibration)
        from engine.fl.selector_gamma import check_pass_fraction, parse_gamma

        object.__setattr__(self, "gamma", parse_gamma(self.gamma))
        object.__setattr__(self, "gamma_pass", check_pass_fraction(self.gamma_pass))
        from engine.fl.style_gate import parse_style_gate

        object.__setattr__(self, "style_gate", parse_style_gate(self.style_gate))
        from engine.fl.style_gate import check_site_routing

        check_site_routing(self.site_routing, self.style_gate)

        check_mode(self.fundus_crop)
        from engine.fl.personalization import check_personalization

        check_personalization(self.personalization)
        from engine.fl.wire_precision import check_wire_precision

        check_wire_precision(self.wire_precision)
        if self.personalization != "softpull" and self.method != "fedsm":
            raise ConfigError(f"personalization = {self.personalization!r} is a FedSM setting; use method = "
                              f"\"fedsm\" or drop it (method {self.method!r} trains no personalized models that way)")
        if not isinstance(self.routing_guard, bool):
            raise ConfigError(f"routing_guard must be true or false, got {self.routing_guard!r}")
        if self.selector_head not in ("gap", "classic"):
            raise ConfigError(f"selector_head must be 'gap' or 'classic', got {self.selector_head!r}")
        if isinstance(self.selector_width, bool) or self.selector_width not in SELECTOR_WIDTHS:
            raise ConfigError(f"selector_width must be one of {SELECTOR_WIDTHS} (the paper's VGG-11 is 64), "
                              f"got {self.selector_width!r}")
        # the same defaults as `fedsm simulate`: the paper's lam, raised to 1/K for few sites
        if self.lam is None:
            object.__setattr__(self, "lam", max(DEFAULT_LAM[self.task], 1.0 / len(names)))
        if self.extra_rounds is None:
            object.__setattr__(self, "extra_rounds", extra_rounds_default(self.rounds))
        if self.method in ("fedsm", "fedsm-extra"):
            from engine.fl.aggregation import check_lam

            check_lam(float(self.lam), len(names))  # type: ignore[arg-type]

    def to_json(self) -> str:
        """Compact JSON (sorted keys): sent to the sites, stored in checkpoints."""
        data = asdict(self)
        data["site_names"] = list(self.site_names)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> MethodSpec:
        """Parse :meth:`to_json` output; unknown or missing keys raise :class:`ConfigError`."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"method description is not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError("method description must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MethodSpec:
        known = {f.name for f in fields(cls)}
        family = str(raw.get("method", "")).split("-")[0] + "_"
        options = {k: raw[k] for k in raw if k.startswith(family) and k not in known}
        raw = {k: v for k, v in raw.items() if k not in options}
        if options:
            raw["options"] = {**dict(raw.get("options") or {}), **options}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown training setting(s) {unknown}; known: {sorted(known)}")
        try:
            return cls(**{**raw, "site_names": tuple(raw.get("site_names", ()))})
        except TypeError as exc:
            raise ConfigError(f"incomplete training settings: {exc}") from None

    def differences(self, other: MethodSpec) -> list[str]:
        """Names of the settings in which ``other`` differs from this spec."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    @property
    def total_rounds(self) -> int:
        """Communication rounds the method runs (FedSM adds a calibration round, FedSM-extra more)."""
        if self.method == "fedsm":
            return int(self.selector_warmup) + self.rounds + 1
        if self.method == "fedsm-extra":
            return self.rounds + int(self.extra_rounds or 0) + 1
        return self.rounds

    def with_sites(self, names: tuple[str, ...]) -> MethodSpec:
        return replace(self, site_names=names)


def build_method(spec: MethodSpec, device: str = "auto") -> Any:
    """The :class:`engine.fl.methods.FederatedMethod` of ``spec`` (as ``fedsm simulate`` builds it)."""
    from engine.fl.local_training import LocalTrainingConfig

    task = get_task(spec.task)
    names = list(spec.site_names)
    if spec.method in EXCHANGE_METHODS:
        settings = {k: v for k, v in asdict(spec).items() if k != "options"} | dict(spec.options) | {"device": device}
        return build_exchange_method(spec.method, task, names, settings)
    # FedSM-extra keeps the per-batch selector (and its small lr); FedSM's depends on the calibration
    scheme = "lda" if catalogue.method(spec.method).per_batch_selector else spec.selector_calibration
    training = LocalTrainingConfig(epochs=spec.epochs, batch_size=spec.batch_size, lr=spec.lr,
                                   selector_lr=default_selector_lr(scheme, spec.selector_lr),
                                   selector_size=spec.selector_size, selector_epochs=int(spec.selector_epochs),
                                   selector_bn=spec.selector_bn,
                                   selector_head=spec.selector_head, selector_width=spec.selector_width,
                                   prox_mu=spec.prox_mu, device=device,
                                   lr_schedule=spec.lr_schedule, lr_min_ratio=spec.lr_min_ratio, loss=spec.loss)
    return catalogue.build_method(spec.method, task, names, training, spec.seed, spec.rounds, spec)
