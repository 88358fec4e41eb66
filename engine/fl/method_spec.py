"""What the coordinator tells every site about the run: the method and its hyper-parameters, with their bounds.

A :class:`MethodSpec` is the part of ``federation.toml`` that decides the numbers a site
computes. The coordinator signs it (:mod:`engine.security.run_spec`) and sends it (as JSON) in
every instruction, and each site builds the same :class:`engine.fl.methods.FederatedMethod` from
it with :func:`engine.federation.spec.build_method`, so both halves of a method agree on site
order, seeds and hyper-parameters. The hyper-parameters are declared once, in
:class:`TrainingSettings`, which ``fedsm simulate``'s :class:`engine.simulate.SimulationConfig`
extends too: the same defaults, bounds and one builder of local training
(:meth:`TrainingSettings.local_training`), so a network run and a simulation with the same
settings compute the same weights.

Every field declares its hard bounds beside it (:func:`engine.fl.setting_bounds.bounded`): what
no site accepts beyond, whatever its ``site.toml`` says. A dialogue method's options (``options``)
are declared where the method declares its settings (:data:`engine.fl.registry.EXCHANGE_OPTIONS`).
:func:`settings_problems` checks a signed spec (a plain dict, as a site receives it) against
them and against a site's own ``[bounds]``; importing this module costs no torch, so a SuperNode
checks a run before it pulls any payload. The compute device is not part of the spec: each site
chooses its own in ``site.toml``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from engine import catalogue
from engine.bundle import check_site_name
from engine.bundle.supermodel import (
    DEFAULT_PERSONALIZATION,
    DEFAULT_SELECTOR_WIDTH,
    PERSONALIZATION_RULES,
    SELECTOR_HEADS,
    SELECTOR_WIDTHS,
)
from engine.catalogue import DEFAULT_LAM, extra_rounds_default, federation_methods
from engine.data.disc_crop import CROP_MODES, check_mode
from engine.errors import ConfigError
from engine.fl.registry import (
    EXCHANGE_METHODS,
    all_option_bounds,
    all_option_totals,
    option_bounds,
    option_family,
    option_totals,
)
from engine.fl.selector_schemes import SELECTOR_CALIBRATIONS, check_calibration, default_selector_lr
from engine.fl.setting_bounds import (
    Bound,
    Total,
    bounded,
    bounds_of,
    flag,
    integer,
    limit_problem,
    names,
    number,
    one_of,
)
from engine.fl.training_options import (
    DEFAULT_WIRE_PRECISION,
    LR_SCHEDULES,
    SEGMENTATION_LOSSES,
    SELECTOR_BN_MODES,
    WIRE_PRECISIONS,
    check_wire_precision,
)
from engine.tasks import TASKS, get_task

#: FedSM's site routings (``"auto"`` and :data:`engine.models.style_gate_format.SITE_ROUTINGS`, written out
#: because that package imports torch; tests/federation/test_setting_bounds.py keeps the two equal).
SITE_ROUTING_CHOICES = ("auto", "selector", "style")
#: Most rounds of any kind a run may have (the paper trains 150).
MAX_ROUNDS = 10_000
#: Most passes over a site's data any network may train per round.
MAX_EPOCHS = 1000
#: The threshold a run with ``gamma = "auto"`` starts from and falls back to until the federation has
#: chosen one (the paper's 0.6; FedSM-extra's argmax routing uses no gamma, its bundle records this).
AUTO_GAMMA_FALLBACK = 0.6


def network_methods() -> tuple[str, ...]:
    """Every method a network federation can run now (weight methods and dialogue methods)."""
    return (*federation_methods(), *EXCHANGE_METHODS)


@dataclass(frozen=True, kw_only=True)
class TrainingSettings:
    """The hyper-parameters a run computes with, declared once for ``fedsm simulate``
    (:class:`engine.simulate.SimulationConfig`) and the network federation (:class:`MethodSpec`).

    Each field's hard bounds are declared beside it and hold in both (a simulation refuses what a site
    would); ``site.toml`` ``[bounds]`` tightens them for a network run (``max_<field>``,
    ``min_<field>``, ``allowed_<field>s``; docs/federation.md lists every key).
    """

    rounds: int = bounded(3, integer(1, MAX_ROUNDS, help="training rounds"))
    seed: int = bounded(0, integer(0, 2**32 - 1, help="training seed"))
    image_size: int = bounded(256, integer(16, 4096, help="image side in pixels"))
    lam: float | None = bounded(None, number(0.0, 1.0, nullable=True,
                                             null_means="the task's paper value, at least 1/K",
                                             help="SoftPull's lam (FedSM: within [1/K, 1])"))
    #: a number, or ``"auto"``: chosen in the last round from the sites' validation histograms
    gamma: float | str = bounded(0.6, number(0.0, 1.0, choices=("auto",), help="the selector's routing threshold"))
    gamma_pass: float = bounded(0.95, number(0.0, 1.0, low_open=True,
                                             help="share of validation images gamma 'auto' lets pass"))
    prox_mu: float = bounded(0.01, number(0.0, 10.0, help="FedProx's proximal weight"))
    extra_rounds: int | None = bounded(None, integer(0, MAX_ROUNDS, nullable=True, limited_by=("max_rounds",),
                                                     null_means="half the rounds, rounded up",
                                                     help="FedSM-extra's selector rounds"))
    epochs: int = bounded(1, integer(1, MAX_EPOCHS, help="local epochs per round"))
    batch_size: int = bounded(8, integer(1, 4096, help="images per training batch"))
    lr: float = bounded(1e-3, number(0.0, 1.0, low_open=True, help="the U-Nets' learning rate"))
    selector_lr: float | None = bounded(None, number(0.0, 1.0, low_open=True, nullable=True,
                                                     null_means="the selector scheme's default",
                                                     help="the selector's learning rate"))
    selector_size: int = bounded(32, integer(32, 1024, multiple_of=32, help="the selector's input side"))
    selector_head: str = bounded("gap", one_of(SELECTOR_HEADS, help="the selector's head"))
    selector_width: int = bounded(DEFAULT_SELECTOR_WIDTH, one_of(SELECTOR_WIDTHS,
                                                                 help="the selector's VGG-11 width (the paper's 64)"))
    lr_schedule: str = bounded("constant", one_of(LR_SCHEDULES, help="learning-rate schedule over rounds"))
    lr_min_ratio: float = bounded(0.01, number(0.0, 1.0, low_open=True, help="the cosine schedule's last lr / lr"))
    loss: str = bounded("dice", one_of(SEGMENTATION_LOSSES, site_key="allowed_losses", help="segmentation loss"))
    selector_calibration: str = bounded("none", one_of(SELECTOR_CALIBRATIONS, help="how the selector is finished"))
    selector_warmup: int = bounded(0, integer(0, MAX_ROUNDS, limited_by=("max_rounds",),
                                              help="FedSM's selector-only rounds before training"))
    selector_epochs: int = bounded(1, integer(1, MAX_EPOCHS, limited_by=("max_epochs",),
                                              help="the selector's local epochs per round"))
    selector_bn: str = bounded("batch", one_of(SELECTOR_BN_MODES, help="the selector's BatchNorm in training"))
    routing_guard: bool = bounded(True, flag(help="FedSM's routing guard"))
    #: FedSM's site-style gate: the quantile of the sites' validation distances it lets through, or
    #: ``"off"`` / ``false`` (engine.fl.style_gate)
    style_gate: float | None = bounded(0.95, number(0.0, 1.0, low_open=True, nullable=True, null_means="off",
                                                    help="quantile the site-style gate lets through"))
    #: How FedSM's bundle picks an image's site: ``"auto"`` (the better of the two below on the sites'
    #: validation images; engine.fl.routing_choice), ``"selector"`` (the paper's selector and gamma)
    #: or ``"style"`` (the style gate's nearest site; engine.fl.style_gate.route_by_style)
    site_routing: str = bounded("auto", one_of(SITE_ROUTING_CHOICES, help="how FedSM's bundle picks a site"))
    #: ``"auto"``: sites crop full fundus photos around the optic disc (engine.data.disc_crop).
    fundus_crop: str = bounded("none", one_of(CROP_MODES, help="cropping of full fundus photos"))
    #: How FedSM trains its personalized models: ``"apfl"`` (the default, chosen by measurement),
    #: ``"softpull"`` (the paper's), ``"finetune"``, ``"perfedavg"`` or ``"pfedme"``
    #: (engine.fl.personalization). Only FedSM reads it; other methods carry the default.
    personalization: str = bounded(DEFAULT_PERSONALIZATION,
                                   one_of(PERSONALIZATION_RULES, site_key="allowed_personalizations",
                                          methods=("fedsm",), help="how FedSM trains its personalized models"))
    #: How networks and optimizer moments travel (engine.fl.wire_precision): ``"bfloat16"`` or ``"float32"``
    wire_precision: str = bounded(DEFAULT_WIRE_PRECISION, one_of(WIRE_PRECISIONS,
                                                                 help="how networks and moments travel"))
    #: Settings of a dialogue method, keyed ``<family>_<name>`` (``blackfed_client_epochs``); in
    #: ``[training]`` they are written as top-level keys with that prefix. Each option's bounds are
    #: declared with the method's settings (engine.fl.registry.EXCHANGE_OPTIONS); unknown ones are refused.
    options: dict[str, Any] = field(default_factory=dict)

    def _check_training_settings(self) -> None:
        """Parse and check the fields that have a vocabulary of their own (gamma, gate, schemes)."""
        check_calibration(self.selector_calibration)
        from engine.fl.selector_gamma import check_pass_fraction, parse_gamma

        object.__setattr__(self, "gamma", parse_gamma(self.gamma))
        object.__setattr__(self, "gamma_pass", check_pass_fraction(self.gamma_pass))
        from engine.fl.style_gate import check_site_routing, parse_style_gate

        object.__setattr__(self, "style_gate", parse_style_gate(self.style_gate))
        check_site_routing(self.site_routing, self.style_gate)
        check_mode(self.fundus_crop)
        from engine.fl.personalization import check_personalization

        check_personalization(self.personalization)
        object.__setattr__(self, "wire_precision", check_wire_precision(self.wire_precision))
        if isinstance(self.options, Mapping):
            object.__setattr__(self, "options", dict(self.options))

    @property
    def fixed_gamma(self) -> float:
        """The routing threshold as a number: ``gamma``, or for ``"auto"`` the fallback the run starts from
        (:data:`AUTO_GAMMA_FALLBACK`) until the federation chooses one."""
        return AUTO_GAMMA_FALLBACK if self.gamma == "auto" else float(self.gamma)

    def _resolve_run_defaults(self, task: str, num_sites: int) -> None:
        """The values a null ``lam`` and ``extra_rounds`` stand for, resolved once for the run: the paper's lam
        for ``task`` raised to ``1/num_sites`` (SoftPull needs lam >= 1/K), half the rounds rounded up."""
        if self.lam is None:
            object.__setattr__(self, "lam", default_lam(task, num_sites))
        if self.extra_rounds is None and isinstance(self.rounds, int):
            object.__setattr__(self, "extra_rounds", extra_rounds_default(self.rounds))

    def training_problems(self) -> list[str]:
        """What breaks a declared bound among these settings (no site's ``[bounds]``; :func:`settings_problems`
        checks a whole signed spec with them)."""
        declared = {k: v for k, v in bounds_of(TrainingSettings).items() if k not in EXEMPT}
        out: list[str] = []
        for name, bound in declared.items():  # null settings that stand for a default are nullable
            out += _check(name, getattr(self, name), bound, lambda key: None)
        return out

    def local_training(self, method: str | None, device: str) -> Any:
        """The :class:`engine.fl.local_training.LocalTrainingConfig` that ``method`` trains with on ``device``.

        The one place the settings become local training: FedSM-extra (a method whose catalogue entry
        keeps the per-batch selector) trains the selector at that scheme's small default lr, every
        other method at its calibration's (``method=None``: no method's exception).
        """
        from engine.fl.local_training import LocalTrainingConfig  # torch: a SuperNode checks specs without it

        return LocalTrainingConfig(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                                   selector_lr=effective_selector_lr(method, self.selector_calibration,
                                                                     self.selector_lr, self.selector_width),
                                   selector_size=self.selector_size, selector_epochs=int(self.selector_epochs),
                                   selector_bn=self.selector_bn, selector_head=self.selector_head,
                                   selector_width=self.selector_width, prox_mu=self.prox_mu, device=device,
                                   lr_schedule=self.lr_schedule, lr_min_ratio=self.lr_min_ratio, loss=self.loss)


@dataclass(frozen=True)
class MethodSpec(TrainingSettings):
    """Method, sites and hyper-parameters of one federated run (see ``docs/federation.md``).

    The hyper-parameters are :class:`TrainingSettings`'s, with the bounds declared there; the spec adds
    what only a network run names: the method, the task and the sites in label order.
    """

    method: str = bounded(bound=one_of(network_methods, site_key="allowed_methods",
                                       help="the federated method"))
    task: str = bounded(bound=one_of(tuple(TASKS), help="what is segmented"))
    site_names: tuple[str, ...] = bounded(bound=names(1, 1000, site_key="max_sites", check=check_site_name,
                                                      help="the sites, in the selector's label order"))

    def __post_init__(self) -> None:
        if self.method not in network_methods():
            raise ConfigError(f"method {self.method!r} cannot run over the network; choose one of "
                              f"{', '.join(network_methods())}")
        get_task(self.task)
        names_ = tuple(self.site_names)
        if not names_:
            raise ConfigError("a federation needs at least one site; list them in [federation] sites")
        for name in names_:
            check_site_name(name)
        if len(set(names_)) != len(names_):
            raise ConfigError(f"site names must be unique, got {list(names_)}")
        object.__setattr__(self, "site_names", names_)
        self._check_training_settings()
        if self.personalization != DEFAULT_PERSONALIZATION and self.method != "fedsm":
            raise ConfigError(f"personalization = {self.personalization!r} is a FedSM setting; use method = "
                              f"\"fedsm\" or drop it (method {self.method!r} trains no personalized models that way)")
        self._resolve_run_defaults(self.task, len(names_))
        # every declared bound at once (the rest of each setting's range and type; the options' own)
        broken = settings_problems(self.as_dict())
        if broken:
            raise ConfigError("; ".join(broken))
        if self.method in ("fedsm", "fedsm-extra"):
            from engine.fl.aggregation import check_lam

            check_lam(float(self.lam), len(names_))  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain data (what :meth:`to_json` writes)."""
        data = asdict(self)
        data["site_names"] = list(self.site_names)
        return data

    def to_json(self) -> str:
        """Compact JSON (sorted keys): sent to the sites, stored in checkpoints."""
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

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
        family = option_family(str(raw.get("method", ""))) + "_"
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
        trained = training_rounds(self.as_dict())
        return trained + 1 if self.method in ("fedsm", "fedsm-extra") else trained

    def with_sites(self, names: tuple[str, ...]) -> MethodSpec:
        return replace(self, site_names=names)


