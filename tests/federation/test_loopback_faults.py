"""End to end on 127.0.0.1: a coordinator killed and resumed; and in one federation a site killed mid-round,
an app a site never approved, a site whose key is not enrolled, a site that refuses a run beyond its
[bounds] and an operator who declines one (the last two before pulling a byte of the payload).

Every ``fedsm server`` and ``fedsm site`` here is a real process, killed with SIGKILL where the
test says so; all are stopped by PID at the end.
"""

from __future__ import annotations

import os

import pytest
import torch
from fed_fixtures import (  # noqa: F401
    PLUGIN_TRAINING,
    TRAINING,
    fed_data,
    fed_data_two,
    pki,
    simulated_plugin_method,
)
from harness import CoordinatorThread, LoopbackFederation, Processes, fedsm, max_abs_difference, wait_for
from testsupport import PLUGINS, plugin_installed

from engine.federation.checkpoint import Checkpoint
from engine.federation.events import read_events
from engine.federation.flower.fleet_listener import read_recorded
from engine.security.run_spec import RunLedger

SITES = ["site1", "site2", "site3"]
#: The coordinator's restart does not depend on how many sites wait for it: two are enough.
RESUMING_SITES = ["site1", "site2"]


@pytest.fixture
def plugin_in_this_process():
    """The plugin installed in the test's own process too: it reads the run's bundle."""
    with plugin_installed() as name:
        yield name


@pytest.mark.slow
def test_killed_coordinator_resumes_to_the_weights_of_an_uninterrupted_run(
        fed_data_two, pki, simulated_plugin_method, plugin_in_this_process, tmp_path):  # noqa: F811
    # Prepare: 3 rounds of the test-only weight method of tests/plugins, a FedAvg whose coordinator moves halfway,
    # installed as a plugin in every process (no product file names it). Killing and resuming the coordinator does
    # not depend on the method, and FedAvg's small replies keep this test short; that FedSM's whole state
    # (personalized models, selector and its optimizer moments) survives a resume is
    # tests/federation/test_server_app.py's resume test, over the wire format without the network
    _, datalists = fed_data_two
    fed = LoopbackFederation(tmp_path, pki, datalists, RESUMING_SITES, PLUGIN_TRAINING)
    procs = Processes(python_path=(PLUGINS,))
    try:
        # Execute: kill the coordinator once round 1 is checkpointed, then resume it
        server = fed.start_server(procs)
        sites = [fed.start_site(procs, s) for s in RESUMING_SITES]
        wait_for(fed.server_events, lambda e: e["event"] == "checkpoint" and e["round"] == 1, 240, [server, *sites])
        procs.kill(server)
        resumed = fed.start_server(procs, resume=True)
        wait_for(fed.server_events, lambda e: e["event"] == "finished", 300, [resumed])
        assert resumed.wait(timeout=60) == 0
    finally:
        procs.stop_all()

    # Assert: the resumed run ends where the simulation (= an uninterrupted run, same seeds) ends
    assert max_abs_difference(fed.work / "global.safetensors", simulated_plugin_method, global_only=True) <= 1e-5
    events = read_events(fed.server_events)
    assert f"{PLUGIN_TRAINING['method']}, 3 rounds" in events[0]["message"]  # the plugin's method ran
    assert any(e["event"] == "status" and e["message"] == "resuming after round 1 of 3" for e in events)
    resumed_at = next(i for i, e in enumerate(events) if e.get("message") == "resuming after round 1 of 3")
    assert [e["round"] for e in events[resumed_at:] if e["event"] == "round_end"] == [2, 3]
    for site in RESUMING_SITES:
        kinds = [e["event"] for e in read_events(fed.site_events(site))]
        assert "disconnected" in kinds and kinds.count("connected") >= 2  # lost the coordinator, came back
        assert kinds[-1] in ("finished", "round_end", "metrics", "disconnected")


