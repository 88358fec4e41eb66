"""Every setting a coordinator signs has hard bounds declared beside it, and a site can tighten each one.

Parametrized over every declared setting (the fields of MethodSpec and every dialogue method's
options): a value beyond its hard bound is refused by a site with default bounds and by the
coordinator; every ``[bounds]`` key the declarations generate refuses a value it excludes. A new
field without a declaration, or an option a method reads without declaring it, fails here. The
red team's values are refused by a site with ``max_epochs = 2`` and ``max_rounds = 4``, and the
settings of every benchmark preset are accepted by a site with default bounds. No network.
"""

from __future__ import annotations

import re
from dataclasses import asdict, fields
from pathlib import Path

import pytest
from fed_fixtures import pki  # noqa: F401

from engine.bundle.supermodel import DEFAULT_PERSONALIZATION
from engine.errors import ConfigError
from engine.fl.method_spec import EXEMPT, TOTALS, MethodSpec, field_bounds, site_keys
from engine.fl.registry import EXCHANGE_METHODS, EXCHANGE_OPTIONS, all_option_bounds, option_bounds
from engine.fl.setting_bounds import Bound, unbounded_fields
from engine.security.run_spec import SiteBounds, bounds_dict, bounds_table

ROOT = Path(__file__).resolve().parents[2]
SITES = ("site1", "site2")
#: A method of each option family.
FAMILY_METHOD = {"blackfed": "blackfed-v1", "split": "split-whitebox", "fediod": "fediod"}


def _base(method: str = "fedavg") -> dict:
    return MethodSpec(method=method, task="fundus", site_names=SITES, rounds=2, image_size=64).as_dict()


def _spec_with(name: str, value) -> dict:
    """A valid spec (as a site receives it) with setting or option ``name`` set to ``value``."""
    family = name.split("_")[0]
    if name in field_bounds():
        return {**_base("fedsm" if name in ("lam", "selector_warmup", "personalization") else
                        "fedsm-extra" if name == "extra_rounds" else "fedavg"), name: value}
    return {**_base(FAMILY_METHOD[family]), "options": {name: value}}


def _declared() -> list[tuple[str, Bound]]:
    return [*field_bounds().items(), *all_option_bounds().items()]


# --- every signed setting is declared ---------------------------------------------------------------
def test_every_methodspec_field_declares_its_bounds():
    assert unbounded_fields(MethodSpec, EXEMPT) == []
    assert set(field_bounds()) == {f.name for f in fields(MethodSpec)} - set(EXEMPT)
    # the defaults themselves are within the bounds (and need no site key to pass)
    assert SiteBounds().violations(_base()) == []


def test_every_dialogue_option_a_method_reads_is_declared():
    from engine.fl.blackfed_config import BlackFedConfig
    from engine.fl.fediod import build_fediod
    from engine.fl.split_whitebox import build_split_whitebox
    from engine.tasks import FUNDUS

    class Reads(dict):
        def __init__(self) -> None:
            super().__init__()
            self.read: set[str] = set()

        def get(self, key, default=None):
            self.read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            self.read.add(key)
            return super().__getitem__(key)

    assert set(EXCHANGE_OPTIONS) == {m.split("-")[0] for m in EXCHANGE_METHODS}
    assert unbounded_fields(BlackFedConfig) == []
    for family, factory in (("blackfed", lambda s: BlackFedConfig.from_settings(s)),
                            ("fediod", lambda s: build_fediod("fediod", FUNDUS, ["a", "b"], s))):
        settings = Reads()
        factory(settings)
        prefixed = {k for k in settings.read if k.startswith(family + "_")}
        assert prefixed == set(option_bounds(FAMILY_METHOD[family])), family
    # split-whitebox reads BlackFed's settings under its own prefix
    assert EXCHANGE_OPTIONS["split"] == EXCHANGE_OPTIONS["blackfed"]
    method = build_split_whitebox("split-whitebox", FUNDUS, ["a"], {"split_client_epochs": 3})
    assert method.config.client_epochs == 3
    assert set(option_bounds("split-whitebox")) == {k.replace("blackfed_", "split_")
                                                    for k in option_bounds("blackfed-v2")}
    # an option the method does not declare cannot be signed
    with pytest.raises(ConfigError, match="fediod_device"):
        MethodSpec(method="fediod", task="fundus", site_names=SITES, options={"fediod_device": "cuda"})
    with pytest.raises(ConfigError, match="fediod_rounds"):
        MethodSpec.from_dict({**_base("fediod"), "fediod_rounds": 100000})
    assert SiteBounds().violations({**_base("fediod"), "options": {"fediod_rounds": 100000}})
    assert SiteBounds().violations({**_base("fedavg"), "options": {"blackfed_client_epochs": 1}})


