"""The simulated demo site: its event stream, and Join/Leave from the panel through QProcess."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest

from engine.federation.demo_site import DEMO_SELECTOR_WARMUP, run_demo_site
from engine.federation.events import EVENT_KINDS

#: Keys each event kind must carry (the ``fedsm site --json`` schema the panel reads).
REQUIRED = {
    "status": {"message"}, "connected": {"coordinator"}, "round_start": {"round", "rounds", "method"},
    "received": {"round", "rounds", "method", "bytes", "contents"},
    "batch": {"round", "batch", "batches", "loss", "method"}, "metrics": {"round", "loss", "dice"},
    "sent": {"round", "bytes", "contents"}, "round_end": {"round", "rounds", "wall_s"}, "finished": {"rounds"},
}


@pytest.fixture(scope="module")
def site_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared by the tests here, so the synthetic sites are written once."""
    return tmp_path_factory.mktemp("demo-site")


def test_demo_site_reports_one_sites_real_traffic(site_workdir):
    from engine.bundle.supermodel import DEFAULT_SELECTOR_WIDTH
    from engine.fl.selector_training import initial_optimizer_state
    from engine.fl.weights import payload_bytes
    from engine.fl.wire_precision import encode_down
    from engine.models import build_segmentation_net, build_selector

    events: list[dict] = []
    assert run_demo_site(site_workdir, site="site2", rounds=1, image_size=32, emit=events.append) == 0
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["status", "connected"] and kinds[-1] == "finished"
    assert set(kinds) <= set(EVENT_KINDS)
    for event in events:
        assert REQUIRED.get(event["event"], set()) <= set(event), event
    # round 1 trains (FedSM with its default rule, APFL: the global U-Net and the selector travel, with the
    # selector's Adam moments; APFL's private model stays at the site), round 2 evaluates the final models
    # on the site's validation data and sends the two Dice values and, once, the site's personalized model
    received = [e for e in events if e["event"] == "received"]
    sent = [e for e in events if e["event"] == "sent"]
    assert [e["round"] for e in received] == [1, 2] and [e["round"] for e in sent] == [1, 2]
    def on_wire(weights):  # float32 tensors travel in 16 bits (engine.fl.wire_precision), integers as they are
        return payload_bytes(encode_down({"p": weights}, {"p"})["p"])

    unet = on_wire(build_segmentation_net(3, 2).state_dict())
    selector = on_wire(build_selector(3, 3, "gap", DEFAULT_SELECTOR_WIDTH).state_dict())
    moments = on_wire(initial_optimizer_state(build_selector(3, 3, "gap", DEFAULT_SELECTOR_WIDTH)))
    assert received[0]["bytes"] == unet + selector + moments
    assert set(received[0]["contents"]) == {"global", "selector", "selector_optim"}
    assert set(received[1]["contents"]) == {"global", "selector"}
    assert set(sent[0]["contents"]["tensors"]) == {"global", "selector", "selector_optim"}
    assert set(sent[1]["contents"]["tensors"]) == {"personal"} and sent[1]["bytes"] >= unet
    assert {"val_dice_global", "val_dice_personal"} <= set(sent[1]["contents"]["metrics"])
    assert sent[0]["contents"]["num_examples"] > 0
    metrics = [e for e in events if e["event"] == "metrics" and e["round"] == 1]
    assert len(metrics) == 1 and set(metrics[0]["dice"]) == {"global", "personalized", "local"}
    assert all(0.0 <= v <= 1.0 for v in metrics[0]["dice"].values())
    batches = [e for e in events if e["event"] == "batch"]
    assert batches and batches[-1]["batch"] == batches[-1]["batches"]


def test_demo_site_stops_cleanly_when_cancelled(site_workdir):
    events: list[dict] = []
    code = run_demo_site(site_workdir, site="site1", rounds=3, image_size=32, emit=events.append,
                         cancel=lambda: any(e["event"] == "batch" for e in events))
    assert code == 0
    assert events[-1] == {**events[-1], "event": "disconnected", "reconnecting": False}
    assert not any(e["event"] == "finished" for e in events)


