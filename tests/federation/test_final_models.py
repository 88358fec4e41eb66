"""The end of a dialogue run: each site receives its final models once and writes a bundle it can open.

# Prepare: two synthetic sites on real files, the real ClientApp behind a FakeGrid (every message
#          serialised as on the wire), BlackFed v2 and FedIOD at 32 px with tiny settings.
# Execute: the coordinator's DialogueRunner.run (rounds, then the end-of-run message), write_results.
# Assert: each site's bundle holds its own client net (the one it trained) with the server net the
#         coordinator stored after its turn (FedIOD: the student), opens in fedsm infer's code path,
#         and the message is in both ledgers with the same byte count; the coordinator's FedIOD
#         student is a single-model bundle; a final message with an undeclared part or NaN is
#         refused and nothing is written.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fakegrid import FakeGrid, workers_for

from engine.errors import WeightsError
from engine.federation.events import EventWriter
from engine.federation.flower import records
from engine.federation.flower.dialogue import FINAL_ACTION, DialogueRunner, receive_final, site_bundle_path
from engine.federation.flower.server import write_results
from engine.federation.flower.server_app import RegisteredSites, RoundSettings
from engine.federation.spec import MethodSpec, build_method

SITES = ("site1", "site2")
SESSION = "session1"
APP = "sha256:" + "0" * 64


@pytest.fixture(scope="module")
def datalists(tmp_path_factory):
    from engine.data.synth import generate_federation

    return generate_federation("fundus", 2, tmp_path_factory.mktemp("data"), image_size=32, seed=0)


def _run(spec, datalists, tmp_path, consent=True):
    site_events: list[dict] = []
    workers = workers_for(datalists, tmp_path, site_events)
    for w in workers.values():
        w.cfg = dataclasses.replace(w.cfg, share_activations=consent)
    grid = FakeGrid(workers)
    events: list[dict] = []
    runner = DialogueRunner(build_method(spec, "cpu"), spec,
                            RoundSettings(min_sites=1, round_timeout=30.0, start_timeout=2.0, poll_interval=0.01),
                            RegisteredSites({w.cfg.name: n for n, w in workers.items()}),
                            EventWriter("server", listener=events.append), tmp_path / "ckpt.safetensors", SESSION,
                            APP)
    state = runner.run(grid)
    return runner, state, workers, events, site_events


def _final_ledgers(name, events, site_events):
    sent = [e for e in events if e["event"] == "sent" and e.get("final") and e["site"] == name]
    received = [e for e in site_events if e["event"] == "received" and e.get("final") and e["site"] == name]
    return sent, received


@pytest.mark.slow
def test_a_blackfed_site_writes_its_client_net_with_its_server_net(datalists, tmp_path):
    from engine.bundle.split import load_split_bundle
    from engine.inference.study import load_predictor

    spec = MethodSpec(method="blackfed-v2", task="fundus", site_names=SITES, rounds=1, image_size=32, batch_size=4,
                      options={"blackfed_client_epochs": 1, "blackfed_server_epochs": 1,
                               "blackfed_perturbations": 1})
    runner, state, workers, events, site_events = _run(spec, datalists, tmp_path)
    summary = write_results(type("Cfg", (), {"spec": spec, "work_dir": tmp_path})(), runner.method, state,
                            runner.history, SESSION, APP, None, runner.final_delivery)

    assert summary["final_models"] == {s: {"delivered": True, "bytes": summary["final_models"][s]["bytes"],
                                           "parts": ["server"]} for s in SITES}
    # v2: each site gets the copy of g stored after its own turn, and the two differ
    assert any(not torch.equal(state["server/site1"][k], state["server/site2"][k]) for k in state["server/site1"])
    for worker in workers.values():
        name = worker.cfg.name
        path = site_bundle_path(worker.cfg.work_dir, "blackfed-v2", SESSION)
        bundle = load_split_bundle(path)
        assert bundle.metadata.site_names == [name] and bundle.metadata.server == "per-site"
        trained = next(iter(worker._dialogue_runtimes.values())).state["blackfed_client"]
        assert all(torch.equal(bundle.clients[name][k], trained[k]) for k in trained)
        server = bundle.server_for(name)
        assert set(server) == set(state[f"server/{name}"])
        assert all(torch.equal(server[k], state[f"server/{name}"][k]) for k in server)
        # the message is in both ledgers, with the same bytes, once
        sent, received = _final_ledgers(name, events, site_events)
        assert len(sent) == len(received) == 1 and sent[0]["bytes"] == received[0]["bytes"] > 1_000_000
        assert received[0]["bytes"] == summary["final_models"][name]["bytes"]
        assert "server net" in received[0]["contents"]["tensors"]["server"]
        status = next(e for e in site_events if e["event"] == "status" and e["site"] == name and "bundle" in e)
        assert status["bundle"] == str(path) and f"--site {name}" in status["message"]
        # fedsm infer's code path opens it and segments as the site's client net, then its server net
        loaded = load_predictor(path, "cpu")
        assert loaded.predictor.metadata.model_names == [name]


@pytest.mark.slow
def test_a_fediod_site_and_the_coordinator_keep_the_student(datalists, tmp_path):
    from engine.bundle import load_bundle

    spec = MethodSpec(method="fediod", task="fundus", site_names=SITES, rounds=1, image_size=32, batch_size=4,
                      options={"fediod_steps": 1, "fediod_batch": 2, "fediod_teacher_epochs": 1,
                               "fediod_teacher_patience": 1})
    runner, state, workers, events, site_events = _run(spec, datalists, tmp_path, consent=False)
    summary = write_results(type("Cfg", (), {"spec": spec, "work_dir": tmp_path})(), runner.method, state,
                            runner.history, SESSION, APP, None, runner.final_delivery)

    assert summary["files"]["student"] == "student.safetensors"
    coordinator = load_bundle(tmp_path / "student.safetensors")
    assert coordinator.metadata.method == "fediod" and coordinator.metadata.routing == "none"
    for worker in workers.values():
        name = worker.cfg.name
        assert summary["final_models"][name]["delivered"] is True
        bundle = load_bundle(site_bundle_path(worker.cfg.work_dir, "fediod", SESSION))
        assert bundle.metadata.method == "fediod" and bundle.metadata.extra["assembled_at"] == name
        assert set(bundle.metadata.extra["epsilon"]) == {name}  # only its own privacy figure
        for key, value in state["student"].items():
            assert torch.equal(bundle.global_weights[key], value)
            assert torch.equal(coordinator.global_weights[key], value)
        sent, received = _final_ledgers(name, events, site_events)
        assert len(sent) == len(received) == 1 and sent[0]["bytes"] == received[0]["bytes"] > 1_000_000


def test_a_final_message_with_an_undeclared_part_or_nan_is_refused(datalists, tmp_path):
    from engine.fl.methods import SiteInstructions

    spec = MethodSpec(method="fediod", task="fundus", site_names=SITES, rounds=1, image_size=32)
    method = build_method(spec, "cpu")
    worker = next(iter(workers_for(datalists[:1], tmp_path).values()))
    student = method.initial_state()["student"]

    def message(parts):
        content = records.encode_instructions(SiteInstructions(1, parts, {"phase": FINAL_ACTION}), rounds=1,
                                              method="fediod", spec_json=spec.to_json(), session=SESSION,
                                              site="site1")
        content.config_records[records.INFO]["action"] = FINAL_ACTION
        return content

    with pytest.raises(WeightsError, match="declares"):
        receive_final(worker, message({"student": student, "generator": method.initial_state()["generator"]}))
    broken = {k: v.clone() for k, v in student.items()}
    first_float = next(k for k, v in broken.items() if v.dtype.is_floating_point)
    broken[first_float].view(-1)[0] = float("nan")
    with pytest.raises(WeightsError, match="NaN"):
        receive_final(worker, message({"student": broken}))
    shrunk = {k: v[..., :1] if v.dim() == 4 else v for k, v in student.items()}
    with pytest.raises(WeightsError, match="does not fit"):
        receive_final(worker, message({"student": shrunk}))
    assert not site_bundle_path(worker.cfg.work_dir, "fediod", SESSION).exists()
