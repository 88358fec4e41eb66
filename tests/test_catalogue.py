"""The weight methods' catalogue: the one place a method is named, and a method added from outside the product.

A test-only method (one class and one catalogue entry in ``tests/plugins``, a distribution with a
``fedsm.methods`` entry point; no product file edited) trains through ``fedsm simulate``'s code path,
is titled in the report and written as a single-model bundle. The same plugin runs through a
loopback federation of real processes in tests/federation/test_loopback_faults.py.
"""

from __future__ import annotations

import pytest
import torch
from testsupport import PLUGIN_METHOD as NAME
from testsupport import plugin_installed

from engine import catalogue
from engine.errors import ConfigError
from engine.fl.methods import FedProx, FedSM, FedSMExtra


@pytest.fixture
def damped_avg():
    """The plugin on this process's path, found and registered as an installed plugin would be."""
    with plugin_installed() as name:
        yield catalogue.method(name)


def test_a_method_registered_from_outside_the_product_trains_reports_and_bundles(damped_avg, tmp_path):
    from engine import api
    from engine.bundle import read_metadata
    from engine.bundle.supermodel import load_bundle

    # Execute: fedsm simulate's code path, FedAvg beside the new method on the same data and seed
    report = api.simulate(tmp_path, task="fundus", sites=2, rounds=2, methods=("fedavg", NAME), image_size=32,
                          seed=0, device="cpu", keep_best=False)

    # Assert: both trained and were evaluated; the new one under its title, as a single-model bundle
    assert set(report["methods"]) == {"fedavg", NAME}
    assert 0.0 <= report["methods"][NAME]["client_average"]["mean"] <= 1.0
    assert "Damped FedAvg (test)" in (tmp_path / "report.md").read_text()
    meta = read_metadata(tmp_path / f"{NAME}.safetensors")
    assert meta.method == NAME and meta.routing == "none"
    # ... and its aggregation is its own: not FedAvg's global model after the same rounds
    damped = load_bundle(tmp_path / f"{NAME}.safetensors").global_weights
    plain = load_bundle(tmp_path / "fedavg.safetensors").global_weights
    floats = [k for k, v in plain.items() if v.is_floating_point()]
    assert max(float((damped[k] - plain[k]).abs().max()) for k in floats) > 1e-4


def test_the_catalogue_builds_the_same_method_from_the_simulation_and_the_network_spec(tmp_path):
    from engine.federation.spec import MethodSpec, build_method
    from engine.simulate import Simulation, SimulationConfig

    common = {"task": "fundus", "rounds": 2, "seed": 3, "image_size": 32, "prox_mu": 0.05, "lam": 0.6}
    for name, cls in (("fedprox", FedProx), ("fedsm", FedSM), ("fedsm-extra", FedSMExtra)):
        spec = MethodSpec(method=name, site_names=("site1", "site2"), **common)
        networked = build_method(spec, device="cpu")
        sim = Simulation(SimulationConfig(sites=2, methods=(name,), device="cpu", **common), tmp_path)
        sim.sites = [type("Site", (), {"name": n})() for n in ("site1", "site2")]
        simulated = sim._build_method(name)
        assert type(networked) is type(simulated) is cls
        assert networked.rounds == simulated.rounds == 2 and networked.seed == simulated.seed == 3
        assert networked.training.selector_lr == simulated.training.selector_lr
        if name == "fedprox":
            assert networked.mu == simulated.mu == 0.05
        else:
            assert networked.lam == simulated.lam == 0.6


def test_the_catalogue_names_each_method_once_and_says_what_other_layers_read():
    assert catalogue.method_names()[:3] == ("centralized", "local", "fedavg")
    assert "centralized" not in catalogue.federation_methods() and "fedsm" in catalogue.federation_methods()
    assert catalogue.single_model_methods() == ("centralized", "fedavg", "fedprox", "scaffold")
    assert catalogue.bundle_routing("fedsm") == "gamma" and catalogue.bundle_routing("local") is None
    assert catalogue.mean_aggregation_methods() == {"fedavg", "fedprox", "fedsm", "fedsm-extra"}
    with pytest.raises(ConfigError, match="already registered"):
        catalogue.register(catalogue.WeightMethod("fedavg", "Again", "engine.fl.methods:FedAvg"))
    with pytest.raises(ConfigError, match="routing must be one of"):
        catalogue.register(catalogue.WeightMethod("x-test", "X", "engine.fl.methods:FedAvg", routing="vote"))
    with pytest.raises(ConfigError, match=r"unknown method 'fedopt'.*fedavg"):
        catalogue.method("fedopt")
    assert "x-test" not in catalogue.method_names()


def test_importing_the_catalogue_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, engine.catalogue; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"
    assert torch.__version__  # the test process itself has torch; the fresh interpreter above did not load it


def test_a_broken_plugin_is_skipped_and_named_when_its_method_is_asked_for(monkeypatch, tmp_path):
    # Prepare: an installed distribution whose fedsm.methods entry point names something that is not a method
    info = tmp_path / "broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedsm.methods]\nbroken = os:sep\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    # Execute
    added = catalogue.load_plugins()

    # Assert: nothing registered, the product's methods intact, and the error says which plugin and why
    assert added == () and "fedavg" in catalogue.method_names()
    with pytest.raises(ConfigError, match=r"plugin broken = os:sep could not be loaded: it names a str"):
        catalogue.method("broken")
    # ... until it is gone from the path
    monkeypatch.undo()
    catalogue.load_plugins()
    with pytest.raises(ConfigError) as err:
        catalogue.method("broken")
    assert "plugin" not in str(err.value)
