"""End to end on 127.0.0.1: a modified site cannot take over, stall or crash the coordinator (issue 16).

# Prepare: a ``fedsm server`` process, two honest ``fedsm site`` processes and one modified site
#          (tests/federation/modified_site.py: the real site whose training replies are altered),
#          TLS and enrolled keys; FedSM, 4 training rounds + calibration, 32 px. The coordinator's
#          per-reply limit is set low ([robust] max_reply_mb = 64; the product default is the
#          method's largest legitimate reply x2 + 16 MiB, at least 128 MiB: upload_limits.reply_limit_for)
#          so that the oversized reply needs 80 MiB, not 600 MB, of memory; the path is the same.
# Execute: one run; site3 attacks once per round: x1e6 update, 10^12 samples, a [2^32, 2^32]
#          layout, a stats-only FedSM reply, and (calibration round) an upload above the limit.
# Assert: each attack is rejected with an error event naming site3 and the reason; every round
#         completes with site1 and site2; the oversized reply is refused by the SuperLink before the
#         coordinator pulls it; the coordinator process runs to the end and exits 0; the global
#         model equals (Dice within 0.01) the same run without site3 (site1 and site2 alone,
#         in-process over FakeGrid).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fakegrid import FakeGrid, workers_for
from fed_fixtures import fed_data, pki  # noqa: F401
from harness import LoopbackFederation, Processes, wait_for
from modified_site import ENV, OVERSIZE_ENV

from engine.federation.events import EventWriter, read_events

SITES = ["site1", "site2", "site3"]
TRAINING = {"task": "fundus", "method": "fedsm", "rounds": 4, "seed": 0, "image_size": 32,
            "selector_calibration": "lda", "selector_width": 16,  # replies of ~15 MB (no selector optimizer state)
            "personalization": "softpull"}  # the attacks drop or forge the personalized model sent every round
#: round -> what site3 does to its honest reply (round 5 is FedSM's calibration round)
ATTACKS = {1: "scale", 2: "count", 3: "layout", 4: "stats_only", 5: "oversize"}
REASONS = {"scale": "times its norm, above [robust] max_relative_update",
           "count": "claims 1000000000000 training samples",
           "layout": "(4294967296,4294967296)", "stats_only": "cannot use it",
           "oversize": "exceeds the coordinator's limit of 67108864 bytes"}


@pytest.mark.slow
def test_a_modified_site_is_left_out_of_every_round_it_attacks(fed_data, pki, tmp_path, monkeypatch):  # noqa: F811

    # Prepare
    _, datalists = fed_data
    fed = LoopbackFederation(tmp_path, pki, datalists, SITES, TRAINING,
                             {"min_sites": 2, "round_timeout": 120, "round_attempts": 1})
    with fed.config.open("a") as fh:
        fh.write("\n[robust]\nmax_reply_mb = 64\n")
    monkeypatch.setenv(ENV, ",".join(f"{r}={a}" for r, a in ATTACKS.items()))
    monkeypatch.setenv(OVERSIZE_ENV, "80")
    procs = Processes()
    try:
        # Execute
        server = fed.start_server(procs)
        sites = [fed.start_site(procs, s) for s in SITES[:2]]
        sites.append(procs.start([sys.executable, str(Path(__file__).with_name("modified_site.py")), "--config",
                                  str(fed.site_config("site3")), "--json"], tmp_path / "site3.out"))
        wait_for(fed.server_events, lambda e: e["event"] == "finished", 400, [server, *sites])
        assert all(p.poll() is None for p in sites), "a site exited during the run"
        server.wait(timeout=60)
    finally:
        procs.stop_all()

    # Assert: the coordinator ran to the end
    assert server.returncode == 0, (tmp_path / "server.out").read_text()[-3000:]
    events = read_events(fed.server_events)
    ends = {e["round"]: e for e in events if e["event"] == "round_end"}
    assert sorted(ends) == [1, 2, 3, 4, 5]
    for rnd, kind in ATTACKS.items():
        # Assert: each attack rejected, named, and the round completed with the honest sites
        assert ends[rnd]["answered"] == ["site1", "site2"], (rnd, ends[rnd])
        assert REASONS[kind] in ends[rnd]["left_out"]["site3"], (rnd, ends[rnd]["left_out"])
        assert any(e["event"] == "error" and e.get("site") == "site3" and e.get("round") == rnd
                   and REASONS[kind] in e["message"] for e in events), (rnd, kind)
    # Assert: the oversized reply was refused by the SuperLink, and never received by the coordinator
    assert "FEDSM-REFUSED-REPLY" in (fed.work / "superlink.log").read_text()
    assert not any(e["event"] == "received" and e.get("site") == "site3" and e.get("round") == 5 for e in events)
    # Assert: the global model is the one site1 and site2 make without site3
    check_same_global_model_as_without_site3(fed, datalists, tmp_path)


def check_same_global_model_as_without_site3(fed: LoopbackFederation, datalists: list[Path], tmp_path: Path) -> None:
    from engine.bundle import load_bundle
    from engine.data.site_data import load_site
    from engine.federation.config import load_federation_config
    from engine.federation.flower.server_app import FederationRunner, RegisteredSites, RoundSettings
    from engine.federation.spec import build_method
    from engine.tasks import get_task

    spec = load_federation_config(fed.config).spec
    workers = workers_for(datalists[:2], tmp_path / "reference")
    runner = FederationRunner(build_method(spec, "cpu"), spec,
                              RoundSettings(min_sites=2, round_timeout=60, start_timeout=0.1, round_attempts=1,
                                            poll_interval=0.01),
                              RegisteredSites({w.cfg.name: node for node, w in workers.items()}),
                              EventWriter("server", listener=lambda e: None), tmp_path / "reference.safetensors",
                              "reference", "sha256:" + "0" * 64)
    runner.keep_checkpoints = None
    expected = runner.run(FakeGrid(workers))["global"]
    got = load_bundle(fed.work / "supermodel.safetensors").global_weights
    assert set(got) == set(expected)
    worst = max(float((got[k].double() - expected[k].double()).abs().max()) for k in got)
    task = get_task("fundus")
    for k, datalist in enumerate(datalists[:2]):
        val = load_site(datalist, task, 32, name=f"site{k + 1}").validation
        dice_got, dice_expected = _dice(task, got, val), _dice(task, expected, val)
        print(f"site{k + 1} validation Dice of the global model: with site3 {dice_got:.4f}, "
              f"without {dice_expected:.4f}; max abs weight difference {worst:.2e}")
        assert abs(dice_got - dice_expected) <= 0.01, worst
    assert worst <= 1e-4, worst  # the same weights, up to float summation order


def _dice(task, weights, split) -> float:
    from engine.fl.evaluation import dice_per_case, segment_with

    return float(dice_per_case(segment_with(task, weights, split.images, "cpu"), split.masks > 0.5,
                               split.case_ids).mean())