def default_lam(task: str, num_sites: int) -> float:
    """SoftPull's lam when none is given: the paper's value for ``task``, raised to ``1/num_sites``."""
    return max(DEFAULT_LAM[task], 1.0 / max(num_sites, 1))


def effective_selector_lr(method: str | None, selector_calibration: str, selector_lr: float | None,
                          selector_width: int) -> float:
    """The selector's learning rate a run trains with (FedSM-extra keeps the per-batch scheme's)."""
    per_batch = method in catalogue.method_names() and catalogue.method(method).per_batch_selector
    return default_selector_lr("lda" if per_batch else selector_calibration, selector_lr, selector_width)


def training_rounds(settings: Mapping[str, Any]) -> int:
    """Rounds in which the sites train: FedSM's warm-up and training rounds, FedSM-extra's training and
    selector rounds, every other method's rounds (the calibration round is not counted)."""
    method, rounds = settings.get("method"), int(settings.get("rounds", 0))
    if method == "fedsm":
        return int(settings.get("selector_warmup") or 0) + rounds
    if method == "fedsm-extra":
        extra = settings.get("extra_rounds")
        return rounds + int(extra_rounds_default(rounds) if extra is None else extra)
    return rounds


#: Limits on settings taken together (each also bounded by a site's ``[bounds]`` key).
TOTALS: tuple[Total, ...] = (
    Total("training rounds", "selector_warmup + rounds for fedsm, rounds + extra_rounds for fedsm-extra, else rounds",
          training_rounds, MAX_ROUNDS, "max_rounds"),
)

