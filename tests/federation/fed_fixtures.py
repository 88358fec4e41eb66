"""Shared fixtures for federation tests: tiny synthetic sites, certificates, a reference simulation.

Imported by the test modules that use them (a conftest.py here would shadow ``tests/conftest.py``,
which other test folders import by name).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from testsupport import PLUGIN_METHOD, plugin_installed

#: Federation runs in the end-to-end tests: FedSM, 2 training rounds, 32 px images, on the 2 sites of
#: :func:`fed_data_two` (tests of a site leaving and returning use the 3 sites of :func:`fed_data`). The selector's
#: backbone is 16 wide (the paper's is 64): replies of ~17 MiB instead of ~125 MiB, the same messages,
#: parts and code paths; what the paper's width costs on the wire is benchmarks/transport_overhead.py's.
TRAINING = {"task": "fundus", "method": "fedsm", "rounds": 2, "seed": 0, "image_size": 32, "selector_width": 16}
#: The same federation trained with FedAvg for 3 rounds (as many as FedSM's 2 + calibration): tests of the
#: transport's fault handling, which does not depend on the method, move ~7 MB a reply instead of FedSM's ~125 MB.
FEDAVG_TRAINING = {**TRAINING, "method": "fedavg", "rounds": 3}
#: The test-only weight method of tests/plugins (testsupport.plugin_installed), trained like FEDAVG_TRAINING.
PLUGIN_TRAINING = {**FEDAVG_TRAINING, "method": PLUGIN_METHOD}


@pytest.fixture(scope="session")
def fed_data(tmp_path_factory) -> tuple[Path, list[Path]]:
    from engine.data.synth import generate_federation

    root = tmp_path_factory.mktemp("fed-data")
    return root, generate_federation("fundus", 3, root, image_size=32, seed=0)


@pytest.fixture(scope="session")
def fed_data_two(tmp_path_factory) -> tuple[Path, list[Path]]:
    """Two sites: what a federation test needs when no site leaves (each site is a process of ~10 CPU-s)."""
    from engine.data.synth import generate_federation

    root = tmp_path_factory.mktemp("fed-data-two")
    return root, generate_federation("fundus", 2, root, image_size=32, seed=0)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Path:
    """A federation CA, the coordinator's certificate, and key pairs for site1..site7 (site5's is never
    enrolled: the key of an impostor)."""
    from engine.security import certs

    root = tmp_path_factory.mktemp("pki")
    certs.create_ca(root)
    certs.create_server_certificate(root, root, ["127.0.0.1"])
    for k in range(1, 8):
        certs.create_site_keys(f"site{k}", root)
    return root


@pytest.fixture(scope="session")
def simulated_supermodel(fed_data_two, tmp_path_factory) -> Path:
    """``fedsm simulate`` with the settings of :data:`TRAINING` on the two sites of :func:`fed_data_two`."""
    from engine import api

    data_dir, _ = fed_data_two
    out = tmp_path_factory.mktemp("simulated")
    # keep_best off: a network run keeps its last round (the coordinator holds no validation data)
    api.simulate(out, task="fundus", sites=2, rounds=TRAINING["rounds"], methods=("fedsm",),
                 image_size=TRAINING["image_size"], seed=TRAINING["seed"], device="cpu", data_dir=str(data_dir),
                 keep_best=False, selector_width=TRAINING["selector_width"])
    return out / "supermodel.safetensors"


@pytest.fixture(scope="session")
def simulated_plugin_method(fed_data_two, tmp_path_factory) -> Path:
    """``fedsm simulate`` of the plugin's method with the settings of :data:`PLUGIN_TRAINING` (one model)."""
    from engine import api

    data_dir, _ = fed_data_two
    out = tmp_path_factory.mktemp("simulated-plugin")
    with plugin_installed() as method:
        api.simulate(out, task="fundus", sites=2, rounds=PLUGIN_TRAINING["rounds"], methods=(method,),
                     image_size=PLUGIN_TRAINING["image_size"], seed=PLUGIN_TRAINING["seed"], device="cpu",
                     data_dir=str(data_dir), keep_best=False)
    return out / f"{PLUGIN_TRAINING['method']}.safetensors"