def test_the_routing_choices_written_out_match_the_style_gate():
    from engine.fl.method_spec import SITE_ROUTING_CHOICES
    from engine.fl.routing_choice import AUTO
    from engine.models.style_gate_format import SITE_ROUTINGS

    assert SITE_ROUTING_CHOICES == (AUTO, *SITE_ROUTINGS)


# --- each class of setting refused beyond its declared bound -------------------------------------
def _outside(bound: Bound) -> list:
    """Values the hard bound excludes."""
    if bound.kind == "choice":
        return ["no-such-choice", 12345]
    if bound.kind == "bool":
        return ["yes", 1]
    if bound.kind == "names":
        return [[f"s{i}" for i in range(int(bound.high) + 1)], ["a", "a"], ["bad name"]]
    step = 1 if bound.kind == "int" else max(bound.high * 1e-3, 1e-9)
    out = [bound.high + step, bound.low - step, "3", True, float("nan")]
    if bound.high_open:
        out.append(bound.high)
    if bound.low_open:
        out.append(bound.low)
    if bound.kind == "int":
        out.append(bound.low + 0.5)
    if bound.multiple_of:
        out.append(bound.low + 1)
    return out


@pytest.mark.parametrize(("name", "bound"), _declared(), ids=[n for n, _ in _declared()])
def test_a_value_beyond_the_declared_bound_is_refused_by_every_site_and_the_coordinator(name, bound):
    for value in _outside(bound):
        spec = _spec_with(name, value)
        problems = SiteBounds().violations(spec)
        assert problems and name in problems[0], (name, value, problems)
        with pytest.raises(ConfigError):
            MethodSpec.from_dict(spec)


def _excluded(entry):
    """``(value, limit)``: a site limit valid for key ``entry`` and a value (within every hard bound) it excludes."""
    bound = entry.bound  # the bound of the key's own setting; the others sharing it are no narrower below it
    if entry.direction == "allowed":
        choices = list(bound.allowed())
        return choices[0], [choices[1]]
    if bound.kind == "names":
        return list(SITES), 1
    if bound.kind == "int":
        step = bound.multiple_of or 1
        low = bound.low + (1 if bound.low_open else 0)
        return (low + step, low) if entry.direction == "max" else (low + step, low + 2 * step)
    span = bound.high - bound.low  # near the low end: within the historical keys' defaults (max_lr = 0.01)
    small, large = bound.low + span * 1e-4, bound.low + span * 2e-4
    return (large, small) if entry.direction == "max" else (small, large)


def _site_cases() -> list[tuple[str, str]]:
    return [(k, s) for k, entry in site_keys().items() for s in entry.settings if " " not in s]


@pytest.mark.parametrize(("key", "setting"), _site_cases(), ids=[f"{k}:{s}" for k, s in _site_cases()])
def test_every_generated_site_key_tightens_its_settings(key, setting):
    entry = site_keys()[key]
    value, limit = _excluded(entry)
    spec = _spec_with(setting, value)
    assert SiteBounds().violations(spec) == [], (key, setting, value)
    site = SiteBounds.from_dict({key: limit})
    problems = site.violations(spec)
    assert any(key in p for p in problems), (key, setting, value, limit, problems)
    assert SiteBounds.from_dict(bounds_dict(site)) == site


def test_totals_are_bounded_by_the_site():
    four = SiteBounds.from_dict({"max_rounds": 4})
    assert four.violations({**_base("fedsm-extra"), "rounds": 4, "extra_rounds": 0}) == []
    [problem] = four.violations({**_base("fedsm-extra"), "rounds": 3, "extra_rounds": 2})
    assert problem.startswith("training rounds") and "= 5 is above max_rounds = 4" in problem
    [problem] = four.violations({**_base("fedsm"), "rounds": 3, "selector_warmup": 2})
    assert "= 5 is above max_rounds = 4" in problem
    assert four.violations({**_base("fedavg"), "rounds": 4, "selector_warmup": 3}) == []  # FedAvg has no warm-up
    passes = SiteBounds.from_dict({"max_blackfed_client_passes": 10})
    spec = {**_base("blackfed-v1"), "options": {"blackfed_client_epochs": 2, "blackfed_perturbations": 3}}
    [problem] = passes.violations(spec)
    assert "client_epochs x 2 x perturbations) = 12 is above max_blackfed_client_passes = 10" in problem
    spec["options"] = {"blackfed_client_epochs": 1000, "blackfed_perturbations": 100}
    [problem] = SiteBounds.from_dict({"max_epochs": 1000}).violations(spec)
    assert "= 200000 is above 2000, its hard maximum" in problem
    assert [t.site_key for t in TOTALS] == ["max_rounds"]


