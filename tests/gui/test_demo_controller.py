"""The demo controller without Qt: retraining on request, one job at a time, stopping it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
from gui_helpers import DeferredTaskRunner

from engine.errors import CancelledError
from fedsm_gui.controllers.demo import DemoController, demo_source_text
from fedsm_gui.views.bases import MainView


def _paths(tmp_path: Path, source: str) -> dict:
    return {"bundle": str(tmp_path / "b.safetensors"), "study": str(tmp_path / "photo.png"),
            "reference": str(tmp_path / "mask.png"), "site_workdir": str(tmp_path / "site"),
            "cache_dir": str(tmp_path), "source": source, "validation_dice": {}}


def _demo(tmp_path: Path, prepare) -> SimpleNamespace:
    main = MagicMock(spec=MainView)
    studies = MagicMock()
    studies.mask_opened = []
    runner = DeferredTaskRunner()
    api = SimpleNamespace(prepare_demo=MagicMock(side_effect=prepare))
    federation = SimpleNamespace(demo_workdir=None)
    ctrl = DemoController(main, runner, api, studies, MagicMock(), federation, cache_dir=tmp_path / "cache")
    return SimpleNamespace(ctrl=ctrl, main=main, studies=studies, runner=runner, api=api, federation=federation)


def test_the_retrain_intent_trains_once_then_shows_the_retrained_demo(tmp_path):
    t = _demo(tmp_path, lambda cache_dir, progress, cancel, **kw: _paths(tmp_path, "trained"))
    t.main.retrain_demo_requested.connect.assert_called_once_with(t.ctrl.retrain)
    t.main.stop_demo_requested.connect.assert_called_once_with(t.ctrl.cancel)
    t.ctrl.settings = {"rounds": 2}
    t.ctrl.retrain()
    t.main.set_demo_retraining.assert_called_with(True)
    t.main.set_busy.assert_called_with("Retraining the demo super model …")
    t.ctrl.retrain()  # already running: no second training
    assert len(t.runner.jobs) == 1
    t.main.show_status.assert_called_with("The demo is already being prepared")
    t.runner.run_all()
    (cache_dir, _progress, _cancel), kwargs = t.api.prepare_demo.call_args
    assert cache_dir == tmp_path / "cache" and kwargs == {"retrain": True, "rounds": 2}
    t.main.set_demo_retraining.assert_called_with(False)
    t.main.show_status.assert_any_call(f"Demo super model retrained and cached in {tmp_path}")
    assert t.studies.open_path.call_args.args[0] == str(tmp_path / "photo.png")
    assert t.federation.demo_workdir == tmp_path / "site"


def test_stopping_a_retraining_keeps_the_demo_shown(tmp_path):
    def prepare(cache_dir, progress, cancel, **kw):
        if cancel():
            raise CancelledError("cancelled")
        return _paths(tmp_path, "trained")

    t = _demo(tmp_path, prepare)
    t.ctrl.retrain()
    t.ctrl.cancel()
    t.runner.run_all()
    t.main.show_status.assert_called_with("Demo retraining stopped; the demo model shown is unchanged")
    t.main.set_demo_retraining.assert_called_with(False)
    t.main.show_error.assert_not_called()
    t.studies.open_path.assert_not_called()


def test_a_failed_retraining_is_a_message_not_a_crash(tmp_path):
    def prepare(cache_dir, progress, cancel, **kw):
        raise OSError("disk full")

    t = _demo(tmp_path, prepare)
    t.ctrl.retrain()
    t.runner.run_all()
    title, message = t.main.show_error.call_args.args
    assert title == "The demo super model could not be retrained" and "disk full" in message
    t.main.set_busy.assert_called_with(None)


def test_opening_the_demo_does_not_retrain(tmp_path):
    t = _demo(tmp_path, lambda cache_dir, progress, cancel, **kw: _paths(tmp_path, "shipped"))
    t.ctrl.start(tmp_path / "other", rounds=3)
    t.runner.run_all()
    (cache_dir, _progress, _cancel), kwargs = t.api.prepare_demo.call_args
    assert cache_dir == tmp_path / "other" and kwargs == {"rounds": 3}
    t.main.set_demo_retraining.assert_called_with(False)
    assert t.ctrl.cache_dir == tmp_path / "other"  # a later retrain caches there


@pytest.mark.parametrize(("source", "words"), [("shipped", "shipped with FedSM"), ("cache", "retrained earlier"),
                                              ("trained", "retrained and cached"), ("", "")])
def test_the_status_line_names_the_demo_models_origin(tmp_path, source, words):
    text = demo_source_text({"source": source, "cache_dir": str(tmp_path)})
    assert (words in text) if words else text == ""
