"""The desktop app's Join takes part in a BlackFed and a FedIOD run and ends with a bundle ``fedsm infer`` opens.

# Prepare: a coordinator (TLS and site authentication on, 127.0.0.1 only) for two sites at 32 px,
#          one ``fedsm site`` process (site2), and site1 joined through the app's own controller and
#          federation panel (Qt offscreen; the site process under QProcess, as in the app). The
#          operator loads site1's site.toml, gives BlackFed's consent (or FedIOD's epsilon) in the
#          panel, presses Join and accepts the run's signed settings in the dialog.
# Execute: one round; the coordinator then sends each site its final models once.
# Assert: the app's site wrote its bundle (BlackFed: its client net with its server net; FedIOD:
#         the student), the panel shows its path and its ledger the final message's bytes, and
#         ``fedsm infer --model BUNDLE [--site site1]`` segments a photo with it. BlackFed also: the
#         coordinator's server state equals ``fedsm simulate``'s on the same data and seed (max abs
#         difference <= 1e-5: the transport is faithful); every message the sites sent, as recorded
#         at the SuperLink's fleet listener, holds activations and masks only, never a weight; the
#         coordinator sent each site loss values only until the final models (the sites' ledgers).
#         Every process the test started is stopped by its PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from fed_fixtures import fed_data, pki  # noqa: F401
from harness import ROOT, CoordinatorThread, LoopbackFederation, Processes, dialogue_replies, fedsm

from engine.federation.events import read_events
from engine.federation.flower.fleet_listener import read_recorded
from engine.federation.flower.processes import free_port

SITES = ["site1", "site2"]
BLACKFED = {"method": "blackfed-v2", "blackfed_client_epochs": 1, "blackfed_server_epochs": 1,
            "blackfed_perturbations": 2}
FEDIOD = {"method": "fediod", "fediod_steps": 2, "fediod_batch": 2, "fediod_teacher_epochs": 1,
          "fediod_teacher_patience": 1}
#: How long the app's site may take from Join to its bundle (a busy 2-core machine; the test's bound is 600 s).
RUN_TIMEOUT_MS = 400_000


def _consent_in(fed: LoopbackFederation, site: str) -> None:
    text = fed.site_config(site).read_text()
    fed.site_config(site).write_text(text.replace("[site]\n", "[site]\nshare_activations = true\n", 1))


def _join_from_the_app(qtbot, fed, procs, server, prepare_form):
    """Site1 joins through the app's controller and panel; returns (state, bundle path, process runner)."""
    from engine import api
    from fedsm_gui.controllers.federation import FederationController
    from fedsm_gui.models.federation import FederationState
    from fedsm_gui.views.federation_panel import FederationPanel
    from fedsm_gui.workers.process import QtProcessRunner
    from fedsm_gui.workers.tasks import QtTaskRunner

    panel = FederationPanel()
    qtbot.addWidget(panel)
    state, tasks, runner = FederationState(), QtTaskRunner(), QtProcessRunner()
    ctrl = FederationController(state, panel, tasks, runner, api)
    try:
        ctrl.load_config(str(fed.site_config("site1")))
        qtbot.waitUntil(lambda: state.setup.config_path != "", timeout=60_000)
        prepare_form(panel, ctrl)
        server.start()
        fed.start_site(procs, "site2")
        panel.join_button.click()
        qtbot.waitUntil(lambda: panel.run_dialog is not None or not runner.running, timeout=240_000)
        assert panel.run_dialog is not None, list(state.log)[-10:]
        panel.run_dialog.accept()  # the operator accepts the signed settings: the site starts training
        qtbot.waitUntil(lambda: bool(state.bundle) or not runner.running or "error" in server.outcome,
                        timeout=RUN_TIMEOUT_MS)
        assert state.bundle, (server.outcome.get("error"), list(state.log)[-15:])
        server.join(timeout=120)
        assert "error" not in server.outcome, server.outcome.get("error")
        qtbot.waitUntil(lambda: state.status == "finished", timeout=60_000)
        return state, state.bundle, runner
    finally:
        if panel.run_dialog is not None:
            panel.run_dialog.close()
        pid = runner.process.processId() if runner.process is not None else 0
        runner.stop(timeout_ms=3000)
        runner.wait(20_000)
        if pid and runner.running:  # never left running: stopped by its PID
            os.kill(pid, signal.SIGKILL)
        tasks.shutdown(20_000)


def _infer(bundle, photo, out, site=None) -> subprocess.CompletedProcess:
    argv = fedsm("infer", "--model", str(bundle), "--input", str(photo), "--out", str(out), "--device", "cpu",
                 *(["--site", site] if site else []))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return subprocess.CompletedProcess(argv, proc.returncode, output)


def _photo(datalists) -> str:
    import json
    from pathlib import Path

    doc = json.loads(Path(datalists[0]).read_text())
    return str(Path(datalists[0]).parent / doc["testing"][0]["image"])


BASE = {"task": "fundus", "rounds": 1, "seed": 0, "image_size": 32, "batch_size": 4}