def test_demo_site_refuses_an_unknown_site(site_workdir):
    from engine.errors import FedSMError

    with pytest.raises(FedSMError, match="site9"):
        run_demo_site(site_workdir, site="site9", rounds=1, image_size=32, emit=lambda e: None)


def test_the_apps_demo_site_warms_the_selector_up(site_workdir, monkeypatch):
    import engine.federation.demo_site as demo_site

    calls = []
    monkeypatch.setattr(demo_site, "run_demo_site", lambda *args, **kwargs: calls.append((args, kwargs)) or 0)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:  # the command line the app's Join runs (demo_site_command) with its defaults
        assert demo_site.main(demo_site.demo_site_command(site_workdir, "site1", 3)[3:]) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert calls[0][1]["selector_warmup"] == DEMO_SELECTOR_WARMUP > 0


@pytest.mark.slow
def test_the_demo_federations_selector_loss_is_below_ln_k_beside_the_unets(site_workdir):
    events: list[dict] = []
    assert run_demo_site(site_workdir, site="site1", rounds=1, image_size=32, emit=events.append,
                         selector_warmup=DEMO_SELECTOR_WARMUP) == 0
    losses = {e["round"]: e["loss"] for e in events if e["event"] == "metrics" and e["loss"]}
    # the plotted value is the round's mean batch cross-entropy (the batches' own values, as the site saw them)
    for rnd, loss in losses.items():
        batches = [e["loss"]["selector"] for e in events
                   if e["event"] == "batch" and e["round"] == rnd and "selector" in e["loss"]]
        assert loss["selector"] == pytest.approx(sum(batches) / len(batches), abs=1e-4), rnd
    training = [rnd for rnd, loss in losses.items() if "global" in loss]
    assert training == [DEMO_SELECTOR_WARMUP + 1]
    ln_k = math.log(3)  # the loss of guessing among the 3 sites
    # where the plot shows it beside the U-Nets' losses, the selector tells the sites apart (site1 is the
    # smallest site: a selector that learned only the sites' sizes would score -ln(4/20) = 1.61 here)
    assert losses[training[0]]["selector"] < ln_k
    # and the warm-up shows it learning: above ln K after its first step, below by its last round
    assert losses[2]["selector"] > ln_k > losses[DEMO_SELECTOR_WARMUP]["selector"]


@pytest.mark.slow
def test_join_shows_live_progress_and_leave_stops_the_site(fedsm_app, qtbot, site_workdir):
    app = fedsm_app
    app.federation.demo_workdir = site_workdir
    app.federation.demo_rounds = 3
    panel = app.window.federation_panel
    panel.join_button.click()
    assert app.process.running and not panel.join_button.isEnabled()
    # site1 trains first in every round, so its first upload arrives early in round 1 (seconds
    # alone; minutes when other jobs keep the cores busy, hence the generous deadline)
    qtbot.waitUntil(lambda: any(e.direction == "sent" for e in app.federation_state.ledger), timeout=600_000)
    state = app.federation_state
    total = DEMO_SELECTOR_WARMUP + 3 + 1  # selector warm-up, training rounds, validation round
    assert state.status == "connected" and state.round == 1 and state.rounds == total
    assert panel.round_label.text() == f"Round 1 of {total}"
    assert panel.ledger.rowCount() >= 2 and panel.ledger.item(1, 1).text() == "↑ sent"
    assert "sample count" in panel.ledger.item(1, 3).text()
    # a warm-up round trains the selector alone: its loss is plotted, no U-Net and no Dice yet
    assert set(panel.loss_plot.series) == {"selector"} and not panel.dice_plot.series
    assert "train the model selector alone" in panel.log.toPlainText()
    assert "received" in panel.log.toPlainText() and "connected to in-process demo" in panel.log.toPlainText()
    assert panel.progress.maximum() >= 1
    panel.leave_button.click()
    qtbot.waitUntil(lambda: not app.process.running, timeout=120_000)
    assert state.status == "stopped" and panel.join_button.isEnabled()
    assert "disconnected (stopped by the operator (SIGTERM))" in panel.log.toPlainText()  # it left cleanly
    assert state.round < state.rounds  # it really left mid-run
