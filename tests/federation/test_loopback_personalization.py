"""FedSM with a personalization rule other than SoftPull, over the network on 127.0.0.1 (TLS, site keys).

APFL is the rule family whose sites keep private state between rounds (the private model ``v``
and the mixing weight ``alpha``): a network site persists it in its work folder and reads it
back the next round, so the run can only equal the in-process simulation if nothing of that state
is lost between rounds. The test checks

- the super model equals ``fedsm simulate --personalization apfl`` with the same seeds (max abs
  difference <= 1e-5, global, selector and every site's personalized model);
- the bundle records the rule, and the routing guard's validation statistics came through;
- what left each site: no personalized model in a training round, one in the last round only.
"""

from __future__ import annotations

import pytest
from fed_fixtures import TRAINING, fed_data_two, pki  # noqa: F401
from harness import CoordinatorThread, LoopbackFederation, Processes, max_abs_difference, wait_for

from engine.federation.events import read_events

SITES = ["site1", "site2"]
#: One training round is enough: the last round reads the private state the site persisted after it.
APFL_TRAINING = {**TRAINING, "rounds": 1, "personalization": "apfl"}


@pytest.fixture(scope="module")
def simulated_apfl(fed_data_two, tmp_path_factory):  # noqa: F811
    """``fedsm simulate --personalization apfl`` with the settings of :data:`APFL_TRAINING` on the same data."""
    from engine import api

    data_dir, _ = fed_data_two
    out = tmp_path_factory.mktemp("simulated-apfl")
    api.simulate(out, task="fundus", sites=len(SITES), rounds=APFL_TRAINING["rounds"], methods=("fedsm",),
                 image_size=APFL_TRAINING["image_size"], seed=APFL_TRAINING["seed"], device="cpu",
                 data_dir=str(data_dir), keep_best=False, personalization="apfl",
                 selector_width=APFL_TRAINING["selector_width"])
    return out / "supermodel.safetensors"


@pytest.mark.slow
def test_apfl_federation_over_the_network_equals_the_simulation(fed_data_two, pki, simulated_apfl,  # noqa: F811
                                                                 tmp_path):
    # Prepare
    _, datalists = fed_data_two
    fed = LoopbackFederation(tmp_path, pki, datalists, SITES, APFL_TRAINING)
    server = CoordinatorThread(fed)
    procs = Processes()
    try:
        # Execute
        server.start()
        for site in SITES:
            fed.start_site(procs, site)
        server.join(timeout=420)
        assert not server.is_alive(), "the federation did not finish within 420 s"
        assert "error" not in server.outcome, server.outcome.get("error")
        for site in SITES:
            wait_for(fed.site_events(site), lambda e: e["event"] == "finished", 60)
    finally:
        server.stop()
        procs.stop_all()

    # Assert: the transport and the site's persisted private state are faithful
    assert max_abs_difference(fed.work / "supermodel.safetensors", simulated_apfl) <= 1e-5
    from engine.bundle import read_metadata

    meta, simulated = read_metadata(fed.work / "supermodel.safetensors"), read_metadata(simulated_apfl)
    assert meta.personalization == simulated.personalization == "apfl"
    assert all(meta.site_validation[s] == pytest.approx(simulated.site_validation[s]) for s in SITES)
    # Assert: APFL's private model stays at the site until the last round, which sends the mixture once
    for site in SITES:
        sent = {e["round"]: e["contents"]["tensors"] for e in read_events(fed.site_events(site))
                if e["event"] == "sent"}
        assert sorted(sent) == [1, 2]
        assert "personal" not in sent[1], sent
        assert sent[2].get("personal") == 63, sent[2]
        settings = next(e for e in read_events(fed.site_events(site)) if e["event"] == "run_settings")["settings"]
        assert settings["personalization"] == "apfl"
