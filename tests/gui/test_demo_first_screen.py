"""``fedsm-gui --demo``'s first screen comes from the shipped demo (nothing trained), its routing
line names the demo photo's own site, and Demo ▸ Retrain trains in a worker, then caches and shows."""

from __future__ import annotations

import shutil
from pathlib import Path

from gui_helpers import TINY_DEMO

from engine.demo import DemoSettings, shipped_demo
from fedsm_gui.models.overlay import MODEL_LAYER, REFERENCE_LAYER

WAIT_MS = 120_000
TRAIN_WAIT_MS = 600_000


def _record_busy(app) -> list[tuple[str | None, int, int, bool]]:
    """Every busy-bar update, with whether Demo ▸ Stop retraining was enabled at that moment."""
    shown: list[tuple[str | None, int, int, bool]] = []
    original = app.window.set_busy

    def recording(message, done=0, total=0):
        shown.append((message, done, total, app.window.stop_demo_action.isEnabled()))
        original(message, done, total)

    app.window.set_busy = recording
    return shown


def _wait_ready(app, qtbot, ready, timeout):
    qtbot.waitUntil(lambda: bool(ready) or app.window.banner.isVisibleTo(app.window), timeout=timeout)
    assert ready, app.window.banner.label.text()


def test_first_screen_is_the_shipped_demo_and_its_photo_goes_to_its_own_site(fedsm_app, qtbot, tmp_path):
    app = fedsm_app
    shown = _record_busy(app)
    cache = tmp_path / "fresh-home-cache"
    ready: list[bool] = []
    app.demo.start(cache, on_ready=lambda: ready.append(True))
    _wait_ready(app, qtbot, ready, WAIT_MS)
    assert not [m for m, *_ in shown if m and "Training" in m]  # nothing was trained
    shipped = shipped_demo(cache)
    assert app.demo.paths["source"] == "shipped"
    assert app.segmentation_state.bundle_path == Path(shipped["bundle"])
    assert not (cache / "demo.json").exists()
    settings = DemoSettings()
    assert app.viewer_state.study.shape[:2] == (settings.photo_size,) * 2
    assert set(app.overlays.layers) == {MODEL_LAYER, REFERENCE_LAYER}
    own = f"site{settings.study_site}"  # the demo photo is drawn with site 2's acquisition profile
    routing = app.segmentation_state.routing_at(0)
    assert routing.model == own
    text = app.window.segmentation_panel.current_label.text()
    assert f">{own}</b> model" in text and f"why: {own}: " in text, text
    assert "unlike every participating site" not in text and "style gate" not in text
    assert app.window.retrain_demo_action.isEnabled() and not app.window.stop_demo_action.isEnabled()


def test_retrain_action_trains_in_a_worker_with_progress_then_caches_and_shows(fedsm_app, qtbot, tmp_path,
                                                                              tiny_demo):
    app = fedsm_app
    cache = tmp_path / "cache"
    shutil.copytree(tiny_demo["cache_dir"], cache)
    ready: list[bool] = []
    app.demo.start(cache, on_ready=lambda: ready.append(True), **TINY_DEMO)
    _wait_ready(app, qtbot, ready, WAIT_MS)
    assert app.demo.paths["source"] == "cache"
    before = (cache / "demo.json").read_text()
    shown = _record_busy(app)
    masks: list[object] = []
    app.studies.mask_opened.append(masks.append)
    app.window.retrain_demo_action.trigger()
    assert not app.window.retrain_demo_action.isEnabled() and app.window.stop_demo_action.isEnabled()
    qtbot.waitUntil(lambda: bool(masks) or app.window.banner.isVisibleTo(app.window), timeout=TRAIN_WAIT_MS)
    assert masks, app.window.banner.label.text()
    training = [(done, total, stop) for message, done, total, stop in shown
                if message and message.startswith("Training the demo super model") and total > 0]
    assert len(training) >= 2 and training[-1][0] > training[0][0], shown
    assert all(stop for *_, stop in training)  # Stop retraining was offered while it ran
    assert app.demo.paths["source"] == "trained"
    assert Path(app.segmentation_state.bundle_path).is_relative_to(cache)
    assert (cache / "demo.json").read_text() != before  # the retrained demo is cached
    assert app.window.retrain_demo_action.isEnabled() and not app.window.stop_demo_action.isEnabled()
    assert app.segmentation_state.routing_at(0) is not None