#: Fields without a bound of their own: ``options`` holds each dialogue option, bounded as declared.
EXEMPT = ("options",)


def field_bounds() -> dict[str, Bound]:
    """The declared :class:`Bound` of every field of :class:`MethodSpec` (``options`` left out)."""
    return {k: v for k, v in bounds_of(MethodSpec).items() if k not in EXEMPT}


def _defaults() -> dict[str, Any]:
    out = {}
    for f in fields(MethodSpec):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def settings_problems(raw: Mapping[str, Any], limit: Callable[[str], Any] | None = None) -> list[str]:
    """What in a run's settings (``MethodSpec`` as a dict) breaks the declared bounds or a site's limits.

    ``limit(key)`` is the value of a site's ``[bounds]`` key (``None``: the site did not tighten it).
    Settings missing from ``raw`` take their defaults (as :meth:`MethodSpec.from_dict` would); null
    ones that stand for a default (``lam``, ``extra_rounds``, ``selector_lr``) are checked at the
    value the run would use. Nothing here imports torch.
    """
    site = limit or (lambda key: None)
    if not isinstance(raw, Mapping):
        return ["the run's settings are not a JSON object"]
    declared = field_bounds()
    out = [f"unknown setting {key!r} (this site's FedSM has no such setting; the coordinator runs another "
           "version)" for key in sorted(set(raw) - set(declared) - set(EXEMPT))]
    values = {**_defaults(), **raw}
    for name in declared:
        if name not in values:
            out.append(f"{name} is missing from the run's settings")
    if out:
        return out
    _resolve_defaults(values)
    for name, bound in declared.items():
        # a site's limit on a setting binds only the methods that read it (Bound.methods)
        applies = not bound.methods or values.get("method") in bound.methods
        out += _check(name, values[name], bound, site if applies else (lambda key: None))
    options = values.get("options")
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        return [*out, f"options must be a table of named settings, got {options!r}"]
    method = str(values.get("method"))
    allowed = option_bounds(method)
    for key in sorted(options):
        if key not in allowed:
            out.append(f"option {key!r} is not a setting of method {method!r} (its options: "
                       f"{', '.join(sorted(allowed)) or 'none'}); the coordinator must drop it")
        else:
            out += _check(key, options[key], allowed[key], site)
    if not out:  # totals of values that each passed their own bound
        for total in TOTALS:
            out += total.problems(values, site)
        for total in option_totals(method):
            out += total.problems(options, site)
    return out


