"""The Qt widgets, offscreen: conformance with the abstract views, painting, mouse and keys."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QMouseEvent
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication

from fedsm_gui.models.overlay import MODEL_LAYER
from fedsm_gui.views import bases
from fedsm_gui.views.federation_panel import FederationPanel
from fedsm_gui.views.main_window import MainWindow
from fedsm_gui.views.overlay_panel import OverlayPanel
from fedsm_gui.views.segmentation_panel import SegmentationPanel
from fedsm_gui.views.viewer import ViewerWidget

CONCRETE = [(bases.ViewerView, ViewerWidget), (bases.OverlayView, OverlayPanel),
            (bases.SegmentationView, SegmentationPanel), (bases.FederationView, FederationPanel),
            (bases.MainView, MainWindow)]


@pytest.mark.parametrize(("base", "concrete"), CONCRETE, ids=[c.__name__ for _, c in CONCRETE])
def test_concrete_views_provide_every_intent_and_method(base, concrete):
    from PySide6.QtCore import Signal

    for name, member in vars(base).items():
        if isinstance(member, bases.Intent):
            assert isinstance(getattr(concrete, name, None), Signal), f"{concrete.__name__}.{name} is not a Signal"
            assert getattr(concrete, name) is not member
        elif inspect.isfunction(member) and not name.startswith("_"):
            impl = getattr(concrete, name)
            assert impl is not member, f"{concrete.__name__} does not implement {name}"
            assert list(inspect.signature(impl).parameters) == list(inspect.signature(member).parameters), name


def _drag(widget, button, start, end):
    """Press ``button`` at ``start``, move to ``end`` with it held, release."""
    pos0, pos1 = QPointF(*start), QPointF(*end)
    for kind, pos, buttons in ((QEvent.Type.MouseButtonPress, pos0, button), (QEvent.Type.MouseMove, pos1, button),
                               (QEvent.Type.MouseButtonRelease, pos1, Qt.MouseButton.NoButton)):
        event = QMouseEvent(kind, pos, widget.mapToGlobal(pos), button, buttons, Qt.KeyboardModifier.NoModifier)
        QApplication.sendEvent(widget, event)


def test_volume_views_scroll_by_keys_wheel_and_slider(fedsm_app, qtbot, volume_study, volume_labels):
    app = fedsm_app
    app.window.show()
    app.studies.show_study(volume_study)
    app.overlays.set_layer(MODEL_LAYER, volume_labels)
    canvas = app.window.viewer.canvas("axial")
    qtbot.waitUntil(lambda: canvas.paints > 0)
    start = app.viewer_state.slice_index("axial")
    qtbot.keyClick(canvas, Qt.Key.Key_Up)
    qtbot.keyClick(canvas, Qt.Key.Key_PageUp)
    assert app.viewer_state.slice_index("axial") == min(start + 6, 11)
    qtbot.keyClick(canvas, Qt.Key.Key_PageDown)
    assert app.viewer_state.slice_index("axial") == min(start + 6, 11) - 5
    app.window.viewer.panes["coronal"].slider.setValue(3)
    assert app.viewer_state.slice_index("coronal") == 3
    painted = canvas.paints
    canvas.repaint()
    assert canvas.paints == painted + 1
    assert "Axial" in canvas._caption and f"{app.viewer_state.slice_index('axial') + 1}/12" in canvas._caption


def test_right_drag_changes_window_and_click_moves_crosshair(fedsm_app, qtbot, volume_study):
    app = fedsm_app
    app.window.show()
    app.studies.show_study(volume_study)
    canvas = app.window.viewer.canvas("axial")
    qtbot.waitUntil(lambda: canvas.paints > 0)
    center, width = app.viewer_state.window
    _drag(canvas, Qt.MouseButton.RightButton, (50, 50), (100, 80))
    new_center, new_width = app.viewer_state.window
    assert new_width > width and new_center > center
    assert app.window.viewer.window_label.text().startswith(f"level {new_center:.4g}")
    rect = canvas.image_rect()
    # click the image's top-left corner: patient's right, anterior
    _drag(canvas, Qt.MouseButton.LeftButton, (rect.left() + 1, rect.top() + 1), (rect.left() + 1, rect.top() + 1))
    assert app.viewer_state.cursor[:2] == [39, 29]
    app.window.viewer.presets.textActivated.emit("Full range")
    assert app.viewer_state.window == app.viewer_state.presets["Full range"]


def test_photo_green_channel_zoom_and_fit(fedsm_app, qtbot, photo_study):
    app = fedsm_app
    app.window.show()
    app.studies.show_study(photo_study)
    viewer = app.window.viewer
    assert viewer.stack.currentIndex() == 2 and viewer.photo_controls.isVisibleTo(viewer)
    viewer.green.setChecked(True)
    assert app.viewer_state.green_only
    shown = viewer.canvas("photo")._arrays[0]
    assert (shown[..., 0] == photo_study.array[..., 1]).all()
    viewer.contrast.setValue(100)
    assert app.viewer_state.contrast == pytest.approx(10.0)
    canvas = viewer.canvas("photo")
    qtbot.waitUntil(lambda: canvas.paints > 0)
    before = canvas.image_rect().width()
    canvas.zoom_requested.emit(2.0)
    assert canvas.image_rect().width() == pytest.approx(2 * before)
    viewer.fit_button.click()
    assert canvas.image_rect().width() == pytest.approx(before)


def test_overlay_hotkey_opacity_and_legend(fedsm_app, qtbot, volume_study, volume_labels):
    app = fedsm_app
    app.window.show()
    app.window.activateWindow()
    app.studies.show_study(volume_study)
    app.overlays.set_layer(MODEL_LAYER, volume_labels)
    canvas = app.window.viewer.canvas("axial")
    assert len(canvas._overlays) == 1
    panel = app.window.overlay_panel
    assert (MODEL_LAYER, 1) in panel.label_boxes and panel.label_boxes[(MODEL_LAYER, 1)].text() == "1: prostate"
    # through the window, like a real key press, so the shortcut map sees it
    with qtbot.waitActive(app.window):
        pass
    QTest.keyClick(app.window.windowHandle(), Qt.Key.Key_H)
    assert not app.overlays.visible and canvas._overlays == []
    assert not panel.show_box.isChecked()
    panel.show_box.setChecked(True)
    assert len(canvas._overlays) == 1
    panel.opacity.setValue(100)
    alpha = canvas._arrays[1][..., 3]
    assert alpha.max() == 255
    panel.outline_boxes[MODEL_LAYER].setChecked(True)
    assert app.overlays.layers[MODEL_LAYER].outline
    panel.label_boxes[(MODEL_LAYER, 1)].setChecked(False)
    assert canvas._arrays[1][..., 3].max() == 0


def test_empty_states_guide_the_user(fedsm_app):
    app = fedsm_app
    assert "No study open" in app.window.viewer.empty.text()
    panel = app.window.segmentation_panel
    assert "No super model loaded" in panel.metadata_label.text()
    assert not panel.run_button.isEnabled() and not panel.export_button.isEnabled()
    assert "simulated site" in app.window.federation_panel.mode_label.text()


def test_export_proposes_a_neutral_name_unless_the_user_keeps_names(fedsm_app, qtbot, tmp_path):
    import engine.api

    photo = tmp_path / "DOE^JOHN_1970-01-01.png"
    from PIL import Image

    Image.fromarray(np.full((20, 30, 3), 90, np.uint8)).save(photo)
    study = engine.api.open_study(photo)
    panel = fedsm_app.window.segmentation_panel
    assert not panel.keep_names_box.isChecked()  # off by default
    fedsm_app.studies.show_study(study)
    case = engine.api.mask_file_stem(study)
    qtbot.waitUntil(lambda: panel._export_name == f"{case}_mask.png")
    panel.keep_names_box.setChecked(True)
    qtbot.waitUntil(lambda: panel._export_name == "DOE^JOHN_1970-01-01_mask.png")


def test_canvas_rejects_arrays_it_cannot_show():
    from fedsm_gui.views.canvas import to_qimage

    with pytest.raises(ValueError, match="contiguous"):
        to_qimage(np.zeros((4, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="cannot show"):
        to_qimage(np.zeros((4, 4, 2), dtype=np.uint8))


def _drop(window, path, modifiers=Qt.KeyboardModifier.NoModifier):
    from PySide6.QtCore import QMimeData, QUrl
    from PySide6.QtGui import QDropEvent

    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    event = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.NoButton, modifiers)
    window.dropEvent(event)


def test_dropping_files_opens_studies_masks_and_models(qtbot, tmp_path):
    window = MainWindow()
    qtbot.addWidget(window)
    with qtbot.waitSignal(window.open_requested) as study:
        _drop(window, tmp_path / "case.nii.gz")
    assert study.args == [str(tmp_path / "case.nii.gz")]
    with qtbot.waitSignal(window.open_mask_requested) as mask:
        _drop(window, tmp_path / "mask.png", Qt.KeyboardModifier.ShiftModifier)
    assert mask.args == [str(tmp_path / "mask.png")]
    with qtbot.waitSignal(window.segmentation_panel.load_bundle_requested) as bundle:
        _drop(window, tmp_path / "model.safetensors")
    assert bundle.args == [str(tmp_path / "model.safetensors")]


def test_recent_menu_and_series_dialog(qtbot):
    from engine.io.study import SeriesInfo
    from fedsm_gui.views.main_window import SeriesDialog

    window = MainWindow()
    qtbot.addWidget(window)
    window.set_recent(["/data/a.nii.gz", "/data/dicom"])
    actions = window.recent_menu.actions()
    assert [a.text() for a in actions] == ["/data/a.nii.gz", "/data/dicom"]
    with qtbot.waitSignal(window.open_requested) as opened:
        actions[1].trigger()
    assert opened.args == ["/data/dicom"]
    dialog = SeriesDialog([SeriesInfo("1.2.3", "T2 tra", "MR", 19, (384, 384)), SeriesInfo("1.2.4", "", "SEG", 3)],
                          window)
    assert dialog.list.count() == 2 and "T2 tra — MR, 19 image(s), 384×384" in dialog.list.item(0).text()
    dialog.list.setCurrentRow(1)
    assert dialog.chosen_uid() == "1.2.4"
    dialog.deleteLater()


def test_approving_this_installations_app_hash(qtbot):
    panel = FederationPanel()
    qtbot.addWidget(panel)
    with qtbot.waitSignal(panel.app_hash_requested):
        panel.use_hash.click()
    panel.set_local_app_hash("sha256:" + "ab" * 32)
    with qtbot.waitSignal(panel.setup_edited) as edited:
        panel.use_hash.click()
    assert edited.args == ["app_hash", "sha256:" + "ab" * 32]
    assert panel.fields["app_hash"].text() == "sha256:" + "ab" * 32


def test_site_setup_is_locked_while_the_site_runs(qtbot):
    panel = FederationPanel()
    qtbot.addWidget(panel)
    panel.set_status("connected", "Connected", True)
    assert all(edit.isReadOnly() for edit in panel.fields.values())
    assert panel.setup_buttons and not any(b.isEnabled() for b in panel.setup_buttons)
    assert not panel.task.isEnabled() and not panel.join_button.isEnabled() and panel.leave_button.isEnabled()
    panel.set_status("stopped", "Stopped", False)
    assert not any(edit.isReadOnly() for edit in panel.fields.values())
    assert all(b.isEnabled() for b in panel.setup_buttons)