# --- the red team's run ---------------------------------------------------------------------------
RED_TEAM = [
    ("fedsm-extra", "extra_rounds", 100000),
    ("fedsm", "selector_epochs", 100000),
    ("blackfed-v1", "blackfed_client_epochs", 100000),
    ("blackfed-v1", "blackfed_perturbations", 100000),
    ("blackfed-v1", "blackfed_client_lr", 1e6),
    ("fedprox", "prox_mu", 1e9),
    ("fedsm", "lam", 1e9),
]


@pytest.mark.parametrize(("method", "name", "value"), RED_TEAM, ids=[n for _, n, _ in RED_TEAM])
def test_the_red_teams_values_are_refused_by_a_small_site(pki, method, name, value):  # noqa: F811
    from test_run_spec import APP

    from engine.security.run_spec import RunSpecRefused, make_envelope, verify_envelope

    small = SiteBounds.from_dict({"max_epochs": 2, "max_rounds": 4})
    spec = _base(method)
    if name.startswith("blackfed_"):
        spec["options"] = {name: value}
    else:
        spec[name] = value
    import json

    envelope = make_envelope(json.dumps(spec), APP, "s1", pki / "server.key", pki / "server.pem")
    with pytest.raises(RunSpecRefused) as refused:
        verify_envelope(envelope, ca_cert=pki / "ca.pem", app_hash=APP, bounds=small)
    text = str(refused.value)
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    assert re.search(rf"{name} = {re.escape(shown)} is above \S+", text), text
    assert "the coordinator must lower" in text


def test_values_within_the_hard_bounds_are_refused_by_the_small_sites_own_limits():
    small = SiteBounds.from_dict({"max_epochs": 2, "max_rounds": 4})
    cases = [({**_base("fedsm-extra"), "rounds": 2, "extra_rounds": 5}, "max_rounds = 4"),
             ({**_base("fedsm"), "selector_epochs": 3}, "selector_epochs = 3 is above max_epochs = 2"),
             ({**_base("fedavg"), "epochs": 3}, "epochs = 3 is above max_epochs = 2"),
             ({**_base("blackfed-v1"), "options": {"blackfed_client_epochs": 3}},
              "blackfed_client_epochs = 3 is above max_epochs = 2"),
             ({**_base("blackfed-v1"), "options": {"blackfed_server_epochs": 5}},
              "blackfed_server_epochs = 5 is above max_epochs = 2"),
             ({**_base("fedavg"), "rounds": 5}, "rounds = 5 is above max_rounds = 4")]
    for spec, expected in cases:
        problems = small.violations(spec)
        assert any(expected in p for p in problems), (expected, problems)
    assert small.violations({**_base("fedsm"), "rounds": 4, "epochs": 2, "selector_epochs": 2}) == []