def _resolve_defaults(values: dict[str, Any]) -> None:
    """Replace a null ``lam``, ``extra_rounds`` or ``selector_lr`` by the value the run would use."""
    try:
        if values.get("lam") is None and values.get("task") in DEFAULT_LAM:
            values["lam"] = default_lam(values["task"], len(values.get("site_names") or ()))
        if values.get("extra_rounds") is None and isinstance(values.get("rounds"), int):
            values["extra_rounds"] = extra_rounds_default(values["rounds"])
        if values.get("selector_lr") is None:
            values["selector_lr"] = effective_selector_lr(
                str(values.get("method")), str(values.get("selector_calibration")), None,
                int(values.get("selector_width", DEFAULT_SELECTOR_WIDTH)))
    except (ConfigError, TypeError, ValueError):
        return  # an unknown method or scheme has no default to resolve; its own bound reports it


def _check(name: str, value: Any, bound: Bound, site: Callable[[str], Any]) -> list[str]:
    hard = bound.problem(name, value)
    if hard is not None:
        return [hard]
    measured, label = (len(value), f"the number of sites ({name})") if bound.kind == "names" else (value, name)
    out = []
    for key in (*bound.site_keys(name), *bound.limited_by):
        problem = limit_problem(label, measured, key, site(key))
        if problem is not None:
            out.append(problem)
    return out


