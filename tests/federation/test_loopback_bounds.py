"""End to end on 127.0.0.1 with every protection on: a site refuses a run beyond its [bounds], and an
operator declines one, before pulling.

Coordinator (in this process) and three ``fedsm site`` processes, TLS, enrolled keys, FedAvg,
one round at 32 px. site2's site.toml allows only FedSM: its SuperNode checks the run's signed
settings when the first message arrives and answers with an error without pulling a single
object of the payload (checked on every request the sites sent, as recorded by the fleet
listener). site3 runs with ``--confirm-runs`` and its operator declines: its SuperNode asks
before it pulls anything, refuses every message of the run unpulled, and the coordinator treats
it as absent (no final-evaluation wait). The round completes with site1, which shows the signed
settings to its operator and records the run's signed run id with Flower's run id (the one it
accepted; site2 and site3 record none).
"""

from __future__ import annotations

import time

import pytest
from fed_fixtures import fed_data, pki  # noqa: F401
from harness import CoordinatorThread, LoopbackFederation, Processes, wait_for

from engine.federation.events import read_events
from engine.federation.flower.fleet_listener import read_recorded

SITES = ["site1", "site2", "site3"]
TRAINING = {"task": "fundus", "method": "fedavg", "rounds": 1, "seed": 0, "image_size": 32, "batch_size": 4}


@pytest.mark.slow
def test_a_site_refuses_a_run_beyond_its_bounds_before_pulling_any_payload(fed_data, pki, tmp_path):  # noqa: F811
    from flwr.proto.message_pb2 import PullObjectRequest


    # Prepare
    _, datalists = fed_data
    fed = LoopbackFederation(tmp_path, pki, datalists, SITES, TRAINING, {"min_sites": 1, "round_timeout": 240})
    with fed.site_config("site2").open("a") as fh:
        fh.write('\n[bounds]\nallowed_methods = ["fedsm"]\n')
    sent_by_sites = tmp_path / "sent-by-sites"
    server = CoordinatorThread(fed, record_fleet=sent_by_sites)
    outcome = server.outcome
    procs = Processes()
    try:
        # Execute
        server.start()
        sites = [fed.start_site(procs, s) for s in SITES[:2]]
        sites.append(fed.start_site(procs, "site3", "--confirm-runs", stdin=b"decline\n"))
        wait_for(fed.site_events("site2"), lambda e: e["event"] == "error" and "allowed_methods" in e["message"],
                 400, sites)
        wait_for(fed.site_events("site3"), lambda e: e["event"] == "run_settings", 400, sites)
        declined_at = time.monotonic()
        server.join(timeout=400)
        assert not server.is_alive(), "the federation did not finish within 400 s"
        finished_after = time.monotonic() - declined_at
    finally:
        server.stop()
        procs.stop_all()

    # Assert: the round completed with site1; site2 refused with its reason
    assert "error" not in outcome, outcome.get("error")
    rounds = outcome["summary"]["rounds"]  # type: ignore[index]
    assert rounds[0]["answered"] == ["site1"]
    assert "allowed_methods" in rounds[0]["left_out"]["site2"]
    assert rounds[0]["left_out"]["site3"] == "its operator declined this run"
    # treated as absent: no final evaluation was asked of it, and nothing waited for it (round_timeout is 240 s)
    assert "site3" not in outcome["summary"].get("site_dice", {}) and finished_after < 120, finished_after
    site3 = read_events(fed.site_events("site3"))
    assert next(e for e in site3 if e["event"] == "run_settings")["confirm"] is True
    assert not any(e["event"] in ("received", "sent") for e in site3)
    site2 = read_events(fed.site_events("site2"))
    assert not any(e["event"] in ("received", "run_settings", "sent") for e in site2)
    shown = next(e for e in read_events(fed.site_events("site1")) if e["event"] == "run_settings")["settings"]
    assert shown["signed"] is True and shown["method"] == "fedavg" and shown["rounds"] == 1
    from engine.security.run_spec import RunLedger

    assert RunLedger(tmp_path / "work-site1" / "accepted-runs.json").flower_run(shown["run_id"]) is not None
    assert RunLedger(tmp_path / "work-site2" / "accepted-runs.json").flower_run(shown["run_id"]) is None
    # Assert: site2's node never pulled an object (the payload); site1's did
    nodes = {e["site"]: e["node"] for e in read_events(fed.server_events) if e["event"] == "connected"}
    pulled_by = [PullObjectRequest.FromString(body).node.node_id
                 for path, body in read_recorded(sent_by_sites) if path.endswith("/pull-object")]
    assert nodes["site1"] in pulled_by
    assert nodes["site2"] not in pulled_by
    assert nodes["site3"] not in pulled_by  # the operator declined before a byte of the payload came down
