"""What a clinician expects of the viewer: legible markers, keys anywhere, readout, ruler, help, layout."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QMouseEvent
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QDialog, QLabel

from engine.demo import progress_message
from engine.inference.cup_disc import CupToDisc
from engine.io.study import Study
from fedsm_gui.models.display import default_colour
from fedsm_gui.models.overlay import MODEL_LAYER
from fedsm_gui.views.canvas import distance_text
from fedsm_gui.views.main_window import RESEARCH_NOTICE
from fedsm_gui.views.segmentation_panel import export_filters


def _mouse(widget, kind, pos, button=Qt.MouseButton.NoButton, buttons=Qt.MouseButton.NoButton):
    point = QPointF(*pos)
    QApplication.sendEvent(widget, QMouseEvent(kind, point, widget.mapToGlobal(point), button, buttons,
                                               Qt.KeyboardModifier.NoModifier))


def _shown(app, qtbot, study, labels=None):
    app.window.show()
    app.studies.show_study(study)
    if labels is not None:
        app.overlays.set_layer(MODEL_LAYER, labels)
    canvas = app.window.viewer.canvas("photo" if study.kind == "photo" else "axial")
    qtbot.waitUntil(lambda: canvas.paints > 0)
    return canvas


def test_orientation_markers_have_a_dark_halo_on_bright_tissue(fedsm_app, qtbot):
    bright = Study(np.full((40, 40, 5), 1000.0, np.float32), "volume", np.eye(4), (1.0, 1.0, 1.0), modality="MR",
                   window=(500.0, 100.0))
    canvas = _shown(fedsm_app, qtbot, bright)
    fedsm_app.viewer_state.zoom("axial", 4.0)  # the white image covers the whole view, markers included
    image = canvas.grab().toImage()
    w = image.width()
    strip = np.array([[image.pixelColor(x, y).getRgb()[:3] for x in range(w // 2 - 12, w // 2 + 12)]
                      for y in range(0, 22)])
    yellow = (strip[..., 0] > 200) & (strip[..., 1] > 160) & (strip[..., 2] < 140)
    dark = strip.max(axis=-1) < 60
    assert yellow.any() and dark.any()  # the "A" in yellow, outlined in black, on white


def test_slice_keys_work_wherever_the_focus_is(fedsm_app, qtbot, volume_study, volume_labels):
    app = fedsm_app
    _shown(app, qtbot, volume_study, volume_labels)
    with qtbot.waitActive(app.window):
        pass
    panel = app.window.overlay_panel
    opacity = panel.opacity.value()
    start = app.viewer_state.slice_index("axial")
    for focus in (panel.opacity, app.window.segmentation_panel.run_button):
        focus.setFocus()
        QTest.keyClick(app.window.windowHandle(), Qt.Key.Key_Down)
    assert app.viewer_state.slice_index("axial") == start - 2
    assert panel.opacity.value() == opacity  # ↓ scrolled the slices, it did not change the opacity
    # the view last pointed at is the one that scrolls
    app.window.viewer.canvas("coronal").activated.emit()
    coronal = app.viewer_state.slice_index("coronal")
    QTest.keyClick(app.window.windowHandle(), Qt.Key.Key_PageUp)
    assert app.viewer_state.slice_index("coronal") == min(coronal + 5, volume_study.shape[1] - 1)
    # on the federation tab the arrow keys belong to its fields
    app.window.tabs.setCurrentIndex(1)
    QTest.keyClick(app.window.windowHandle(), Qt.Key.Key_Down)
    assert app.viewer_state.slice_index("axial") == start - 2


def test_pointer_readout_shows_voxel_position_value_and_label(fedsm_app, qtbot, volume_study, volume_labels):
    app = fedsm_app
    canvas = _shown(app, qtbot, volume_study, volume_labels)
    app.viewer_state.set_slice("axial", 5)
    rect = canvas.image_rect()
    # screen column c shows voxel i = X - 1 - c; row r shows j = Y - 1 - r (radiological convention)
    col, row = 40 - 1 - 15, 30 - 1 - 12
    pos = (rect.x() + (col + 0.5) / 40 * rect.width(), rect.y() + (row + 0.5) / 30 * rect.height())
    _mouse(canvas, QEvent.Type.MouseMove, pos)
    text = app.window.viewer.readout.text()
    value = volume_study.array[15, 12, 5]
    assert "voxel (15, 12, 5)" in text and "R 15.0  A 12.0  S 15.0 mm" in text
    assert f"value {value:.6g}" in text and "model: prostate" in text
    canvas.hovered.emit(-1.0, -1.0)  # the pointer left the slice
    assert app.window.viewer.readout.text() == ""


def test_photo_readout_gives_rgb(fedsm_app, qtbot, photo_study):
    canvas = _shown(fedsm_app, qtbot, photo_study)
    rect = canvas.image_rect()
    _mouse(canvas, QEvent.Type.MouseMove, (rect.x() + 10.5 / 64 * rect.width(), rect.y() + 20.5 / 48 * rect.height()))
    r, g, b = photo_study.array[20, 10]
    assert fedsm_app.window.viewer.readout.text().startswith(f"x 10  y 20   RGB ({r}, {g}, {b})")


def test_distance_tool_measures_in_millimetres(fedsm_app, qtbot, volume_study):
    assert distance_text((0, 0), (3, 4), (1.0, 1.0), True) == "5.0 mm"
    assert distance_text((0, 0), (2, 0), (3.0, 0.5), True) == "6.0 mm"
    assert distance_text((0, 0), (3, 4), (1.0, 1.0), False) == "5.0 px"
    app = fedsm_app
    _shown(app, qtbot, volume_study)
    coronal = app.window.viewer.canvas("coronal")  # rows are 3 mm slices, columns 1 mm voxels
    qtbot.waitUntil(lambda: coronal.paints > 0)
    app.window.viewer.measure_button.setChecked(True)
    a, b = coronal.to_widget(2.5, 5.5), coronal.to_widget(6.5, 5.5)
    _mouse(coronal, QEvent.Type.MouseButtonPress, (a.x(), a.y()), Qt.MouseButton.LeftButton, Qt.MouseButton.LeftButton)
    _mouse(coronal, QEvent.Type.MouseMove, (b.x(), b.y()), Qt.MouseButton.NoButton, Qt.MouseButton.LeftButton)
    _mouse(coronal, QEvent.Type.MouseButtonRelease, (b.x(), b.y()), Qt.MouseButton.LeftButton)
    assert coronal.ruler_text() == "12.0 mm"  # 4 rows of 3 mm
    cursor = list(app.viewer_state.cursor)
    assert app.viewer_state.cursor == cursor  # measuring did not move the crosshair
    app.window.viewer.measure_button.setChecked(False)
    assert coronal.ruler is None


def test_screenshot_help_about_and_notice(fedsm_app, qtbot, volume_study, tmp_path):
    app = fedsm_app
    _shown(app, qtbot, volume_study)
    saved = app.window.save_screenshot(str(tmp_path / "view"))
    assert saved.endswith("view.png")
    with Image.open(saved) as shot:
        assert shot.size == (app.window.viewer.stack.width(), app.window.viewer.stack.height())
    app.window.show_help()
    help_text = app.window.findChild(QLabel, "help-dialog-text").text()
    assert "PageUp" in help_text and "distance" in help_text
    app.window.segmentation_panel.set_metadata("/models/site_model.safetensors", {
        "task": "fundus", "method": "fedsm", "site_names": ["a", "b"], "rounds": 4, "created": "2026-11-25T10:00:00",
        "engine_version": "0.1.0", "extra": {"seed": 3}})
    app.window.show_about()
    about = app.window.findChild(QLabel, "about-dialog-text").text()
    from fedsm_gui import __version__
    assert f"FedSM {__version__}" in about and "site_model.safetensors" in about and "seed 3" in about
    assert RESEARCH_NOTICE in about and app.window.notice.text() == RESEARCH_NOTICE
    for dialog in app.window.findChildren(QDialog):
        dialog.close()


def test_a_later_success_clears_the_error_banner(fedsm_app):
    window = fedsm_app.window
    window.show()
    window.show_error("Cannot open", "x.png: not found")
    assert window.banner.isVisible()
    window.show_status("Opened y.png")
    assert not window.banner.isVisible()


def test_layout_fits_1280_by_720(fedsm_app, qtbot, photo_study):
    window = fedsm_app.window
    _shown(fedsm_app, qtbot, photo_study)
    window.resize(1280, 720)
    qtbot.waitUntil(lambda: window.width() <= 1280)
    assert window.minimumSizeHint().width() <= 1280 and window.minimumSizeHint().height() <= 720
    scroll = window.side_scroll
    assert scroll.widget().width() <= scroll.viewport().width()  # nothing cut off at the right
    assert scroll.widget().minimumSizeHint().width() <= scroll.viewport().width()
    window.tabs.setCurrentIndex(1)
    panel = window.federation_panel
    panel.set_local_app_hash("sha256:" + "ab" * 32)
    hash_label = panel.local_hash
    assert hash_label.toolTip().endswith("ab" * 32)
    assert hash_label.fontMetrics().horizontalAdvance(hash_label.text()) <= max(hash_label.width(), 40)


def test_export_dialog_offers_what_the_study_can_take():
    assert "DICOM" not in export_filters("photo_mask.png") and export_filters("photo_mask.png").startswith("PNG")
    assert export_filters("series_mask.dcm").startswith("DICOM SEG")
    assert "DICOM" not in export_filters("vol_mask.nii.gz") and "PNG" not in export_filters("vol_mask.nii.gz")


def test_palette_does_not_repeat():
    colours = [default_colour(v) for v in range(1, 256)]
    assert len(set(colours)) == 255
    assert colours[0] == (255, 0, 0)  # ITK-SNAP's first colours stay first


def test_cup_to_disc_shown_with_its_doubts(qtbot):
    from fedsm_gui.views.segmentation_panel import SegmentationPanel

    panel = SegmentationPanel()
    qtbot.addWidget(panel)
    panel.set_cup_to_disc(CupToDisc(0.98, False, "the cup fills the disc (no rim left)"), CupToDisc(0.45, True))
    text = panel.cdr_label.text()
    assert "model 0.98 (not reliable)" in text and "reference 0.45" in text and "no rim left" in text
    panel.set_cup_to_disc(None, CupToDisc(0.45, True))
    assert "⚠" not in panel.cdr_label.text()


def test_demo_progress_counts_training_rounds():
    assert progress_message(1, 3) == "Training the demo super model: round 1 of 3"
    assert progress_message(3, 3).endswith("round 3 of 3")
    assert progress_message(4, 3) == "Calibrating the model selector"


@pytest.mark.parametrize("reconnecting", [True, False])
def test_a_disconnect_after_the_last_round_is_a_finished_run(reconnecting):
    from fedsm_gui.models.federation import FederationState

    state = FederationState()
    state.starting(["fedsm", "site"])
    state.apply_event({"event": "connected", "coordinator": "127.0.0.1:9092"})
    for rnd in (1, 2, 3):
        state.apply_event({"event": "round_start", "round": rnd, "rounds": 3})
        state.apply_event({"event": "round_end", "round": rnd, "rounds": 3})
    state.apply_event({"event": "disconnected", "reason": "connection closed", "reconnecting": reconnecting})
    assert state.status == "finished"
    # mid-run, the same event still means a lost connection
    state.starting(["fedsm", "site"])
    state.apply_event({"event": "round_end", "round": 1, "rounds": 3})
    state.apply_event({"event": "disconnected", "reason": "connection closed", "reconnecting": True})
    assert state.status == "reconnecting"


def test_demo_records_its_validation_dice_per_structure(tiny_demo):
    import json
    from pathlib import Path

    from engine.demo import MANIFEST, TARGET_DICE

    manifest = json.loads((Path(tiny_demo["cache_dir"]) / MANIFEST).read_text())
    per_site = manifest["validation_dice"]
    assert set(per_site) == {"site1", "site2", "site3"} and tiny_demo["validation_dice"] == per_site
    assert all(set(d) == {"disc", "cup"} and all(0.0 <= v <= 1.0 for v in d.values()) for d in per_site.values())
    worst = manifest["validation_dice_worst_site"]
    assert worst == {k: min(d[k] for d in per_site.values()) for k in ("disc", "cup")}
    assert manifest["meets_target"] == all(worst[k] >= TARGET_DICE[k] for k in TARGET_DICE)
    assert manifest["torch_threads"] >= 1


def test_demo_status_names_the_weakest_sites_validation_dice():
    from fedsm_gui.controllers.demo import demo_validation_text

    text = demo_validation_text({"site1": {"disc": 0.91, "cup": 0.72}, "site2": {"disc": 0.88, "cup": 0.64}})
    assert "weakest of 2" in text and "disc 0.88" in text and "cup 0.64" in text and "not for diagnosis" in text
    assert demo_validation_text({}) == ""


def test_a_mask_without_names_takes_the_models_label_names():
    from engine.io.study import LabelMap
    from fedsm_gui.models.overlay import REFERENCE_LAYER, OverlayState

    overlays = OverlayState()
    array = np.zeros((4, 4, 2), np.uint8)
    array[1, 1, 1] = 1
    array[2, 2, 0] = 3
    overlays.set_layer(REFERENCE_LAYER, LabelMap(array, {1: "label 1", 3: "label 3"}))
    overlays.set_layer(MODEL_LAYER, LabelMap(array, {1: "prostate"}))
    names = {v: s.name for v, s in overlays.layers[REFERENCE_LAYER].styles.items()}
    assert names == {1: "prostate", 3: "label 3"}  # a value the model does not know keeps its number