@dataclass(frozen=True)
class SiteKey:
    """One ``site.toml`` ``[bounds]`` key: what it bounds and how (``max``, ``min``, ``allowed``)."""

    key: str
    direction: str
    settings: tuple[str, ...]
    bound: Bound


def site_keys() -> dict[str, SiteKey]:
    """Every ``[bounds]`` key a site may write, generated from the declarations (settings, options, totals)."""
    keys: dict[str, SiteKey] = {}

    def add(key: str, setting: str, bound: Bound) -> None:
        direction = key.split("_", 1)[0]
        known = keys.get(key)
        keys[key] = SiteKey(key, direction, (*known.settings, setting) if known else (setting,),
                            known.bound if known else bound)

    declared = {**field_bounds(), **all_option_bounds()}
    for name, bound in declared.items():
        for key in bound.site_keys(name):
            add(key, name, bound)
    for name, bound in declared.items():
        for key in bound.limited_by:
            if key not in keys:
                raise ValueError(f"{name} is limited_by {key!r}, which no setting declares")
            add(key, name, bound)
    for total in (*TOTALS, *all_option_totals()):
        add(total.site_key, f"{total.name} ({total.formula})", keys[total.site_key].bound if total.site_key in keys
            else integer(0, int(total.high), help=f"{total.name}: {total.formula}"))
    return keys


__all__ = [
    "EXEMPT",
    "TOTALS",
    "MethodSpec",
    "SiteKey",
    "TrainingSettings",
    "default_lam",
    "effective_selector_lr",
    "field_bounds",
    "network_methods",
    "option_family",
    "settings_problems",
    "site_keys",
    "training_rounds",
]