@pytest.mark.slow
def test_site_killed_mid_round_is_left_out_keeps_its_model_and_returns_and_unapproved_app_is_refused(
        fed_data, pki, tmp_path):  # noqa: F811
    from flwr.proto.message_pb2 import PullObjectRequest

    # Prepare: FedSM with six sites (2 training rounds + calibration); site4 pins another app hash; site6's
    # site.toml allows FedAvg only; site7 runs with --confirm-runs and its operator declines; an impostor calls
    # itself site1 but holds site5's key, which the coordinator never enrolled
    _, datalists = fed_data
    sites = [*SITES, "site4", "site6", "site7"]
    # SoftPull: the server holds each site's personalized model between rounds, which is what a killed
    # site must keep (the default rule, APFL, builds them at the sites in the last round)
    fed = LoopbackFederation(tmp_path, pki, datalists, sites, {**TRAINING, "personalization": "softpull"},
                             {"min_sites": 2, "rejoin_wait": 120},
                             approved={"site4": "sha256:" + "0" * 64})
    with fed.site_config("site6").open("a") as fh:
        fh.write('\n[bounds]\nallowed_methods = ["fedavg"]\n')
    impostor_config = tmp_path / "impostor.toml"
    impostor_config.write_text(fed.site_config("site1").read_text().replace("site1.key", "site5.key")
                               .replace('"work-site1"', '"work-impostor"'))
    impostor_events = tmp_path / "work-impostor" / "events.jsonl"
    sent_by_sites = tmp_path / "sent-by-sites"
    server = CoordinatorThread(fed, record_fleet=sent_by_sites)
    procs = Processes()
    try:
        # Execute: kill site3 (SIGKILL, by PID) once it has received round 2 and started training on it
        server.start()
        running = {s: fed.start_site(procs, s) for s in sites if s != "site7"}
        running["site7"] = fed.start_site(procs, "site7", "--confirm-runs", stdin=b"decline\n")
        impostor = procs.start(fedsm("site", "--config", str(impostor_config), "--json"), tmp_path / "impostor.out")
        # the impostor is turned away when its SuperNode connects, as the sites connect and well before round
        # 1 ends; then it is stopped (it would retry with a back-off, each time a new SuperNode)
        refused = wait_for(impostor_events, lambda e: e["event"] == "disconnected", 240, [server])
        impostor.terminate()
        checkpoint = fed.work / "checkpoint.safetensors"
        wait_for(fed.server_events, lambda e: e["event"] == "checkpoint" and e["round"] == 1, 240,
                 [server, *running.values()])
        os.link(checkpoint, tmp_path / "after-round-1.safetensors")  # round 2 cannot end while site3 trains
        wait_for(fed.site_events("site3"), lambda e: e["event"] == "round_start" and e["round"] == 2, 240,
                 [server, *running.values()], poll=0.02)
        procs.kill(running["site3"])
        killed_events = read_events(fed.site_events("site3"))
        wait_for(fed.server_events, lambda e: e["event"] == "checkpoint" and e["round"] == 2, 120, [server])
        os.link(checkpoint, tmp_path / "after-round-2.safetensors")  # round 3 waits for site3 to rejoin
        running["site3"] = fed.start_site(procs, "site3")
        wait_for(fed.server_events, lambda e: e["event"] == "finished", 180, [server])
        server.join(timeout=60)
        assert not server.is_alive() and "error" not in server.outcome, server.outcome.get("error")
    finally:
        server.stop()
        procs.stop_all()

    # Assert: site3 really died mid-round: it had received round 2 and not answered it
    assert any(e["event"] == "received" and e["round"] == 2 for e in killed_events)
    assert not any(e["event"] == "sent" and e["round"] == 2 for e in killed_events)
    # ... the round went on without it, and gave it up when its node disconnected, not at round_timeout (240 s)
    ends = {e["round"]: e for e in read_events(fed.server_events) if e["event"] == "round_end"}
    assert ends[1]["answered"] == SITES
    assert ends[2]["answered"] == ["site1", "site2"] and "site3" in ends[2]["left_out"]
    reason = ends[2]["left_out"]["site3"]  # its node went offline (seen by the coordinator or by the SuperLink)
    assert "disconnected" in reason or "Node Unavailable" in reason, reason
    # ... and no round waited for a site that refused (round_timeout is 240 s)
    assert all(end["wall_s"] < 120 for end in ends.values()), [end["wall_s"] for end in ends.values()]
    # ... it was left out of round 2's aggregation and kept its personalized model, while the others' moved on
    after_round_1 = Checkpoint.load(tmp_path / "after-round-1.safetensors")
    after_round_2 = Checkpoint.load(tmp_path / "after-round-2.safetensors")
    assert after_round_1.round == 1 and after_round_2.round == 2
    unchanged = after_round_1.state["personal/site3"]
    assert all(torch.equal(after_round_2.state["personal/site3"][k], v) for k, v in unchanged.items())
    for site in ("site1", "site2"):
        assert any(not torch.equal(after_round_2.state[f"personal/{site}"][k], v)
                   for k, v in after_round_1.state[f"personal/{site}"].items())
    # ... and it was back in the next round
    assert ends[3]["answered"] == SITES
    site3 = read_events(fed.site_events("site3"))
    assert [e["round"] for e in site3 if e["event"] == "round_end"] == [1, 3]
    # Assert: site4 refused the app in every round, before its payload was pulled
    for end in ends.values():
        assert "site4 refused app sha256:" in end["left_out"]["site4"]
        assert "not in approved_apps" in end["left_out"]["site4"]
    site4 = read_events(fed.site_events("site4"))
    assert any(e["event"] == "error" and "refused app" in e["message"] for e in site4)
    assert not any(e["event"] in ("received", "batch", "sent") for e in site4)  # nothing ran, nothing was sent
    supernode_log = (tmp_path / "work-site4" / "supernode.log").read_text()
    assert "Received successfully" not in supernode_log  # the SuperNode never pulled a weight chunk
    # Assert: site6 refused the run beyond its bounds, and site7's operator declined it, in every round and
    # before their SuperNodes pulled anything
    for end in ends.values():
        assert "allowed_methods" in end["left_out"]["site6"]
        assert end["left_out"]["site7"] == "its operator declined this run"
    site6 = read_events(fed.site_events("site6"))
    assert any(e["event"] == "error" and "allowed_methods" in e["message"] for e in site6)
    assert not any(e["event"] in ("received", "run_settings", "sent") for e in site6)
    site7 = read_events(fed.site_events("site7"))
    assert next(e for e in site7 if e["event"] == "run_settings")["confirm"] is True
    assert not any(e["event"] in ("received", "sent") for e in site7)
    nodes = {e["site"]: e["node"] for e in read_events(fed.server_events) if e["event"] == "connected"}
    pulled_by = [PullObjectRequest.FromString(body).node.node_id
                 for path, body in read_recorded(sent_by_sites) if path.endswith("/pull-object")]
    assert nodes["site1"] in pulled_by
    assert nodes["site6"] not in pulled_by and nodes["site7"] not in pulled_by  # not a byte of the payload
    evaluated = [e["message"] for e in read_events(fed.server_events) if "final evaluation at" in e.get("message", "")]
    # the final evaluation asks every site but the one whose operator declined (site4 and site6 refuse at once)
    assert evaluated == ["final evaluation at 5 site(s): validation and testing Dice of the final models"], evaluated
    # Assert: site1 saw the signed settings and recorded the run it accepted; site6 recorded none
    shown = next(e for e in read_events(fed.site_events("site1")) if e["event"] == "run_settings")["settings"]
    assert shown["signed"] is True and shown["method"] == "fedsm" and shown["rounds"] == TRAINING["rounds"]
    assert RunLedger(tmp_path / "work-site1" / "accepted-runs.json").flower_run(shown["run_id"]) is not None
    assert RunLedger(tmp_path / "work-site6" / "accepted-runs.json").flower_run(shown["run_id"]) is None
    # Assert: the impostor was refused by the SuperLink with a reason that says what to do, and never got a task
    assert "not enrolled" in refused["reason"] and "fedsm enroll" in refused["reason"]
    assert not any(e["event"] in ("connected", "received", "round_start", "sent") for e in read_events(impostor_events))
    superlink_log = (fed.work / "superlink.log").read_text()
    assert "activate-node" in superlink_log and "ApiError:2004" in superlink_log