def _run(qtbot, fed_data, pki, tmp_path, training, prepare_form, consent_site2=False):  # noqa: F811 (fixture values)
    _, datalists = fed_data
    fed = LoopbackFederation(tmp_path, pki, datalists[:2], SITES, {**BASE, **training},
                             {"superlink_port": free_port()})
    if consent_site2:
        _consent_in(fed, "site2")
    server = CoordinatorThread(fed, record_fleet=tmp_path / "sent-by-sites")
    procs = Processes()  # site2, stopped by its PID at the end
    started = time.monotonic()
    try:
        state, bundle, _ = _join_from_the_app(qtbot, fed, procs, server, prepare_form)
    finally:
        server.stop()
        procs.stop_all()
    return fed, state, bundle, time.monotonic() - started, datalists


@pytest.mark.slow
def test_the_app_joins_a_blackfed_run_and_opens_its_sites_bundle(qtbot, fed_data, pki, tmp_path):  # noqa: F811
    from engine.bundle.split import load_split_bundle
    from engine.federation.checkpoint import load_weightset

    def consent(panel, ctrl):
        panel.confirm_share_activations = lambda: True  # the operator confirms BlackFed's threat model
        panel.share_activations.click()

    fed, state, bundle, wall_s, datalists = _run(qtbot, fed_data, pki, tmp_path, BLACKFED, consent,
                                                 consent_site2=True)
    # the consent reached the site's own file (the site process reads nothing else)
    assert "share_activations = true" in fed.site_config("site1").read_text()
    split = load_split_bundle(bundle)
    assert split.metadata.site_names == ["site1"] and split.metadata.method == "blackfed-v2"
    server_state, _ = load_weightset(fed.work / "server.safetensors", "fedsm-server-state")
    assert all(bool((split.server_for("site1")[k] == server_state["server/site1"][k]).all())
               for k in server_state["server/site1"])
    final = [e for e in state.ledger if e.direction == "received" and "server" in e.contents.get("tensors", {})]
    assert len(final) == 1 and final[0].bytes > 1_000_000
    summary = (fed.work / "summary.json").read_text()
    assert '"delivered": true' in summary
    done = _infer(bundle, _photo(datalists), tmp_path / "masks", site="site1")
    assert done.returncode == 0, done.stdout
    assert "routed to site1" in done.stdout and list((tmp_path / "masks").glob("*.png"))
    # the transport is faithful: the coordinator ends where the simulation ends
    simulated = _simulated_blackfed(datalists[:2], tmp_path / "simulated")
    assert sorted(server_state) == sorted(simulated) == ["server", "server/site1", "server/site2"]
    worst = max(float((server_state[p][k].double() - simulated[p][k].double()).abs().max())
                for p in simulated for k in simulated[p])
    assert worst <= 1e-5
    # what the sites sent, as recorded on the wire, and what they say they received and sent
    _check_uploads_are_activations_and_masks(read_recorded(tmp_path / "sent-by-sites"))
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
    print(f"blackfed app join: {wall_s:.0f} s to the bundle, final message {final[0].bytes} bytes")


@pytest.mark.slow
def test_the_app_joins_a_fediod_run_and_opens_the_student(qtbot, fed_data, pki, tmp_path):  # noqa: F811
    from engine.bundle import load_bundle

    def epsilon(panel, ctrl):
        panel.fields["dp_epsilon"].setText("64")
        panel.fields["dp_epsilon"].textEdited.emit("64")  # as typed by the operator

    fed, state, bundle, wall_s, datalists = _run(qtbot, fed_data, pki, tmp_path, FEDIOD, epsilon)
    student = load_bundle(bundle)
    coordinator = load_bundle(fed.work / "student.safetensors")
    assert student.metadata.method == "fediod" and student.metadata.extra["assembled_at"] == "site1"
    assert all(bool((student.global_weights[k] == coordinator.global_weights[k]).all())
               for k in coordinator.global_weights)
    # the epsilon typed in the app reached the site: its gradients were noised and it knows what it spent
    assert student.metadata.extra["epsilon"]["site1"] is not None
    final = [e for e in state.ledger if e.direction == "received" and "student" in e.contents.get("tensors", {})]
    assert len(final) == 1 and final[0].bytes > 1_000_000
    done = _infer(bundle, _photo(datalists), tmp_path / "masks")
    assert done.returncode == 0, done.stdout
    assert list((tmp_path / "masks").glob("*.png"))
    print(f"fediod app join: {wall_s:.0f} s to the bundle, final message {final[0].bytes} bytes")


def _simulated_blackfed(datalists, out) -> dict:
    """The simulation's server state: ``fedsm simulate``'s code path on the same two sites."""
    from engine.data.site_data import load_site
    from engine.simulate import Simulation, SimulationConfig
    from engine.tasks import FUNDUS

    options = {k: v for k, v in BLACKFED.items() if k != "method"}
    cfg = SimulationConfig(task="fundus", sites=2, rounds=BASE["rounds"], methods=(BLACKFED["method"],),
                           image_size=BASE["image_size"], seed=BASE["seed"], batch_size=BASE["batch_size"],
                           device="cpu", options=options)
    sim = Simulation(cfg, out)
    sim.sites = [load_site(p, FUNDUS, BASE["image_size"]) for p in datalists]
    bundle = sim.run_exchange_method(BLACKFED["method"]).extra["bundle"]
    return {"server": bundle.server, **{f"server/{s}": w for s, w in bundle.table.items()}}


def _check_uploads_are_activations_and_masks(requests: list[tuple[str, bytes]]) -> None:
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
