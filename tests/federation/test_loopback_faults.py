"""End to end on 127.0.0.1: a coordinator killed and resumed, a site killed mid-round, an app a site never approved.

Every ``fedsm server`` and ``fedsm site`` here is a real process, killed with SIGKILL where the
test says so; all are stopped by PID at the end.
"""

from __future__ import annotations

import pytest
from fed_fixtures import TRAINING, fed_data, pki, simulated_supermodel  # noqa: F401
from harness import LoopbackFederation, Processes, max_abs_difference, wait_for

from engine.federation.events import read_events

SITES = ["site1", "site2", "site3"]


@pytest.mark.slow
def test_killed_coordinator_resumes_to_the_weights_of_an_uninterrupted_run(
        fed_data, pki, simulated_supermodel, tmp_path):  # noqa: F811
    # Prepare
    _, datalists = fed_data
    fed = LoopbackFederation(tmp_path, pki, datalists, SITES, TRAINING)
    procs = Processes()
    try:
        # Execute: kill the coordinator once round 1 is checkpointed, then resume it
        server = fed.start_server(procs)
        sites = [fed.start_site(procs, s) for s in SITES]
        wait_for(fed.server_events, lambda e: e["event"] == "checkpoint" and e["round"] == 1, 240, [server, *sites])
        procs.kill(server)
        resumed = fed.start_server(procs, resume=True)
        wait_for(fed.server_events, lambda e: e["event"] == "finished", 300, [resumed])
        assert resumed.wait(timeout=60) == 0
    finally:
        procs.stop_all()

    # Assert: the resumed run ends where the simulation (= an uninterrupted run, same seeds) ends
    assert max_abs_difference(fed.work / "supermodel.safetensors", simulated_supermodel) <= 1e-5
    events = read_events(fed.server_events)
    assert any(e["event"] == "status" and e["message"] == "resuming after round 1 of 3" for e in events)
    resumed_at = next(i for i, e in enumerate(events) if e.get("message") == "resuming after round 1 of 3")
    assert [e["round"] for e in events[resumed_at:] if e["event"] == "round_end"] == [2, 3]
    for site in SITES:
        kinds = [e["event"] for e in read_events(fed.site_events(site))]
        assert "disconnected" in kinds and kinds.count("connected") >= 2  # lost the coordinator, came back
        assert kinds[-1] in ("finished", "round_end", "metrics", "disconnected")


@pytest.mark.slow
def test_site_killed_mid_round_is_left_out_and_returns_and_unapproved_app_is_refused(
        fed_data, pki, tmp_path):  # noqa: F811
    # Prepare: four sites; site4 pins another app hash than the one the coordinator runs
    _, datalists = fed_data
    sites = [*SITES, "site4"]
    training = {**TRAINING, "method": "fedavg", "rounds": 3}
    fed = LoopbackFederation(tmp_path, pki, datalists, sites, training,
                             {"min_sites": 2, "rejoin_wait": 120},
                             approved={"site4": "sha256:" + "0" * 64})
    procs = Processes()
    try:
        # Execute: kill site3 as its round-2 instructions go out; start it again once round 2 is over
        server = fed.start_server(procs)
        running = {s: fed.start_site(procs, s) for s in sites}
        wait_for(fed.server_events, lambda e: e["event"] == "sent" and e["site"] == "site3" and e["round"] == 2,
                 240, [server, *running.values()])
        procs.kill(running["site3"])
        wait_for(fed.server_events, lambda e: e["event"] == "round_end" and e["round"] == 2, 120, [server])
        running["site3"] = fed.start_site(procs, "site3")
        wait_for(fed.server_events, lambda e: e["event"] == "finished", 180, [server])
        assert server.wait(timeout=60) == 0
    finally:
        procs.stop_all()

    # Assert
    ends = {e["round"]: e for e in read_events(fed.server_events) if e["event"] == "round_end"}
    assert ends[1]["answered"] == SITES
    assert ends[2]["answered"] == ["site1", "site2"] and "site3" in ends[2]["left_out"]
    assert ends[2]["wall_s"] < 120  # given up when its node disconnected, not at round_timeout (240 s)
    assert ends[3]["answered"] == SITES  # back after it reconnected
    for end in ends.values():
        assert "site4 refused app sha256:" in end["left_out"]["site4"]
        assert "not in approved_apps" in end["left_out"]["site4"]
    site4 = read_events(fed.site_events("site4"))
    assert any(e["event"] == "error" and "refused app" in e["message"] for e in site4)
    assert not any(e["event"] in ("received", "batch", "sent") for e in site4)  # nothing ran, nothing was sent
    site3 = read_events(fed.site_events("site3"))
    assert [e["round"] for e in site3 if e["event"] == "round_end"] == [1, 3]
