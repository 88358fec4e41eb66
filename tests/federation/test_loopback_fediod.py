"""FedIOD end to end on 127.0.0.1 with TLS and site authentication, through the dialogue transport.

Two ``fedsm site`` processes and the coordinator run one FedIOD round (teachers, then two
distillation steps of two exchanges each); the test checks that

- the coordinator's final student and generator equal ``fedsm simulate``'s on the same data with
  the same seed (max abs difference <= 1e-5, DP off): the transport is faithful;
- every message the sites sent (recorded at the SuperLink's fleet listener) carries only FedIOD's
  declared tensors (label frequencies, logits, discriminator scores, input gradients), never a
  weight or an image of the site;
- the sites' ledgers say what each tensor they sent is.
"""

from __future__ import annotations

import pytest
from fed_fixtures import fed_data, pki  # noqa: F401
from harness import CoordinatorThread, LoopbackFederation, Processes, dialogue_replies, wait_for

from engine.federation.events import read_events
from engine.federation.flower.fleet_listener import read_recorded
from engine.federation.flower.processes import free_port

SITES = ["site1", "site2"]
OPTIONS = {"fediod_steps": 2, "fediod_batch": 2, "fediod_teacher_epochs": 1, "fediod_teacher_patience": 1}
DECLARED = {"label_frequency", "logits", "scores", "input_grad"}


@pytest.mark.slow
def test_fediod_over_secure_loopback_matches_the_simulation(fed_data, pki, tmp_path):  # noqa: F811
    from engine.federation.checkpoint import load_weightset

    # Prepare
    _, datalists = fed_data
    training = {"task": "fundus", "method": "fediod", "rounds": 1, "seed": 0, "image_size": 32, "batch_size": 4,
                **OPTIONS}
    fed = LoopbackFederation(tmp_path, pki, datalists[:2], SITES, training, {"superlink_port": free_port()})
    sent_by_sites = tmp_path / "sent-by-sites"
    server = CoordinatorThread(fed, record_fleet=sent_by_sites)
    outcome = server.outcome
    procs = Processes()
    try:
        # Execute
        server.start()
        sites = [fed.start_site(procs, s) for s in SITES]
        wait_for(fed.server_events, lambda e: e["event"] == "round_start", 180, [server, *sites])
        server.join(timeout=420)
        assert not server.is_alive(), "the federation did not finish within 420 s"
        assert "error" not in outcome, outcome.get("error")
    finally:
        server.stop()
        procs.stop_all()

    # Assert: the same student and generator as the simulation
    network, _ = load_weightset(fed.work / "server.safetensors", "fedsm-server-state")
    simulated = simulate(datalists[:2], training, tmp_path / "simulated")
    worst = max(float((network[p][k].double() - simulated[p][k].double()).abs().max())
                for p in ("student", "generator") for k in simulated[p])
    assert worst <= 1e-5
    # Assert: what the sites sent, as recorded on the wire, and their ledgers
    check_uploads_are_declared(read_recorded(sent_by_sites))
    for site in SITES:
        sent = [e for e in read_events(fed.site_events(site)) if e["event"] == "sent" and "action" in e]
        assert {e["action"] for e in sent} == {"setup", "query", "gradient"}
        for e in sent:
            assert set(e["contents"]["tensors"]) <= DECLARED
        assert any("w.r.t. the generated images only" in e["contents"]["tensors"].get("input_grad", "")
                   for e in sent)


def simulate(datalists, training, out) -> dict:
    """The simulation's server state after the round: ``fedsm simulate``'s code path on the same two sites."""
    from engine.data.site_data import load_site
    from engine.simulate import Simulation, SimulationConfig
    from engine.tasks import FUNDUS

    cfg = SimulationConfig(task="fundus", sites=2, rounds=training["rounds"], methods=("fediod",),
                           image_size=training["image_size"], seed=training["seed"],
                           batch_size=training["batch_size"], device="cpu", options=dict(OPTIONS))
    sim = Simulation(cfg, out)
    sim.sites = [load_site(p, FUNDUS, training["image_size"]) for p in datalists]
    states: list[dict] = []
    sim.round_hook = lambda method, rnd, state, runtimes: states.append(state)
    sim.run_exchange_method("fediod")
    return states[-1]


def check_uploads_are_declared(requests: list[tuple[str, bytes]]) -> None:
    """Rebuild every message the sites sent; answers hold FedIOD's declared tensors only, no weight-shaped one."""
    from engine.fl.fediod_nets import PatchDiscriminator
    from engine.models import build_segmentation_net

    params = {tuple(p.shape) for net in (build_segmentation_net(3, 2), PatchDiscriminator(3)) for p in net.parameters()}
    seen: set[str] = set()
    for tensors in dialogue_replies(requests):
        assert set(tensors) <= DECLARED
        frequency = tensors.pop("label_frequency", None)  # (labels,): as small as a bias, checked by value
        if frequency is not None:
            assert frequency.shape == (2,) and bool(((frequency >= 0) & (frequency <= 1)).all())
            seen.add("label_frequency")
        assert all(tuple(t.shape) not in params for t in tensors.values())
        seen |= set(tensors)
    assert seen == DECLARED
