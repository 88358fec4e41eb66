"""The operator sees a run's signed settings against the site's bounds and accepts or declines before training.

Engine: the rows the dialog shows (engine.api.review_run_settings), the site process's answer
from its standard input, and the site's task executor asking once per run. Controller: a
``run_settings`` event that waits for confirmation opens the dialog; the answer reaches the
site process as one line. View: the dialog (offscreen), its table and buttons.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
from gui_helpers import FakeProcess, SyncTaskRunner

from engine import api
from fedsm_gui.controllers.federation import FederationController
from fedsm_gui.models.federation import FederationState
from fedsm_gui.views.bases import FederationView

SHOWN = {"method": "fedsm", "task": "fundus", "rounds": 3, "epochs": 1, "batch_size": 8, "lr": 0.001,
         "image_size": 256, "seed": 0, "site_names": ["site1", "site2"], "app_hash": "sha256:" + "ab" * 32,
         "session": "s1", "signed": True}


def _row(rows, setting, bound_prefix=""):
    return next(r for r in rows if r["setting"] == setting and r["bound"].startswith(bound_prefix))


def test_review_rows_say_which_bounds_the_settings_satisfy():
    rows = api.review_run_settings(SHOWN, {"allowed_methods": ["fedsm", "fedavg"], "max_rounds": 2})
    assert _row(rows, "method") == {"setting": "method", "value": "fedsm", "bound": "one of fedsm, fedavg", "ok": True}
    assert _row(rows, "rounds") == {"setting": "rounds", "value": 3, "bound": "≤ 2", "ok": False}
    assert _row(rows, "lr")["ok"] and _row(rows, "image_size")["bound"] == "≤ 1024"
    assert _row(rows, "batch_size", "≥")["ok"] and _row(rows, "batch_size", "≤")["ok"]
    assert _row(rows, "signature")["ok"] and _row(rows, "app")["value"] == SHOWN["app_hash"]
    unsigned = api.review_run_settings({**SHOWN, "signed": False, "method": "blackfed-v1"}, {})
    assert not _row(unsigned, "signature")["ok"] and _row(unsigned, "method")["bound"] == "any method"


def test_the_site_asks_once_per_run_and_reads_the_answer_from_its_input(tmp_path):
    from engine.federation.config import SiteConfig
    from engine.federation.events import EventWriter
    from engine.federation.flower.site import TaskExecutor
    from engine.security.run_review import stdin_confirmation

    cfg = SiteConfig(path=tmp_path / "site.toml", name="site1", coordinator="127.0.0.1:1", datalist=tmp_path / "d.json",
                     task="fundus", work_dir=tmp_path, ca_cert=None, private_key=None, approved_apps=(), device="cpu")
    events: list[dict] = []
    executor = TaskExecutor(cfg, "127.0.0.1:1", None, None, EventWriter("site", "site1", listener=events.append))
    executor.confirm = stdin_confirmation(io.StringIO("decline\naccept\n"))
    settings = {"spec": {"method": "fedsm", "rounds": 3}, "spec_json": "{}", "app_hash": "sha256:x", "session": "s1",
                "signed": True}
    assert executor._announce(settings) is False  # declined: run_task answers with an error, pulls nothing
    assert executor._announce(settings) is False  # asked once per run
    assert executor._announce({**settings, "session": "s2"}) is True  # a new run is asked again
    announced = [e for e in events if e["event"] == "run_settings"]
    assert len(announced) == 2 and announced[0]["confirm"] is True
    assert announced[0]["settings"]["method"] == "fedsm" and "max_rounds" in announced[0]["bounds"]
    assert stdin_confirmation(io.StringIO(""))(SHOWN) is False  # no answer (input closed): declined


def _controller(tmp_path):
    state, view, process = FederationState(), MagicMock(spec=FederationView), FakeProcess()
    ctrl = FederationController(state, view, SyncTaskRunner(), process, api, demo_workdir=tmp_path)
    return SimpleNamespace(ctrl=ctrl, state=state, view=view, process=process)


@pytest.mark.parametrize("accepted", [True, False])
def test_the_controller_asks_the_operator_and_tells_the_site(tmp_path, accepted):
    t = _controller(tmp_path)
    t.ctrl.join()
    t.process.on_line(json.dumps({"event": "run_settings", "time": 1, "source": "site", "site": "site1",
                                  "settings": SHOWN, "bounds": {"max_epochs": 5}, "confirm": True}))
    summary, rows = t.view.ask_run_confirmation.call_args.args
    assert "fedsm" in summary and "signed by the coordinator" in summary
    assert _row(rows, "epochs") == {"setting": "epochs", "value": 1, "bound": "≤ 5", "ok": True}
    assert t.process.written == []  # the site waits until the operator answers
    t.ctrl.answer_run_confirmation(accepted)
    t.ctrl.answer_run_confirmation(not accepted)  # a second answer to the same run is ignored
    assert t.process.written == ["accept" if accepted else "decline"]
    assert any(("accepted" if accepted else "declined") in line for line in t.state.log)


def test_settings_that_need_no_confirmation_open_no_dialog(tmp_path):
    t = _controller(tmp_path)
    t.ctrl.join()
    t.process.on_line(json.dumps({"event": "run_settings", "time": 1, "source": "site", "site": "site1",
                                  "settings": SHOWN}))
    t.view.ask_run_confirmation.assert_not_called()
    assert t.state.run_settings["method"] == "fedsm"


def test_the_dialog_lists_the_settings_and_answers(qtbot):
    from PySide6.QtCore import Qt

    from fedsm_gui.views.federation_panel import FederationPanel

    panel = FederationPanel()
    qtbot.addWidget(panel)
    rows = api.review_run_settings(SHOWN, {})
    with qtbot.waitSignal(panel.run_confirmation_answered) as answered:
        panel.ask_run_confirmation(api.format_run_settings(SHOWN), rows)
        dialog = panel.run_dialog
        assert dialog.isVisible() and dialog.table.rowCount() == len(rows)
        cells = {dialog.table.item(r, 0).text(): dialog.table.item(r, 3).text() for r in range(len(rows))}
        assert cells["method"] == "✓ within" and cells["signature"] == "✓ within"
        qtbot.mouseClick(dialog.accept_button, Qt.MouseButton.LeftButton)
    assert answered.args == [True]
    beyond = api.review_run_settings(SHOWN, {"max_image_size": 128})
    with qtbot.waitSignal(panel.run_confirmation_answered) as answered:
        panel.ask_run_confirmation("settings", beyond)
        assert not panel.run_dialog.accept_button.isEnabled() and panel.run_dialog.outside == ["image_size"]
        qtbot.mouseClick(panel.run_dialog.decline_button, Qt.MouseButton.LeftButton)
    assert answered.args == [False]
    panel.run_dialog.deleteLater()


def test_a_question_being_written_is_not_read_as_one(tmp_path):
    # Prepare: the SuperNode's side has asked about run 7 and is writing a question for run 9: its atomic
    # write's temporary file keeps the target's suffixes (".9.settings.<random>.tmp.settings.json")
    from engine.federation.flower.run_confirmation import ask, pending, record
    from engine.io.atomic import atomic_path

    assert ask(tmp_path, 7, {"method": "fedsm"}, timeout=0.0) is None
    with atomic_path(tmp_path / "9.settings.json") as half_written:
        half_written.write_text('{"meth')
        assert half_written.name.endswith(".settings.json")  # what the site's glob matches
        # Execute / Assert: the site sees run 7's question only, and does not fail on the temporary file
        assert pending(tmp_path) == [(7, {"method": "fedsm"})]
    record(tmp_path, 7, accepted=True)
    assert pending(tmp_path) == []
