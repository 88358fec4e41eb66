"""End-to-end in the app, offscreen, with the real engine: demo, segmentation, export, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gui_helpers import TINY_DEMO
from PIL import Image

import engine.api
from fedsm_gui.controllers.segmentation import COMPARE_LAYER
from fedsm_gui.models.overlay import MODEL_LAYER, REFERENCE_LAYER

WAIT_MS = 60_000
TRAIN_WAIT_MS = 600_000


def _open_demo(app, qtbot, tiny_demo):
    ready = []
    app.demo.start(Path(tiny_demo["cache_dir"]), on_ready=lambda: ready.append(True), **TINY_DEMO)
    qtbot.waitUntil(lambda: ready == [True] or app.window.banner.isVisibleTo(app.window), timeout=WAIT_MS)
    assert ready == [True], app.window.banner.label.text()


def test_demo_opens_with_its_overlay_routing_and_ground_truth(fedsm_app, qtbot, tiny_demo):
    app = fedsm_app
    _open_demo(app, qtbot, tiny_demo)
    assert app.viewer_state.study is not None and app.viewer_state.study.kind == "photo"
    assert app.viewer_state.study.shape == (TINY_DEMO["photo_size"],) * 2
    assert set(app.overlays.layers) == {MODEL_LAYER, REFERENCE_LAYER}
    assert app.overlays.layers[MODEL_LAYER].labels.names == {1: "rim", 2: "cup"}
    panel = app.window.segmentation_panel
    routing = app.segmentation_state.routing_at(0)
    # the super model sends the demo photo (drawn with site 3's acquisition profile) somewhere, with a confidence
    assert routing.model in {"global", "site1", "site2", "site3"}
    assert 0.0 <= routing.confidence <= 1.0
    assert panel.strip.cells == [(routing.model, routing.confidence)]
    text = panel.current_label.text()
    assert routing.model in text and f"confidence {routing.confidence:.2f}" in text
    assert "site2" in panel.metadata_label.text() and "validation Dice" in panel.metadata_label.text()
    assert panel.device_label.text().startswith("device: cpu")
    assert "reference" in panel.cdr_label.text()  # the ground truth always has a disc
    assert app.federation.demo_workdir == Path(tiny_demo["site_workdir"])
    canvas = app.window.viewer.canvas("photo")
    assert len(canvas._overlays) == 2  # reference outline below, model fill on top


def test_gamma_force_and_compare_rerun_the_model(fedsm_app, qtbot, tiny_demo, monkeypatch):
    app = fedsm_app
    _open_demo(app, qtbot, tiny_demo)
    panel = app.window.segmentation_panel
    calls = []
    original = engine.api.segment_study

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.api, "segment_study", recording)
    panel.gamma.setValue(100)  # gamma 1.0: nothing is above it, every image goes to the global model
    panel.model_combo.setCurrentIndex(0)
    panel.run_button.click()
    qtbot.waitUntil(lambda: app.segmentation_state.status == "done" and len(calls) == 1, timeout=WAIT_MS)
    assert calls[-1]["gamma"] == 1.0
    routing = app.segmentation_state.routing_at(0)
    if app.segmentation_state.metadata.get("site_routing") == "style":
        # the style gate's nearest site picks the model (the demo photo is one of its sites'); gamma is not used
        assert "most alike" in routing.reason, routing.reason
    else:
        assert routing.model == "global"
    index = panel.model_combo.findData("site3")
    panel.model_combo.setCurrentIndex(index)
    panel.model_combo.activated.emit(index)
    panel.run_button.click()
    qtbot.waitUntil(lambda: len(calls) == 2 and app.segmentation_state.status == "done", timeout=WAIT_MS)
    assert calls[-1]["force_model"] == "site3" and app.segmentation_state.routing_at(0).model == "site3"
    runner_up = app.segmentation_state.routing_at(0).runner_up
    panel.compare_button.click()
    qtbot.waitUntil(lambda: COMPARE_LAYER in app.overlays.layers, timeout=WAIT_MS)
    assert calls[-1]["force_model"] == runner_up
    assert app.overlays.layers[COMPARE_LAYER].title == f"compare: {runner_up}"


def test_export_writes_mask_with_provenance_and_reads_back(fedsm_app, qtbot, tiny_demo, tmp_path):
    app = fedsm_app
    _open_demo(app, qtbot, tiny_demo)
    out = tmp_path / "demo_mask.png"
    app.window.segmentation_panel.export_requested.emit(str(out))
    qtbot.waitUntil(out.exists, timeout=WAIT_MS)
    written = np.asarray(Image.open(out))
    assert np.array_equal(written, app.overlays.layers[MODEL_LAYER].labels.array)
    provenance = engine.api.read_provenance(out)
    assert provenance.bundle_sha256 == tiny_demo["bundle_sha256"]
    assert provenance.images[0].model == app.segmentation_state.routing_at(0).model


def test_cancel_stops_a_running_segmentation(fedsm_app, qtbot, tiny_demo):
    app = fedsm_app
    _open_demo(app, qtbot, tiny_demo)
    before = app.segmentation_state.result
    app.segmentation.run()
    app.segmentation.cancel()  # the flag is set before the worker's first batch
    qtbot.waitUntil(lambda: app.segmentation_state.status != "running", timeout=WAIT_MS)
    assert app.segmentation_state.message == "cancelled"
    assert app.segmentation_state.result is before  # the earlier result stays on screen


def test_broken_files_show_a_message_not_a_crash(fedsm_app, qtbot, tmp_path):
    app = fedsm_app
    bundle = tmp_path / "broken.safetensors"
    bundle.write_bytes(b"\x00" * 100)
    app.segmentation.load_bundle(bundle)
    qtbot.waitUntil(lambda: app.window.banner.isVisibleTo(app.window), timeout=WAIT_MS)
    assert "broken.safetensors" in app.window.banner.label.text()
    assert app.segmentation_state.metadata is None
    assert not app.window.segmentation_panel.run_button.isEnabled()
    app.studies.open_path(tmp_path / "nowhere.nii.gz")
    assert "no such file" in app.window.banner.label.text()


def test_broken_image_file_shows_the_readers_message(fedsm_app, qtbot, tmp_path):
    app = fedsm_app
    broken = tmp_path / "broken.nii.gz"
    broken.write_bytes(b"this is not a NIfTI file")
    app.studies.open_path(broken)
    qtbot.waitUntil(lambda: app.window.banner.isVisibleTo(app.window), timeout=WAIT_MS)
    assert "broken.nii.gz" in app.window.banner.label.text()
    assert app.viewer_state.study is None


def test_check_data_lists_every_file_with_its_status(fedsm_app, qtbot, tiny_demo, tmp_path):
    import shutil

    app = fedsm_app
    site = tmp_path / "site1"
    shutil.copytree(Path(tiny_demo["data_dir"]) / "site1", site)
    broken = sorted((site / "labels").iterdir())[0]
    broken.write_bytes(b"not a png")
    panel = app.window.federation_panel
    panel.fields["datalist"].setText(str(site / "datalist.json"))
    panel.fields["datalist"].textEdited.emit(str(site / "datalist.json"))
    panel.check_button.click()
    qtbot.waitUntil(lambda: panel.check_table.rowCount() > 0, timeout=WAIT_MS)
    statuses = {panel.check_table.item(r, 0).text(): panel.check_table.item(r, 1).text()
                for r in range(panel.check_table.rowCount())}
    assert len(statuses) == 8  # site 1 of the synthetic federation holds 8 cases
    bad = [name for name, status in statuses.items() if status == "problem"]
    assert len(bad) == 1 and broken.name in bad[0]
    assert "1 with problems" in panel.check_summary.text()


def test_a_demo_neither_cached_nor_shipped_trains_with_an_advancing_progress_bar(fedsm_app, qtbot, tmp_path):
    """Settings that no shipped or cached demo was trained with (the tiny ones): the busy bar shows
    real training progress (a total and rising values) and then the demo opens with its overlay."""
    app = fedsm_app
    shown: list[tuple[str | None, int, int]] = []
    original = app.window.set_busy

    def recording(message, done=0, total=0):
        shown.append((message, done, total))
        original(message, done, total)

    app.window.set_busy = recording
    ready = []
    app.demo.start(tmp_path / "fresh-demo", on_ready=lambda: ready.append(True), **TINY_DEMO)
    # real training: a few seconds alone, minutes on a machine whose cores other jobs keep busy
    qtbot.waitUntil(lambda: ready == [True] or app.window.banner.isVisibleTo(app.window), timeout=TRAIN_WAIT_MS)
    assert ready == [True], app.window.banner.label.text()
    training = [(done, total) for message, done, total in shown
                if message and message.startswith("Training the demo super model") and total > 0]
    assert len(training) >= 2, shown
    assert training[-1][0] > training[0][0]  # the bar moved
    assert shown[-1][0] is None  # and was hidden once the demo was ready
    assert app.segmentation_state.bundle_path is not None
    assert app.demo.paths["source"] == "trained"


def test_the_fedsm_gui_entry_point_opens_the_demo_and_reports_errors(qtbot, tiny_demo, tmp_path, monkeypatch,
                                                                     capsys):
    """``fedsm-gui --demo`` (README's first command) runs to a shown demo; a missing file is an
    error in the window, not a crash (``--quit-when-ready`` turns both into exit statuses)."""
    from fedsm_gui import app as app_module

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(app_module, "DEMO_SETTINGS", dict(TINY_DEMO))
    assert app_module.main(["--demo", "--cache-dir", tiny_demo["cache_dir"], "--quit-when-ready"]) == 0
    assert "demo ready" in capsys.readouterr().out
    assert app_module.main([str(tmp_path / "missing.png"), "--quit-when-ready"]) == 1
    assert "no such file or folder" in capsys.readouterr().out


def test_fedsm_gui_is_an_installed_command():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["gui-scripts"]["fedsm-gui"] == "fedsm_gui.app:main"
