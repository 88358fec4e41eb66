"""A dialogue method (BlackFed) end to end on 127.0.0.1 with TLS and site authentication.

Two ``fedsm site`` processes and the coordinator run one BlackFed round; the test checks that

- the coordinator's final server state equals ``fedsm simulate``'s (Simulation.run_exchange_method)
  on the same data with the same seed (max abs difference <= 1e-5): the transport is faithful;
- every message the sites sent (recorded at the SuperLink's fleet listener) carries only the
  method's declared tensors (activations and masks), never a weight;
- everything the coordinator sent each site was loss scalars (the sites' ``received`` ledger),
  never a gradient or a weight; the sites' ``sent`` ledger names what each tensor is.
"""

from __future__ import annotations

import pytest
from fed_fixtures import fed_data, pki  # noqa: F401
from harness import CoordinatorThread, LoopbackFederation, Processes, dialogue_replies, wait_for

from engine.federation.events import read_events
from engine.federation.flower.fleet_listener import read_recorded
from engine.federation.flower.processes import free_port

SITES = ["site1", "site2"]
OPTIONS = {"blackfed_client_epochs": 1, "blackfed_server_epochs": 1, "blackfed_perturbations": 2}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["blackfed-v2"])
def test_dialogue_method_over_secure_loopback_matches_the_simulation(method, fed_data, pki, tmp_path):  # noqa: F811
    from engine.federation.checkpoint import load_weightset

    # Prepare
    _, datalists = fed_data
    training = {"task": "fundus", "method": method, "rounds": 1, "seed": 0, "image_size": 32, "batch_size": 4,
                **OPTIONS}
    fed = LoopbackFederation(tmp_path, pki, datalists[:2], SITES, training, {"superlink_port": free_port()})
    for site in SITES:  # the operators agreed that activations and masks leave their sites
        text = fed.site_config(site).read_text()
        fed.site_config(site).write_text(text.replace("[site]\n", "[site]\nshare_activations = true\n", 1))
    sent_by_sites = tmp_path / "sent-by-sites"
    server = CoordinatorThread(fed, record_fleet=sent_by_sites)
    outcome = server.outcome
    procs = Processes()
    try:
        # Execute
        server.start()
        sites = [fed.start_site(procs, s) for s in SITES]
        for _ in range(36):  # up to 180 s for the first round; a coordinator that died says why at once
            if "error" in outcome or not server.is_alive():
                break
            try:
                wait_for(fed.server_events, lambda e: e["event"] == "round_start", 5, sites)
                break
            except AssertionError as exc:
                if "exited with" in str(exc):
                    raise
        assert "error" not in outcome, outcome.get("error")
        server.join(timeout=300)
        assert not server.is_alive(), "the federation did not finish within 300 s"
        assert "error" not in outcome, outcome.get("error")
    finally:
        server.stop()
        procs.stop_all()

    # Assert: the same server state as the simulation
    network, _ = load_weightset(fed.work / "server.safetensors", "fedsm-server-state")
    simulated = simulate(method, datalists[:2], training, tmp_path / "simulated")
    assert sorted(network) == sorted(simulated) == ["server", "server/site1", "server/site2"]
    worst = max(float((network[p][k].double() - simulated[p][k].double()).abs().max())
                for p in simulated for k in simulated[p])
    assert worst <= 1e-5
    summary = outcome["summary"]
    assert summary["rounds"][0]["answered"] == SITES and summary["rounds"][0]["left_out"] == {}
    # Assert: what the sites sent, as recorded on the wire
    check_uploads_are_activations_and_masks(read_recorded(sent_by_sites))
    # Assert: the sites' ledgers
    for site in SITES:
        events = read_events(fed.site_events(site))
        received = [e for e in events if e["event"] == "received" and "action" in e]
        sent = [e for e in events if e["event"] == "sent" and "action" in e]
        assert received and len(sent) == len(received)
        for e in received:
            assert set(e["contents"]["tensors"]) <= {"losses"}
        assert any(e["contents"]["tensors"] for e in received)  # loss values did arrive
        for e in sent:
            assert set(e["contents"]["tensors"]) == {"activations", "masks"}
            assert "activations" in e["contents"]["tensors"]["activations"] and e["bytes"] > 0


def simulate(method: str, datalists, training, out) -> dict:
    """The simulation's server state: ``fedsm simulate``'s code path on the same two sites."""
    from engine.data.site_data import load_site
    from engine.simulate import Simulation, SimulationConfig
    from engine.tasks import FUNDUS

    cfg = SimulationConfig(task="fundus", sites=2, rounds=training["rounds"], methods=(method,),
                           image_size=training["image_size"], seed=training["seed"],
                           batch_size=training["batch_size"], device="cpu", options=dict(OPTIONS))
    sim = Simulation(cfg, out)
    sim.sites = [load_site(p, FUNDUS, training["image_size"]) for p in datalists]
    bundle = sim.run_exchange_method(method).extra["bundle"]
    return {"server": bundle.server, **{f"server/{s}": w for s, w in bundle.table.items()}}


def check_uploads_are_activations_and_masks(requests: list[tuple[str, bytes]]) -> None:
    """Rebuild every message the sites sent; answers to exchanges hold activations and masks only."""
    from engine.fl.blackfed_nets import build_client_net, build_server_net

    params = {tuple(p.shape) for net in (build_client_net(3, 16), build_server_net(16, 2)) for p in net.parameters()}
    answers = 0
    for tensors in dialogue_replies(requests):
        assert set(tensors) == {"activations", "masks"}
        assert tensors["activations"].shape[1] == 16 and tensors["activations"].shape[2:] == (32, 32)
        assert all(tuple(t.shape) not in params for t in tensors.values())
        answers += 1
    assert answers >= 2 * 2  # two sites, at least a client and a server exchange each
