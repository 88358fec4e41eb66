"""The federation panel's local progress bar: the round's batches while training, a final line once the run is over."""

from __future__ import annotations

import json
from types import SimpleNamespace
from unittest.mock import MagicMock

from gui_helpers import FakeProcess, SyncTaskRunner

from fedsm_gui.controllers.federation import FederationController
from fedsm_gui.models.federation import FederationState
from fedsm_gui.views.federation_panel import FederationPanel


def _line(kind: str, **fields) -> str:
    return json.dumps({"event": kind, "time": 1.0, "source": "site", "site": "site1", **fields})


def _joined(qtbot, tmp_path):
    panel = FederationPanel()
    qtbot.addWidget(panel)
    process = FakeProcess()
    api = SimpleNamespace(demo_site_command=MagicMock(return_value=["python", "-m", "demo"]),
                          app_hash=MagicMock(return_value="sha256:" + "0" * 64))
    state = FederationState()
    ctrl = FederationController(state, panel, SyncTaskRunner(), process, api, demo_workdir=tmp_path, demo_rounds=1)
    ctrl.join()
    return panel, process, state


def test_the_progress_bar_ends_on_a_final_line_not_on_the_last_rounds_batch(qtbot, tmp_path):
    panel, process, state = _joined(qtbot, tmp_path)
    # what the demo site prints for 1 training round and FedSM's validation round (no local batches)
    process.on_line(_line("connected", coordinator="in-process demo federation (3 sites)"))
    process.on_line(_line("round_start", round=1, rounds=2, method="fedsm"))
    assert panel.progress.text() == "round 1: no local training batch yet"
    process.on_line(_line("batch", round=1, batch=1, batches=2, loss={}, method="fedsm"))
    assert panel.progress.text() == "local batch 1 of 2" and panel.progress.value() == panel.progress.maximum() // 2
    process.on_line(_line("batch", round=1, batch=2, batches=2, loss={}, method="fedsm"))
    process.on_line(_line("round_end", round=1, rounds=2, wall_s=1.0))
    process.on_line(_line("round_start", round=2, rounds=2, method="fedsm"))
    assert "batch 0 of 1" not in panel.progress.text()
    process.on_line(_line("round_end", round=2, rounds=2, wall_s=1.0))
    process.on_line(_line("finished", rounds=2))
    process.exit(0)
    assert state.status == "finished"
    assert panel.progress.text() == "run finished: 2 rounds"
    assert panel.progress.value() == panel.progress.maximum()
    assert panel.round_label.text() == "Round 2 of 2"


def test_a_site_that_left_says_where_it_stopped(qtbot, tmp_path):
    panel, process, state = _joined(qtbot, tmp_path)
    process.on_line(_line("round_start", round=1, rounds=3, method="fedsm"))
    process.on_line(_line("batch", round=1, batch=1, batches=4, loss={}, method="fedsm"))
    process.stop()
    assert state.status == "stopped" and panel.progress.text() == "stopped in round 1 of 3"
