"""The viewer: three orthogonal slice views of a volume, or one photo, with their controls."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSlider,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from fedsm_gui.views.canvas import SliceCanvas

_VIEW_TITLES = {"axial": "Axial", "coronal": "Coronal", "sagittal": "Sagittal", "photo": "Photo"}


class _SlicePane(QWidget):
    """A canvas with its slice slider."""

    def __init__(self, name: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.canvas = SliceCanvas(name, self)
        self.slider = QSlider(Qt.Orientation.Horizontal, self)
        self.slider.setObjectName(f"slider-{name}")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(1, 1, 1, 1)
        layout.setSpacing(2)
        layout.addWidget(self.canvas, 1)
        layout.addWidget(self.slider)


class ViewerWidget(QWidget):
    """Concrete :class:`~fedsm_gui.views.bases.ViewerView`."""

    slice_step_requested = Signal(str, int)
    slice_requested = Signal(str, int)
    cursor_requested = Signal(str, float, float)
    window_drag_requested = Signal(float, float)
    preset_requested = Signal(str)
    zoom_requested = Signal(str, float)
    pan_requested = Signal(str, float, float)
    fit_requested = Signal()
    photo_adjust_requested = Signal(float, float)
    green_toggled = Signal(bool)
    hover_requested = Signal(str, float, float)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.panes: dict[str, _SlicePane] = {}
        self.active_view = "axial"  # the view the arrow keys scroll: last clicked or pointed at
        self._views: tuple[str, ...] = ()
        self.stack = QStackedWidget(self)
        self.empty = QLabel(self)
        self.empty.setObjectName("viewer-empty")
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty.setWordWrap(True)
        self.empty.setStyleSheet("color: #bbb; font-size: 14px; background: #111; padding: 30px;")
        self.stack.addWidget(self.empty)

        volume_page = QWidget(self)
        grid = QGridLayout(volume_page)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setSpacing(3)
        for name, (row, col, rows) in {"axial": (0, 0, 2), "coronal": (0, 1, 1), "sagittal": (1, 1, 1)}.items():
            pane = self._pane(name, volume_page)
            grid.addWidget(pane, row, col, rows, 1)
        grid.setColumnStretch(0, 3)
        grid.setColumnStretch(1, 2)
        self.stack.addWidget(volume_page)

        photo_page = QWidget(self)
        photo_layout = QVBoxLayout(photo_page)
        photo_layout.setContentsMargins(0, 0, 0, 0)
        photo_layout.addWidget(self._pane("photo", photo_page))
        self.panes["photo"].slider.hide()
        self.stack.addWidget(photo_page)

        # volume controls: window presets and the current window
        self.volume_controls = QWidget(self)
        vc = QHBoxLayout(self.volume_controls)
        vc.setContentsMargins(4, 0, 4, 0)
        vc.addWidget(QLabel("Window:"))
        self.presets = QComboBox(self.volume_controls)
        self.presets.setObjectName("window-presets")
        self.presets.textActivated.connect(self.preset_requested)
        vc.addWidget(self.presets)
        self.window_label = QLabel(self.volume_controls)
        self.window_label.setObjectName("window-label")
        vc.addWidget(self.window_label)
        vc.addWidget(QLabel("  right-drag: window/level · wheel, ↑↓, PgUp/PgDn: slices · Ctrl+wheel: zoom"))
        vc.addStretch(1)

        # photo controls: brightness, contrast, green channel
        self.photo_controls = QWidget(self)
        pc = QHBoxLayout(self.photo_controls)
        pc.setContentsMargins(4, 0, 4, 0)
        pc.addWidget(QLabel("Brightness"))
        self.brightness = QSlider(Qt.Orientation.Horizontal)
        self.brightness.setObjectName("brightness")
        self.brightness.setRange(-100, 100)
        pc.addWidget(self.brightness)
        pc.addWidget(QLabel("Contrast"))
        self.contrast = QSlider(Qt.Orientation.Horizontal)
        self.contrast.setObjectName("contrast")
        self.contrast.setRange(-100, 100)  # log scale: 10 ** (v / 100) -> 0.1 .. 10
        pc.addWidget(self.contrast)
        self.green = QCheckBox("Green channel (G)")
        self.green.setObjectName("green-channel")
        self.green.toggled.connect(self.green_toggled)
        pc.addWidget(self.green)
        pc.addStretch(1)
        self.brightness.valueChanged.connect(self._photo_sliders)
        self.contrast.valueChanged.connect(self._photo_sliders)

        self.fit_button = QPushButton("Fit (F)")
        self.fit_button.clicked.connect(self.fit_requested)
        self.measure_button = QPushButton("Measure (D)")
        self.measure_button.setObjectName("measure-button")
        self.measure_button.setCheckable(True)
        self.measure_button.setToolTip("Distance tool: left-drag on a view draws a ruler with its length "
                                       "(mm from the voxel spacing; pixels on photos)")
        self.measure_button.toggled.connect(self._measure_toggled)
        controls = QHBoxLayout()
        controls.addWidget(self.volume_controls)
        controls.addWidget(self.photo_controls)
        controls.addStretch(1)
        controls.addWidget(self.measure_button)
        controls.addWidget(self.fit_button)
        self.readout = QLabel(self)
        self.readout.setObjectName("pixel-readout")
        self.readout.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.readout.setMinimumWidth(10)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.stack, 1)
        layout.addWidget(self.readout)
        layout.addLayout(controls)
        self.set_views(())

    def _pane(self, name: str, parent: QWidget) -> _SlicePane:
        pane = _SlicePane(name, parent)
        canvas = pane.canvas
        canvas.step_requested.connect(lambda step, n=name: self.slice_step_requested.emit(n, step))
        canvas.point_requested.connect(lambda row, col, n=name: self.cursor_requested.emit(n, row, col))
        canvas.window_dragged.connect(self.window_drag_requested)
        canvas.zoom_requested.connect(lambda f, n=name: self.zoom_requested.emit(n, f))
        canvas.pan_requested.connect(lambda dx, dy, n=name: self.pan_requested.emit(n, dx, dy))
        canvas.fit_requested.connect(self.fit_requested)
        canvas.hovered.connect(lambda row, col, n=name: self.hover_requested.emit(n, row, col))
        canvas.activated.connect(lambda n=name: setattr(self, "active_view", n))
        pane.slider.valueChanged.connect(lambda v, n=name: self.slice_requested.emit(n, v))
        self.panes[name] = pane
        return pane

    def _photo_sliders(self) -> None:
        self.photo_adjust_requested.emit(self.brightness.value() / 100.0, 10 ** (self.contrast.value() / 100.0))

    def _measure_toggled(self, on: bool) -> None:
        for pane in self.panes.values():
            pane.canvas.set_measuring(on)

    def step_active(self, step: int) -> None:
        """Scroll the active view by ``step`` slices (the window's arrow and page keys)."""
        if not self._views or self._views == ("photo",):
            return
        view = self.active_view if self.active_view in self._views else self._views[0]
        self.slice_step_requested.emit(view, int(step))

    def canvas(self, view: str) -> SliceCanvas:
        """The canvas of ``view`` (tests and benchmarks drive it directly)."""
        return self.panes[view].canvas

    # --- ViewerView ----------------------------------------------------------------------
    def set_views(self, views: Sequence[str], message: str = "") -> None:
        views = tuple(views)
        self._views = views
        self.readout.setText("")
        for name, pane in self.panes.items():
            pane.canvas.clear()
            pane.canvas.physical_units = name != "photo"
        if not views:
            self.empty.setText(message)
            self.stack.setCurrentIndex(0)
        elif views == ("photo",):
            self.stack.setCurrentIndex(2)
        else:
            self.stack.setCurrentIndex(1)
        self.volume_controls.setVisible(bool(views) and views != ("photo",))
        self.photo_controls.setVisible(views == ("photo",))
        self.fit_button.setEnabled(bool(views))

    def set_slice(self, view: str, image: np.ndarray, overlays: Sequence[np.ndarray],
                  pixel_mm: tuple[float, float], markers: tuple[str, str, str, str] | None,
                  crosshair: tuple[int, int] | None, index: int, count: int) -> None:
        pane = self.panes[view]
        caption = _VIEW_TITLES[view] if view == "photo" else f"{_VIEW_TITLES[view]}  {index + 1}/{count}"
        pane.canvas.set_content(image, list(overlays), pixel_mm, markers, crosshair, caption)
        slider = pane.slider
        slider.blockSignals(True)
        slider.setRange(0, max(count - 1, 0))
        slider.setValue(index)
        slider.blockSignals(False)

    def set_transform(self, view: str, zoom: float, pan_x: float, pan_y: float) -> None:
        self.panes[view].canvas.set_transform(zoom, pan_x, pan_y)

    def set_window(self, center: float, width: float, presets: Sequence[str]) -> None:
        names = list(presets)
        if [self.presets.itemText(i) for i in range(self.presets.count())] != names:
            self.presets.blockSignals(True)
            self.presets.clear()
            self.presets.addItems(names)
            self.presets.blockSignals(False)
        self.window_label.setText(f"level {center:.4g}  width {width:.4g}")

    def set_photo_controls(self, brightness: float, contrast: float, green_only: bool) -> None:
        for widget, value in ((self.brightness, round(brightness * 100)),
                              (self.contrast, round(100 * np.log10(max(contrast, 1e-3))))):
            widget.blockSignals(True)
            widget.setValue(int(value))
            widget.blockSignals(False)
        self.green.blockSignals(True)
        self.green.setChecked(green_only)
        self.green.blockSignals(False)

    def set_readout(self, text: str) -> None:
        self.readout.setText(text)