# --- every preset the project ships is accepted ----------------------------------------------------
def _preset_specs():
    from engine.bench.presets import PRESETS
    from engine.fl.blackfed_config import BlackFedConfig
    from engine.fl.method_spec import network_methods

    for preset in PRESETS.values():
        for tp in preset.tasks:
            names = tuple(f"site{i + 1}" for i in range(tp.sites))
            common = {"task": tp.task, "site_names": names, "rounds": tp.rounds, "image_size": tp.image_size,
                      "epochs": preset.epochs, "batch_size": preset.batch_size, "selector_lr": preset.selector_lr,
                      "selector_size": preset.selector_size, "selector_width": preset.selector_width,
                      "gamma": preset.gamma, "prox_mu": preset.prox_mu, "lr_schedule": preset.lr_schedule,
                      "lr_min_ratio": preset.lr_min_ratio, "loss": preset.loss}
            methods = [m for m in (*preset.methods, *preset.split_methods) if m in network_methods()]
            for lr in (preset.lr, *preset.lr_grid):
                for method in dict.fromkeys(methods):
                    options = ({f"{method.split('-')[0]}_{k}": v for k, v in asdict(BlackFedConfig()).items()}
                               if method in EXCHANGE_METHODS else {})
                    rules = (("softpull", *preset.personalizations) if method == "fedsm"
                             else (DEFAULT_PERSONALIZATION,))
                    for rule in rules:
                        yield f"{preset.name}/{tp.task}/{method}/{rule}/lr{lr:g}", {
                            **common, "method": method, "lr": lr, "personalization": rule, "options": options,
                            **({"lam": tp.lam} if method.startswith("fedsm") else {})}
            if preset.fediod_seeds:
                for eps in (None, *preset.fediod_epsilons):
                    yield f"{preset.name}/{tp.task}/fediod/eps{eps}", {
                        **common, "method": "fediod", "lr": preset.lr,
                        "options": {"fediod_steps": max(1, preset.fediod_steps // tp.rounds),
                                    "fediod_teacher_epochs": preset.fediod_teacher_epochs, "fediod_dp_epsilon": eps}}


def test_every_presets_settings_are_accepted_by_a_site_with_default_bounds():
    seen = 0
    for label, raw in _preset_specs():
        spec = MethodSpec.from_dict(raw)  # within the hard bounds
        assert SiteBounds().violations(spec.as_dict()) == [], label
        seen += 1
    assert seen > 50


def test_the_paper_scale_runs_within_the_default_bounds():
    spec = MethodSpec(method="fedsm-extra", task="fundus", site_names=tuple(f"s{i}" for i in range(6)), rounds=150,
                      image_size=256, lam=0.7)
    assert spec.extra_rounds == 75 and spec.total_rounds == 226
    assert SiteBounds().violations(spec.as_dict()) == []


# --- site.toml keys ------------------------------------------------------------------------------
def test_site_keys_are_checked_when_read():
    for table, expected in (({"max_epoch": 2}, r"did you mean max_epochs"),
                            ({"max_blackfed_perturbation": 2}, r"did you mean max_blackfed_perturbations"),
                            ({"allowed_losses": ["focal"]}, r"allowed_losses lists 'focal'"),
                            ({"allowed_losses": "dice"}, r"allowed_losses must be a list"),
                            ({"max_rounds": 0}, r"max_rounds = 0 would refuse every run"),
                            ({"max_lr": 0.0}, r"max_lr = 0.0 would refuse every run"),
                            ({"min_fediod_dp_delta": 1.0}, r"would refuse every run"),
                            ({"max_epochs": 2.5}, r"max_epochs = 2.5 must be an integer"),
                            ({"max_sites": 0}, r"max_sites = 0 would refuse every run"),
                            ({"allowed_routing_guards": ["yes"]}, r"true or false")):
        with pytest.raises(ConfigError, match=expected):
            SiteBounds.from_dict(table)
    site = SiteBounds.from_dict({"min_fediod_dp_noise": 0.5, "allowed_losses": ["dicece"], "max_epochs": 3})
    assert site.limit("min_fediod_dp_noise") == 0.5 and site.limit("allowed_losses") == ("dicece",)
    assert site.max_epochs == 3 and site.limit("max_prox_mu") is None
    assert bounds_dict(site)["allowed_losses"] == ["dicece"]
    fediod = {**_base("fediod"), "options": {"fediod_dp_noise": 0.1}}
    assert any("fediod_dp_noise = 0.1 is below min_fediod_dp_noise = 0.5" in p for p in site.violations(fediod))


def test_the_documented_bounds_table_is_the_generated_one():
    text = (ROOT / "docs" / "federation.md").read_text()
    documented = text.split("<!-- bounds-table:start -->\n", 1)[1].split("<!-- bounds-table:end -->", 1)[0]
    assert documented == bounds_table(), ("docs/federation.md's [bounds] table is out of date; replace it with the "
                                          "output of python -c \"from engine.security.run_spec import bounds_table; "
                                          "print(bounds_table(), end='')\"")
    for key in site_keys():
        assert f"`{key}`" in documented


# --- the personalization rule: a FedSM setting with a measured default ------------------------------
def test_a_sites_personalization_bound_binds_fedsm_runs_only():
    """A FedAvg run carries the default rule, which it never reads: a site that allows only SoftPull
    still joins it, and refuses a FedSM run with the default rule until the spec names SoftPull."""
    site = SiteBounds.from_dict({"allowed_personalizations": ["softpull"]})
    fedavg = _base("fedavg")
    assert fedavg["personalization"] == DEFAULT_PERSONALIZATION == "apfl"
    assert site.violations(fedavg) == []
    refused = site.violations(_base("fedsm"))
    assert len(refused) == 1 and "allowed_personalizations" in refused[0] and "apfl" in refused[0]
    assert site.violations({**_base("fedsm"), "personalization": "softpull"}) == []


def test_another_rule_than_the_default_is_refused_for_a_method_that_does_not_read_it():
    with pytest.raises(ConfigError, match="is a FedSM setting"):
        MethodSpec(method="fedavg", task="fundus", site_names=SITES, rounds=2, image_size=64,
                   personalization="softpull")
    assert MethodSpec(method="fedsm", task="fundus", site_names=SITES, rounds=2,
                      image_size=64).personalization == DEFAULT_PERSONALIZATION


def test_simulate_and_the_benchmark_default_to_their_rules():
    """``fedsm simulate`` trains the product's default; the benchmark's ``fedsm`` stays the paper's."""
    from engine.bench.bench_simulation import JobContext
    from engine.bench.presets import PRESETS
    from engine.cli.main import build_parser

    args = build_parser().parse_args(["simulate", "--task", "fundus", "--out", "unused"])
    assert args.personalization == DEFAULT_PERSONALIZATION
    preset = PRESETS["tiny"]
    ctx = JobContext(preset=preset, tp=preset.tasks[0], sites=[], out_dir=ROOT)
    assert ctx.config(seed=0, sites=2).personalization == "softpull"
